"""The batch layout: micro batch x accumulation x ranks x sequence length = tokens per optimizer step.

With --global_batch_tokens N (or, on CUDA ranks without a batch flag, arguments.CUDA_GLOBAL_BATCH_TOKENS) the
accumulation follows from N once the micro batch is known, so one run file means the same optimisation on 8 or
64 GPUs. preflight.prepare decides it on the ranks, where the device and the world size are known.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_utils.launch import startup


def trains_on_cuda() -> bool:
    """Whether this process trains on a CUDA GPU: DeepSpeed's accelerator, as the engine sees it
    (DS_ACCELERATOR=cpu on a GPU machine trains on the CPU)."""
    startup.import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"


@dataclass(frozen=True)
class Ranks:
    """The ranks a run trains on: how many, and the memory of each one's GPU (None: CPU ranks). On the ranks,
    what they found; in `dskit config`, the machine it plans for."""

    world_size: int
    gpu_bytes: int | None

    @property
    def on_cuda(self) -> bool:
        return self.gpu_bytes is not None


def accumulation_for(tokens: int, micro_batch_size: int, world_size: int, seq_length: int) -> int:
    """The accumulation whose global batch comes nearest `tokens`: round(N / (micro x ranks x seq)), at least 1."""
    return max(1, round(tokens / (micro_batch_size * world_size * seq_length)))


@dataclass(frozen=True)
class BatchLayout:
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    seq_length: int
    requested_tokens: int | None  # None: the accumulation was given, not derived
    requested_by: str | None  # "--global_batch_tokens" or "the CUDA default"
    sequence_parallel: int = 1  # ranks sharing each sequence: world_size counts their groups
    pairs: bool = False  # preference pairs: a micro batch's blocks are pairs of 2 sequences

    @property
    def tokens(self) -> int:
        rows = 2 if self.pairs else 1
        return (
            self.micro_batch_size
            * self.gradient_accumulation_steps
            * self.world_size
            * rows
            * self.seq_length
        )

    def product(self) -> str:
        rows = "2 x " if self.pairs else ""
        return (
            f"{self.micro_batch_size} x {self.gradient_accumulation_steps} x {self.world_size} x "
            f"{rows}{self.seq_length} = {self.tokens}"
        )

    def describe(self) -> str:
        """One line: the layout, and against what was asked for."""
        ranks = "ranks" if self.sequence_parallel == 1 else f"groups of {self.sequence_parallel} ranks"
        micro, seq = ("micro batch of pairs", "2 sequences x seq") if self.pairs else ("micro batch", "seq")
        line = f"batch layout ({micro} x accumulation x {ranks} x {seq} = tokens/step): {self.product()}"
        if self.requested_tokens is None:
            return line
        deviation = self.tokens / self.requested_tokens - 1
        return f"{line}; requested {self.requested_tokens} ({self.requested_by}), {deviation:+.1%}"
