"""Liger's private parts the kit uses (compat/liger_internals.py): an upgrade that removes one fails here, by name;
and the undo of its patches restores the module it patched."""

from __future__ import annotations

from model_utils.compat import liger_internals
from model_utils.model import kernels
from support.pretrained import tiny_model


def test_the_instance_patch_is_there() -> None:
    import liger_kernel.transformers as liger

    assert callable(getattr(liger, "_apply_liger_kernel_to_instance", None)), (
        "liger_kernel.transformers has no _apply_liger_kernel_to_instance: update "
        "src/model_utils/compat/liger_internals.py (the kit patches one model instance through it)"
    )


def test_liger_patches_on_an_instance_are_undone_for_a_probe_model() -> None:
    """Liger's real patching (its kernels need a GPU): RoPE is swapped module-wide; patches_undone restores it."""
    from transformers.models.qwen3 import modeling_qwen3

    rope, norm, mlp = (
        modeling_qwen3.apply_rotary_pos_emb,
        modeling_qwen3.Qwen3RMSNorm,
        modeling_qwen3.Qwen3MLP,
    )
    model = tiny_model()
    with liger_internals.patches_undone(model):
        kernels.apply_plan(model, kernels.Plan(liger=True, compile=False))
        assert modeling_qwen3.apply_rotary_pos_emb is not rope and modeling_qwen3.Qwen3RMSNorm is not norm
        assert type(model).__name__ == "Qwen3ForCausalLM" and "forward" in vars(model)
    assert (modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3MLP) == (
        rope,
        norm,
        mlp,
    )
    # With compile on, only the fused loss comes from Liger: nothing module-wide changes.
    model = tiny_model()
    with liger_internals.patches_undone(model):
        kernels.apply_plan(model, kernels.Plan(liger=True, compile=True), compile_model=False)
        assert modeling_qwen3.apply_rotary_pos_emb is rope and modeling_qwen3.Qwen3RMSNorm is norm
        assert "forward" in vars(model)
