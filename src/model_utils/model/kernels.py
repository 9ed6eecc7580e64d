"""Faster kernels for training: Liger's Triton kernels and torch.compile (DeepSpeed's JIT-built ops:
launch/ops.py).

What `--liger` and `--compile` do to the model (weights and state_dict keys never change, so checkpoints stay
interchangeable between the settings):

| liger | compile | applied |
|---|---|---|
| on  | false | Liger RMSNorm, RoPE, SwiGLU and fused linear cross-entropy (logits never materialised) |
| on  | true  | Liger fused linear cross-entropy, run eagerly; the decoder stack compiled by inductor |
| off | true  | the whole model compiled (inductor fuses the norms, RoPE, SwiGLU and the loss's upcast) |

Why not all four Liger kernels inside a compiled graph: Liger 0.8.5 routes its ops through a dispatcher marked
`torch.compiler.disable`, so every layer would break the graph; and its fused linear cross-entropy returns a
wrong loss under torch.compile when labels hold ignore_index (linkedin/Liger-Kernel PR #1338, open) -- which a
causal LM's shifted labels always do. Inductor generates its own fused kernels for the element-wise ops, so the
compiled decoder loses nothing by leaving them to it.

Compilation is in place (`nn.Module.compile`), so DeepSpeed wraps the same module object and checkpoints keep
their keys (no `_orig_mod.` prefix).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model_utils.config.arguments import ModelArgs
from model_utils.errors import ConfigError
from model_utils.launch import ops
from model_utils.observe.log import print0

# --- Liger and torch.compile --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What optimize_model does to a model: decided from the flags, the device and the model type."""

    liger: bool
    compile: bool

    def describe(self) -> str:
        if self.liger and self.compile:
            return "Liger fused linear cross-entropy + torch.compile of the decoder"
        if self.liger:
            return "Liger kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)"
        if self.compile:
            return "torch.compile of the whole model"
        return "eager PyTorch"


LIGER_TABLE = "MODEL_TYPE_TO_APPLY_LIGER_FN"  # liger_kernel.transformers.monkey_patch's model type -> patch


@functools.cache
def liger_model_types() -> frozenset[str] | None:
    """Model types Liger has kernels for; None when liger-kernel is not installed (it is Linux-only).

    Read from the keys of Liger's table in its source when they are a literal dict of strings, as they are:
    importing the module that holds it imports every model Liger patches and the whole of transformers' modeling
    code (1.9 s of `dskit estimate`'s 6 s on 2 cores, and of every GPU preflight), only to read its keys. Else
    imported."""
    spec = importlib.util.find_spec("liger_kernel")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "transformers" / "monkey_patch.py"
    with contextlib.suppress(OSError, SyntaxError, ValueError):
        for node in ast.parse(source.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == [LIGER_TABLE]
                and isinstance(node.value, ast.Dict)
                and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.value.keys)
            ):
                return frozenset(k.value for k in node.value.keys)  # type: ignore[union-attr]
    try:
        table = importlib.import_module("liger_kernel.transformers.monkey_patch")
    except ImportError:
        return None
    return frozenset(getattr(table, LIGER_TABLE))


def plan(
    model_args: ModelArgs,
    model_type: str,
    device: torch.device,
    supported_types: Callable[[], frozenset[str] | None] = liger_model_types,
) -> Plan:
    """Resolve --liger auto|on|off for this device and model; a request that cannot be met is a ConfigError."""
    use_liger = False
    if model_args.liger != "off":
        if device.type != "cuda":
            if model_args.liger == "on":
                raise ConfigError(
                    f"--liger on needs a CUDA GPU (Liger's kernels are Triton GPU kernels) but this run is on "
                    f"{device.type}: use --liger auto (off without a GPU) or --liger off"
                )
        else:
            types = supported_types()
            if types is None or model_type not in types:
                reason = (
                    "liger-kernel is not installed"
                    if types is None
                    else f"Liger has no kernels for model type {model_type!r}"
                )
                if model_args.liger == "on":
                    raise ConfigError(f"--liger on: {reason}: use --liger auto or --liger off")
                print0(f"--liger auto: off ({reason})")
            else:
                use_liger = True
    return Plan(liger=use_liger, compile=model_args.compile)


def _zero3_partitioned(param: torch.Tensor) -> bool:
    # DeepSpeed ZeRO-3 tags the parameters it partitions; their data is an empty shard outside the owning
    # module's forward.
    return hasattr(param, "ds_id")


def _flce_unless_zero3(model: Any, liger_forward: Callable[..., Any]) -> Callable[..., Any]:
    """The Liger forward, except under ZeRO-3, where it would read lm_head.weight as an empty shard.

    Liger's fused loss reads `lm_head.weight` without calling the lm_head module, so DeepSpeed ZeRO-3 never
    gathers it (the failure TRL reports as "size mismatch", huggingface/trl#3368). There the model's own forward
    runs instead; the other Liger kernels stay on.
    """
    original_forward = type(model).forward.__get__(model)
    warned = False

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal warned
        if _zero3_partitioned(model.lm_head.weight):
            if not warned:
                print0("ZeRO-3: Liger's fused linear cross-entropy is off (lm_head.weight is partitioned)")
                warned = True
            return original_forward(*args, **kwargs)
        return liger_forward(*args, **kwargs)

    return forward


def _apply_liger(model: Any, fused_linear_cross_entropy_only: bool) -> None:
    from model_utils.compat import liger_internals

    others = not fused_linear_cross_entropy_only
    liger_internals.apply_to_instance(
        model,
        rope=others,
        rms_norm=others,
        swiglu=others,
        cross_entropy=False,
        fused_linear_cross_entropy=True,
    )
    if "forward" in vars(model):  # Liger bound its loss-fused forward on the instance (Qwen3, Llama, ...)
        model.forward = _flce_unless_zero3(model, model.forward)


def apply_plan(model: Any, chosen: Plan, compile_model: bool = True) -> Any:
    """Apply a plan to a model; compile_model=False applies everything but the compilation (memory probes)."""
    if chosen.liger:
        _apply_liger(model, fused_linear_cross_entropy_only=chosen.compile)
    if chosen.compile and compile_model:
        # Liger's fused loss stays outside the compiled graph (see the module docstring): compile the decoder.
        decoder = getattr(model, model.base_model_prefix, model)
        (decoder if chosen.liger else model).compile()
    return model


def optimize_model(model: Any, model_args: ModelArgs, device: torch.device) -> Any:
    """Apply --liger and --compile to a freshly built model (before deepspeed.initialize); returns the model.

    Also prepares the environment for the ops deepspeed.initialize builds next (prepare_jit_env).
    """
    ops.prepare_jit_env()
    chosen = plan(model_args, model.config.model_type, device)
    apply_plan(model, chosen)
    if chosen.liger or chosen.compile:
        print0(f"Model: {chosen.describe()}" + (" (compiles on the first step)" if chosen.compile else ""))
    return model
