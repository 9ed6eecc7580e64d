"""Liger's Triton kernels on CPU tensors under Triton's interpreter, against eager PyTorch; run as a script.

`TRITON_INTERPRET=1 python liger_interpreted.py OUT.json [PART ...]` writes, per part, the largest forward and
gradient differences from eager, the Triton kernels that ran, or the error that stopped the part. The
environment variable must be set before triton is imported, hence a process of its own (tests/e2e/
test_liger_on_cpu.py starts it).

Two gaps in Triton 3.9's interpreter would stop the RMSNorm and SwiGLU kernels, so this script bridges them,
only where they are found (each one is named in the output):
- float scalar arguments reach the kernel as Python floats (the interpreter converts bools, ints and pointers
  only), so Liger's `eps.to(tl.float32)` / `gate_multiplier.to(tl.float32)` fail with "'float' object has no
  attribute 'to'". Compiled Triton passes a Python float as an fp32 scalar: so does the bridge.
- `triton.language.extra.libdevice` functions are bodiless stubs the interpreter never replaces (they are
  lowered to CUDA's libdevice by the compiler), so Liger's RMSNorm, which imports `rsqrt` from there, gets None.
  The bridge points it at `tl.math.rsqrt`, which the interpreter implements: the same function, and the import
  Liger itself falls back to on Triton < 3.0.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (read when triton is imported)"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

BRIDGES: list[str] = []
LAUNCHED: list[str] = []  # the Triton kernels the interpreter ran, in order


def _bridge_interpreter_gaps() -> None:
    convert = interpreter._implicit_cvt
    if not isinstance(convert(0.5), tl.tensor):

        def with_floats(arg: Any) -> Any:
            if isinstance(arg, float):
                return tl.tensor(
                    interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32
                )
            return convert(arg)

        interpreter._implicit_cvt = with_floats
        BRIDGES.append("float scalar arguments passed as fp32 (the interpreter left them Python floats)")
    import liger_kernel.ops.rms_norm as rms_norm

    if getattr(rms_norm.rsqrt, "__module__", "").startswith("triton.language.extra"):
        # Looked up when the kernel runs, when the interpreter has patched tl.math.
        rms_norm.rsqrt = lambda x: tl.math.rsqrt(x)
        BRIDGES.append("libdevice rsqrt -> tl.math.rsqrt (the interpreter has no libdevice)")
    run = interpreter.GridExecutor.__call__

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        LAUNCHED.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = recording


def _max_diff(a: Any, b: Any) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b, strict=True))


def _compare(
    fast: Callable[..., Any], eager: Callable[..., Any], inputs: list[torch.Tensor]
) -> dict[str, Any]:
    """Forward outputs, and gradients of the inputs (and of parameters the callables' owners hold) under one
    random cotangent."""
    outs = []
    grads = []
    for fn in (fast, eager):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*xs)
        out = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(1)
        cot = [torch.randn(o.shape) for o in out]  # not randn_like: Liger's RoPE returns transposed strides
        wrt = [x for x in xs if x.requires_grad] + list(getattr(fn, "parameters", list)())
        grads.append(torch.autograd.grad(out, wrt, cot))
        outs.append(out)
    return {"forward": _max_diff(*outs), "gradients": _max_diff(*grads)}


def rms_norm() -> dict[str, Any]:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    eager, fast = Qwen3RMSNorm(64, eps=1e-6), LigerRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        eager.weight.uniform_(0.5, 1.5)
        fast.weight.copy_(eager.weight)
    return _compare(fast, eager, [torch.randn(2, 8, 64)])


def rope() -> dict[str, Any]:
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    head_dim, seq = 16, 8
    freqs = torch.arange(seq)[:, None] / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    emb = torch.cat([freqs, freqs], -1).expand(2, seq, head_dim)
    cos, sin = emb.cos(), emb.sin()
    q, k = torch.randn(2, 4, seq, head_dim), torch.randn(2, 2, seq, head_dim)  # grouped-query: fewer k heads
    return _compare(
        lambda q, k: liger_rotary_pos_emb(q, k, cos, sin),
        lambda q, k: apply_rotary_pos_emb(q, k, cos, sin),
        [q, k],
    )


def swiglu() -> dict[str, Any]:
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    from model_utils.config.presets import PRESETS

    config = PRESETS["tiny-qwen3"].build_config()
    torch.manual_seed(0)
    eager = Qwen3MLP(config)
    fast = LigerSwiGLUMLP(config)
    fast.load_state_dict(eager.state_dict())
    return _compare(fast, eager, [torch.randn(2, 8, config.hidden_size)])


def fused_linear_cross_entropy() -> dict[str, Any]:
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    hidden, weight = torch.randn(24, 32), torch.randn(100, 32)
    labels = torch.randint(0, 100, (24,))
    labels[::5] = -100  # a causal LM's shifted labels always hold ignore_index
    flce = LigerFusedLinearCrossEntropyLoss()
    return _compare(
        lambda h, w: flce(w, h, labels),
        lambda h, w: torch.nn.functional.cross_entropy(h @ w.T, labels, ignore_index=-100),
        [hidden, weight],
    )


def _model_step(compiled: bool) -> dict[str, Any]:
    """One forward and backward of the tiny Qwen3 with the kit's Liger patching (kernels.apply_plan) against
    the same weights eagerly."""
    from transformers import AutoModelForCausalLM

    from model_utils.compat import liger_internals
    from model_utils.config.presets import PRESETS
    from model_utils.model import kernels
    from support.compiled import compiled_in_place

    config = PRESETS["tiny-qwen3"].build_config()
    # One layer: every layer is patched alike, and the interpreter's time (and inductor's compile time on 2 cores)
    # grows with the layers.
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    fast = copy.deepcopy(eager)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    loss_eager = eager(input_ids=ids, labels=ids).loss
    loss_eager.backward()
    with liger_internals.patches_undone(fast):
        kernels.apply_plan(fast, kernels.Plan(liger=True, compile=compiled))
        out = fast(input_ids=ids, labels=ids)
        out.loss.backward()
    grads = [(a.grad, b.grad) for a, b in zip(eager.parameters(), fast.parameters(), strict=True)]
    return {
        "loss_eager": loss_eager.item(),
        "loss": out.loss.item(),
        "logits_materialised": out.logits is not None,
        "gradients": max(float((a - b).abs().max()) for a, b in grads),
        "compiled_in_place": compiled_in_place(fast.model),
    }


PARTS: dict[str, Callable[[], dict[str, Any]]] = {
    "rms_norm": rms_norm,
    "rope": rope,
    "swiglu": swiglu,
    "fused_linear_cross_entropy": fused_linear_cross_entropy,
    "model_step": lambda: _model_step(compiled=False),
    "compiled_model_step": lambda: _model_step(compiled=True),
}


def main(out_path: str, parts: list[str]) -> None:
    _bridge_interpreter_gaps()
    results: dict[str, Any] = {"triton": triton.__version__, "bridges": BRIDGES, "parts": {}}
    for name in parts or list(PARTS):
        LAUNCHED.clear()
        torch.manual_seed(0)
        try:
            result = PARTS[name]()
        except Exception as e:  # recorded for the test to report, with the kernel it stopped in
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-4)}
        result["kernels"] = sorted(set(LAUNCHED))
        results["parts"][name] = result
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
