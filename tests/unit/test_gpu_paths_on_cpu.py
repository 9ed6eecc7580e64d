"""The GPU-only paths, run on CPU wherever a real mechanism exists (issue #17, item 4).

- Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) and the kit's Liger patching of a
  tiny Qwen3, eager and beside inductor's compiled decoder: under Triton's CPU interpreter (TRITON_INTERPRET=1,
  in a process of its own: tests/support/liger_interpreted.py, which says which interpreter gaps it bridges).
- `--micro_batch_size auto`: autobatch.resolve and its real _GpuProbe against a fake GPU whose memory is the
  real bytes of the probe's CPU tensors (tests/support/fake_gpu.py); only the GPU is faked.
- Pinned batches: pinning needs a CUDA driver, so the pin and the non-blocking copy are recorded on CPU tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model_utils.config.arguments import CUDA_GLOBAL_BATCH_TOKENS, parse_args
from model_utils.data import step_batches
from model_utils.data.sampler import BlockSampler, DataPosition
from model_utils.errors import ConfigError
from model_utils.launch import startup
from model_utils.model import kernels
from model_utils.resolve import micro_batch_probe, resolver
from support.fake_gpu import FakeGpuMemory

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
_PLAIN = kernels.Plan(liger=False, compile=False)  # Liger needs Triton on a GPU (or the interpreter above)

# --- Liger's kernels under Triton's interpreter -------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """All parts in one process: the interpreter's start-up (importing triton, liger, transformers) once."""
    out = tmp_path_factory.mktemp("liger") / "interpreted.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO / "tests")}
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


# --- --micro_batch_size auto against a fake GPU ---------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpuMemory:
    """A fake GPU for autobatch: DeepSpeed's accelerator says cuda, torch.cuda's memory queries read the fake,
    and the probe's model lives on the CPU (its tensors are the fake GPU's memory). The capacity is set by the
    test. Everything else, the probe's forward and backward, its ballast, search, cache and cap, is real."""
    memory = FakeGpuMemory(total_memory=2**62)
    memory.install(monkeypatch)
    memory.builds = 0
    startup.import_deepspeed()
    import deepspeed.accelerator

    monkeypatch.setattr(
        deepspeed.accelerator, "get_accelerator", lambda: types.SimpleNamespace(device_name=lambda: "cuda")
    )

    class OnFakeGpu(micro_batch_probe._GpuProbe):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)  # the limit from the fake's total memory
            self.device = CPU

        def _build(self) -> Any:
            memory.builds += 1
            return super()._build()

        def __call__(self, batch: int) -> bool:
            with memory:
                return super().__call__(batch)

    monkeypatch.setattr(micro_batch_probe, "_GpuProbe", OnFakeGpu)
    return memory


def _ds_config(path: Path, offload: bool) -> Path:
    zero: dict[str, Any] = {
        "stage": 2,
        "overlap_comm": False,
        "reduce_bucket_size": 500_000,
        "allgather_bucket_size": 500_000,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    path.write_text(
        json.dumps({"bf16": {"enabled": True}, "zero_optimization": zero, "gradient_accumulation_steps": 1})
    )
    return path


def test_auto_micro_batch_finds_what_fits_beside_deepspeed_on_a_fake_gpu(
    tmp_path: Path, fake_gpu: FakeGpuMemory
) -> None:
    cache_dir = tmp_path / "cache"

    def settings(offload: bool) -> resolver.RunSettings:
        config = _ds_config(tmp_path / f"ds_{offload}.json", offload)
        flags = ["--micro_batch_size", "auto", "--seq_length", "32", "--liger", "off"]
        return resolver.resolve_settings(
            parse_args([*flags, "--deepspeed_config", str(config), "--data_cache_dir", str(cache_dir)])
        )

    offloaded, on_gpu = settings(offload=True), settings(offload=False)
    # What forward and backward take at each size with no ballast (weights, gradients, activations): the
    # probe itself, on the unlimited fake.
    probe = micro_batch_probe._GpuProbe(offloaded.model_config, offloaded.train.torch_dtype(), _PLAIN, 32, 0)
    peaks = {}
    for batch in (1, 2, 4, 8):
        assert probe(batch)
        peaks[batch] = fake_gpu.peak
    probe.close()
    assert peaks[1] < peaks[2] < peaks[4] < peaks[8]
    n_params = _n_params(offloaded)
    reserve = {
        name: micro_batch_probe.gpu_reserve_bytes(
            s.train.deepspeed_json(micro_batch_size=1, total_steps=1), n_params, 1
        )
        for name, s in (("offloaded", offloaded), ("on_gpu", on_gpu))
    }
    assert reserve["on_gpu"] == reserve["offloaded"] + 16 * n_params  # the optimizer states stay on the GPU
    # A GPU on which micro batch 4 fits beside the offload config's reserve and 8 does not.
    limit = reserve["offloaded"] + (peaks[4] + peaks[8]) // 2
    fake_gpu.total_memory = int(limit / micro_batch_probe.HEADROOM)
    fake_gpu.builds = 0

    assert micro_batch_probe.resolve(offloaded, n_train_blocks=10**6, n_val_blocks=None, world_size=1) == 4
    assert fake_gpu.builds == 1
    # The optimizer states the GPU-only config keeps there leave room for less.
    expected = max((b for b in peaks if peaks[b] + reserve["on_gpu"] <= limit), default=None)
    assert expected is None or expected < 4, (
        peaks,
        reserve,
        limit,
    )  # the sizes must make the test meaningful
    if expected is None:
        with pytest.raises(ConfigError, match="even micro batch 1 does not fit Fake GPU"):
            micro_batch_probe.resolve(on_gpu, 10**6, None, 1)
    else:
        assert micro_batch_probe.resolve(on_gpu, 10**6, None, 1) == expected

    # Cached per key in --data_cache_dir; a later run (any node sharing it) builds no probe model.
    stored = json.loads((cache_dir / micro_batch_probe.CACHE_FILE).read_text())
    (key,) = [k for k in stored if f"reserve {reserve['offloaded'] // 2**20} MiB" in k]
    assert "Fake GPU" in key and "seq 32" in key and stored[key]["micro_batch_size"] == 4
    builds = fake_gpu.builds
    assert micro_batch_probe.resolve(offloaded, 10**6, None, 1) == 4
    assert (
        micro_batch_probe.resolve(offloaded, n_train_blocks=3, n_val_blocks=None, world_size=1) == 3
    )  # the data caps
    assert micro_batch_probe.resolve(offloaded, 10**6, n_val_blocks=2, world_size=1) == 2
    assert fake_gpu.builds == builds


def test_the_probe_survives_running_out_of_fake_gpu_memory(fake_gpu: FakeGpuMemory) -> None:
    """An allocation past the capacity raises torch.OutOfMemoryError inside forward/backward, as CUDA's
    allocator does: the probe says it does not fit, frees what it held, and the next size can be tried."""
    config = resolver.resolve_settings(parse_args(["--seq_length", "32"])).model_config
    probe = micro_batch_probe._GpuProbe(config, torch.bfloat16, _PLAIN, 32, 0)
    assert probe(1)
    one = fake_gpu.peak
    fake_gpu.total_memory = one + 1  # batch 1 and its ballast-free peak fit, batch 4 cannot
    assert not probe(4)
    assert fake_gpu.live < one  # the failed try's activations and gradients are gone
    assert probe(1)  # and the same probe goes on


def test_cuda_ranks_default_to_auto_micro_batch_and_the_global_batch(
    tmp_path: Path, fake_gpu: FakeGpuMemory, capsys: pytest.CaptureFixture[str]
) -> None:
    """On CUDA ranks without a batch flag: micro batch auto (probed on the fake GPU) and the accumulation that
    makes CUDA_GLOBAL_BATCH_TOKENS; a batch flag keeps the embedded default; the ranks choose the default
    DeepSpeed config from their GPU's memory."""
    flags = ["--seq_length", "32", "--liger", "off", "--data_cache_dir", str(tmp_path / "cache")]
    flags += ["--checkpoint_dir", str(tmp_path / "ckpt")]
    settings = resolver.resolve_settings(parse_args(flags))
    reserve = micro_batch_probe.gpu_reserve_bytes(settings.train.deepspeed_json(1, 1), _n_params(settings), 1)
    fake_gpu.total_memory = reserve + 2**24  # 16 MiB beside DeepSpeed's reserve: a few sequences of 32 fit
    run = resolver.prepare(settings.config, world_size=1, settings=settings)
    micro = run.micro_batch_size
    assert isinstance(micro, int) and 1 < micro < micro_batch_probe.MAX_MICRO_BATCH  # probed, not the CPU's 1
    assert run.gradient_accumulation_steps == round(CUDA_GLOBAL_BATCH_TOKENS / (micro * 32))
    out = capsys.readouterr().out
    assert f"--global_batch_tokens {CUDA_GLOBAL_BATCH_TOKENS}" in out
    assert f"requested {CUDA_GLOBAL_BATCH_TOKENS} (the CUDA default), +0.0%" in out
    # The ranks resolve the settings themselves: on a GPU this roomy the default config is the GPU-only one.
    given = resolver.prepare(parse_args([*flags, "--micro_batch_size", "2"]), world_size=1)
    assert (given.micro_batch_size, given.gradient_accumulation_steps) == (2, 1)
    assert given.settings.train.path == "deepspeed/ds_config_gpu.json"
    out = capsys.readouterr().out
    assert (
        "CUDA batch default" not in out and "deepspeed config: deepspeed/ds_config_gpu.json (GPU-only" in out
    )


def _n_params(s: resolver.RunSettings) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(s.model_config).parameters())


# --- pinned batches -------------------------------------------------------------------------------------------


def test_pinning_needs_a_cuda_driver() -> None:
    """Why the next test records the pin instead of pinning: if this starts to pass, pin for real."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: tests/unit/test_batches.py pins for real")
    with pytest.raises(RuntimeError, match="NVIDIA driver"):
        torch.arange(3).pin_memory()


@pytest.mark.parametrize(("device", "pinned"), [(torch.device("cuda", 0), True), (CPU, False)])
def test_batches_for_a_gpu_are_pinned_in_the_worker_and_copied_without_blocking(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, pinned: bool
) -> None:
    """StepBatches on a CUDA device: rows pinned off the training thread, copies non_blocking; on CPU neither.
    pin_memory and Tensor.to are recorded instead of run (they need a CUDA driver; what they do on a GPU is in
    tests/unit/test_batches.py, marked gpu)."""
    pins: list[str] = []
    copies: list[tuple[torch.device, bool]] = []
    to = torch.Tensor.to

    def pin_memory(self: torch.Tensor) -> torch.Tensor:
        pins.append(threading.current_thread().name)
        return self

    def record_to(self: torch.Tensor, target: Any, non_blocking: bool = False) -> torch.Tensor:
        copies.append((target, non_blocking))
        return to(self, CPU)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", record_to)
    blocks = np.arange(40 * 8, dtype=np.int32).reshape(40, 8)
    sampler = BlockSampler(40, micro_batch=2, grad_accum=2, dp_rank=0, dp_world=1, seed=0)
    loader = step_batches.StepBatches(blocks, sampler, device)
    first = DataPosition()
    loader.at(first)  # nothing prepared: read (and pinned) here, the next step in the worker
    loader._ahead[1].result()
    main = threading.current_thread().name
    assert pins == ([main] * 2 + ["dskit-data_0"] * 2 if pinned else [])
    pins.clear()
    got = loader.at(sampler.advance(first))  # the prepared step: nothing pinned on the training thread
    loader._ahead[1].result()
    loader.close()
    want = [
        torch.from_numpy(blocks[idx].astype(np.int64)) for idx in sampler.step_indices(sampler.advance(first))
    ]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert copies[-2:] == [(device, pinned)] * 2  # the step's two micro-batches
    assert pins == (["dskit-data_0"] * 2 if pinned else [])  # the step after, in the worker
