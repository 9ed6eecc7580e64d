"""--liger and --compile: which kernels for which device, and their numbers.

Without a GPU: the CPU tests check the decisions (which kernels for which device) and Liger's real patching. The
tests marked `gpu` check the kernels' numbers and inductor on a CUDA GPU (skipped here). Liger's Triton kernels
under Triton's CPU interpreter: tests/e2e/test_liger_on_cpu.py; torch.compile through the real Trainer and each
engine: tests/e2e/test_model_setup.py.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from dskit import cli
from model_utils.compat import liger_internals
from model_utils.config.arguments import ModelArgs
from model_utils.errors import ConfigError
from model_utils.model import kernels
from support.compiled import compiled_in_place
from support.pretrained import tiny_model

REPO = Path(__file__).resolve().parents[3]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# --- --liger and --compile: what is applied where ------------------------------------------------------------


@pytest.mark.parametrize(
    ("liger", "device", "types", "expected"),
    [
        ("auto", CPU, None, False),
        ("off", CUDA, None, False),
        ("auto", CUDA, "real", True),  # Liger's own table of supported model types
        ("on", CUDA, "real", True),
        ("auto", CUDA, "none", False),  # liger-kernel not installed
        ("auto", CUDA, "other", False),  # a model type Liger has no kernels for
    ],
)
def test_liger_resolves_per_device_and_model(liger: str, device: torch.device, types, expected: bool) -> None:
    supported = {
        None: kernels.liger_model_types,
        "real": kernels.liger_model_types,
        "none": lambda: None,
        "other": lambda: frozenset({"llama"}),
    }[types]
    chosen = kernels.plan(ModelArgs(liger=liger, compile=True), "qwen3", device, supported)
    assert (chosen.liger, chosen.compile) == (expected, True)
    assert "qwen3" in kernels.liger_model_types()


def test_liger_model_types_read_from_its_source_equal_its_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read without importing Liger's patch module (it imports every model Liger patches); the same as the table
    that module defines; imported after all where its source holds no literal table; None without liger-kernel."""
    import importlib.util
    import types

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    kernels.liger_model_types.cache_clear()
    imported = sys.modules.pop("liger_kernel.transformers.monkey_patch")
    try:
        assert kernels.liger_model_types() == frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)
        assert "liger_kernel.transformers.monkey_patch" not in sys.modules  # read, not imported
    finally:
        sys.modules["liger_kernel.transformers.monkey_patch"] = imported
    built = tmp_path / "liger_kernel" / "transformers"
    built.mkdir(parents=True)
    (built / "monkey_patch.py").write_text("MODEL_TYPE_TO_APPLY_LIGER_FN = dict(TABLE)\n")
    spec = types.SimpleNamespace(submodule_search_locations=[str(built.parent)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    kernels.liger_model_types.cache_clear()
    assert kernels.liger_model_types() == frozenset(
        MODEL_TYPE_TO_APPLY_LIGER_FN
    )  # the installed one, imported
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    kernels.liger_model_types.cache_clear()
    assert kernels.liger_model_types() is None
    kernels.liger_model_types.cache_clear()


@pytest.mark.parametrize(
    ("device", "types", "message"),
    [
        (CPU, kernels.liger_model_types, "--liger on needs a CUDA GPU"),
        (CUDA, lambda: None, "--liger on: liger-kernel is not installed: use --liger auto or --liger off"),
        (CUDA, lambda: frozenset({"llama"}), "--liger on: Liger has no kernels for model type 'qwen3'"),
    ],
)
def test_liger_on_that_cannot_be_met_is_an_error(device: torch.device, types, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        kernels.plan(ModelArgs(liger="on"), "qwen3", device, types)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_liger_on_on_cpu_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--liger", "on"]) == 2
    assert cli.main(["config", "--liger", "maybe"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --liger on needs a CUDA GPU (Liger's kernels are Triton GPU kernels) but this run is on cpu: "
        "use --liger auto (off without a GPU) or --liger off",
        "error: --liger 'maybe' is not one of auto, on, off",
    ]


def test_liger_loss_falls_back_to_the_model_forward_under_zero3() -> None:
    """Under ZeRO-3 lm_head.weight is an empty shard that Liger would read; the model's own forward runs then.
    The Liger forward is a stand-in here (its Triton kernel cannot run on CPU); `ds_id` is DeepSpeed's tag."""
    model, reference = tiny_model(), tiny_model()
    calls = []

    def liger_forward(**kwargs):
        calls.append(kwargs)
        return "liger"

    forward = kernels._flce_unless_zero3(model, liger_forward)
    ids = torch.randint(0, 2048, (2, 16))
    assert forward(input_ids=ids, labels=ids) == "liger" and len(calls) == 1
    model.lm_head.weight.ds_id = 0  # what ZeRO-3 sets on the parameters it partitions
    loss = forward(input_ids=ids, labels=ids).loss
    assert len(calls) == 1 and torch.allclose(loss, reference(input_ids=ids, labels=ids).loss)


# --- on a GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_liger_matches_eager_on_gpu(compiled: bool) -> None:
    """Liger's kernels (all four; with compile only the fused loss, beside inductor) against plain eager."""
    eager = tiny_model().to("cuda")
    fast = copy.deepcopy(eager)
    ids = torch.randint(0, 2048, (4, 128), device="cuda")
    loss_eager = eager(input_ids=ids, labels=ids).loss
    loss_eager.backward()
    with torch.no_grad():
        logits_eager = eager.eval()(input_ids=ids).logits
    with liger_internals.patches_undone(fast):  # computed before: Liger swaps RoPE module-wide
        kernels.optimize_model(fast, ModelArgs(liger="on", compile=compiled), CUDA)
        assert compiled_in_place(fast.model) is compiled
        out = fast.train()(input_ids=ids, labels=ids)
        assert out.logits is None  # training: Liger's fused loss never materialises the logits
        out.loss.backward()
        assert out.loss.item() == pytest.approx(loss_eager.item(), rel=1e-4)
        for (name, a), b in zip(eager.named_parameters(), fast.parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-3), name
        with torch.no_grad():
            logits = fast.eval()(input_ids=ids).logits
        assert torch.allclose(logits, logits_eager, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_inductor_compile_matches_eager_on_gpu() -> None:
    eager = tiny_model().to("cuda")
    fast = copy.deepcopy(eager)
    kernels.optimize_model(fast, ModelArgs(liger="off", compile=True), CUDA)
    ids = torch.randint(0, 2048, (4, 128), device="cuda")
    losses = [m(input_ids=ids, labels=ids).loss for m in (eager, fast)]
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-4)
