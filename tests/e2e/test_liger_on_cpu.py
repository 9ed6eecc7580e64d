"""Liger's GPU kernels run on CPU: its four Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) and
the kit's Liger patching of tiny-qwen3 (eager, and beside inductor's compiled decoder) against eager under Triton's
CPU interpreter (TRITON_INTERPRET=1, in a process of its own: tests/support/liger_interpreted.py, which says
which interpreter gaps it bridges). Out of the unit tier for its ~35 s; the kit's Liger decisions and patching:
tests/unit/model/test_kernels.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from support.torchrun import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """All parts in one process: the interpreter's start-up (importing triton, liger, transformers) once."""
    out = tmp_path_factory.mktemp("liger") / "interpreted.json"
    # This checkout's src, whichever checkout the environment was installed from.
    pythonpath = os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/support/liger_interpreted.py"), str(out)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _result(interpreted: dict[str, Any], part: str) -> dict[str, Any]:
    result = interpreted["parts"][part]
    if "error" in result:
        if result["error"].startswith(
            "InterpreterError"
        ):  # a limit of the interpreter, not of Liger or the kit
            pytest.skip(
                f"Triton {interpreted['triton']}'s CPU interpreter cannot run Liger's {part}: {result['error']}"
            )
        pytest.fail(f"{part}: {result['error']}\n{result['traceback']}")
    return result


@pytest.mark.parametrize(
    ("part", "kernels_run"),
    [
        ("rms_norm", ["_rms_norm_backward_kernel", "_rms_norm_forward_kernel"]),
        ("rope", ["_triton_rope"]),  # one kernel, both directions
        ("swiglu", ["_swiglu_backward_kernel", "_swiglu_forward_kernel"]),
        ("fused_linear_cross_entropy", ["element_mul_kernel", "liger_cross_entropy_kernel"]),
    ],
)
def test_liger_kernel_matches_eager_under_the_triton_interpreter(
    interpreted: dict[str, Any], part: str, kernels_run: list[str]
) -> None:
    """Each kernel the kit applies against the Hugging Face Qwen3 module it replaces: fp32, small shapes."""
    result = _result(interpreted, part)
    assert result["kernels"] == kernels_run  # Liger's Triton kernels ran, not a PyTorch fallback
    assert result["forward"] < 1e-5 and result["gradients"] < 1e-5, result


def test_kit_liger_patching_trains_like_eager_under_the_triton_interpreter(
    interpreted: dict[str, Any],
) -> None:
    """kernels.apply_plan with Liger on (as optimize_model applies it on CUDA): one step of tiny-qwen3."""
    result = _result(interpreted, "model_step")
    assert {
        "_rms_norm_forward_kernel",
        "_swiglu_forward_kernel",
        "_triton_rope",
        "liger_cross_entropy_kernel",
    } <= set(result["kernels"])
    assert not result["logits_materialised"]  # the fused loss never builds the logits
    assert result["loss"] == pytest.approx(result["loss_eager"], rel=1e-6)
    assert result["gradients"] < 1e-5


def test_liger_loss_beside_the_inductor_compiled_decoder_under_the_triton_interpreter(
    interpreted: dict[str, Any],
) -> None:
    """--liger on --compile: the decoder compiled by inductor (CPU backend), Liger's fused loss eagerly on its
    output, with labels holding ignore_index (the case Liger's loss gets wrong inside a compiled graph)."""
    result = _result(interpreted, "compiled_model_step")
    assert result["compiled_in_place"]
    assert result["kernels"] == ["liger_cross_entropy_kernel"]  # norms, RoPE and SwiGLU left to inductor
    assert result["loss"] == pytest.approx(result["loss_eager"], rel=1e-6)
    assert result["gradients"] < 1e-5
