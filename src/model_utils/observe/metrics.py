"""What a logging step measures: throughput, model FLOPs utilisation, memory and time spent waiting for data.

FLOPs per token follow the usual accounting (Kaplan/PaLM): 6N for the matmuls of forward and backward, N being
the parameters that take part in matmuls (the input embedding is a lookup; a tied embedding counts once, as the
output projection), plus causal self-attention: 6 * layers * (heads * head_dim) * seq per token (QK^T and AV,
forward and backward, half of the square because of the causal mask, as flash kernels compute it).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil
import torch

GIB = 1024**3


def perplexity(loss: float) -> float:
    """exp of a mean loss in nats, capped so that a diverged loss stays a number."""
    return math.exp(min(loss, 50.0))


@dataclass(frozen=True)
class Score:
    """What a validation measured over some target tokens: their summed loss in nats, how many there were, and the
    UTF-8 bytes of text they decode to (data/token_bytes.py)."""

    nats: float
    targets: int
    bytes: int

    @classmethod
    def combined(cls, scores: list[Score]) -> Score:
        """One score over the target tokens of all of `scores` (a mixture's sources)."""
        return cls(sum(s.nats for s in scores), sum(s.targets for s in scores), sum(s.bytes for s in scores))

    @property
    def loss(self) -> float:
        return self.nats / max(self.targets, 1)

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)

    @property
    def bits_per_byte(self) -> float:
        """Bits per byte of text: comparable across tokenizers, where loss and perplexity per token are not."""
        return self.nats / (math.log(2) * self.bytes) if self.bytes else float("nan")


@dataclass(frozen=True)
class Validation:
    """One validation, the same on every rank: what it measured over the blocks it read, how many it read, and
    how long it took."""

    score: Score  # over every target token of the blocks read, on all ranks
    blocks: int  # validation blocks read, over all ranks
    total_blocks: int  # validation blocks there are (--validation_batches all reads each once)
    seconds: float  # its wall time (rank 0's, which ends with the collective every rank takes part in)
    sources: tuple[tuple[str, Score], ...] = ()  # a mixture's: each source's over its own blocks read
    # A preference objective's metrics over the pairs read (engines/preference.py KEYS); the score's targets are
    # those pairs, and its loss their mean loss.
    preference: dict[str, float] | None = None

    @property
    def loss(self) -> float:
        return self.score.loss

    @property
    def targets(self) -> int:
        return self.score.targets

    @property
    def full(self) -> bool:
        return self.blocks == self.total_blocks


# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) from the vendor data sheets; the first entry whose
# every word appears in the device name wins, so the specific names come before the general ones.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM (torch reports e.g. "NVIDIA H100 80GB HBM3")
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("B200", 2250.0),
)


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The device's dense bf16 peak, the override when given; None when unknown (MFU is then not reported)."""
    if override is not None:
        return override
    words = re.split(r"[^a-z0-9]+", device_name.lower())
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if all(part.lower() in words for part in pattern.split()):
            return tflops
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


@dataclass
class StepClock:
    """Where the time of the steps since the last log line went: fetching batches vs everything else. Only the
    steps' own time counts (validation, evaluations, checkpoint saves and the log lines are not training)."""

    busy_s: float = 0.0  # the steps' seconds, discarded ones included
    data_wait_s: float = 0.0
    steps: int = 0  # trained ones
    loss_sum: float = 0.0
    trained_tokens: int = 0  # this rank's targets (tokens trained on) over the steps
    phase_ms: dict[str, float] = field(default_factory=dict)  # the engine's wall-clock breakdown, summed

    def step_time(self) -> float:
        """Seconds per trained step: a discarded step's time is the price of the ones that stand."""
        assert self.steps > 0
        return self.busy_s / self.steps


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float  # every token of the blocks processed
    tokens_per_s_per_device: float
    trained_tokens_per_s: float  # the targets among them (the tokens the loss is over)
    tflops_per_device: float  # of every token processed: masked tokens cost the same forward and backward
    mfu: float | None


def throughput(
    tokens: int,
    trained_tokens: float,
    seconds: float,
    world_size: int,
    flops_per_tok: float,
    peak: float | None,
) -> Throughput:
    global_rate = tokens / seconds
    per_device = global_rate / world_size
    tflops = per_device * flops_per_tok / 1e12
    mfu = None if peak is None else tflops / peak
    return Throughput(global_rate, per_device, trained_tokens / seconds, tflops, mfu)


@functools.lru_cache(maxsize=1)
def _process(pid: int) -> psutil.Process:
    """This process, made once per pid: psutil.Process() reads /proc to make it (0.2 ms on a 2-core VM)."""
    return psutil.Process(pid)


def memory_gib(device: torch.device) -> tuple[float | None, float | None, float]:
    """(device allocated, device peak since the last call, host RSS of this process), in GiB."""
    rss = _process(os.getpid()).memory_info().rss / GIB
    if device.type != "cuda":
        return None, None, rss
    allocated = torch.cuda.memory_allocated(device) / GIB
    peak = torch.cuda.max_memory_allocated(device) / GIB
    torch.cuda.reset_peak_memory_stats(device)
    return allocated, peak, rss


def clean(value: Any) -> Any:
    """JSON has no NaN/inf: write null instead, so every line stays parseable by strict readers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsFile:
    """One JSON object per line, written by rank 0; appends, so a resumed or requeued run continues the file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: TextIO | None = None  # kept open: opening it per record took 0.25 ms on a 2-core VM
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps({k: clean(v) for k, v in {**record, "time": time.time()}.items()})
        if self._file is None:
            self._file = self.path.open("a")  # closed by close(), or opened again after it
        self._file.write(line + "\n")
        self._file.flush()  # tailed live, and whole should the process die

    def close(self) -> None:
        """Idempotent; a later write opens the file again."""
        if self._file is not None:
            self._file.close()
            self._file = None
