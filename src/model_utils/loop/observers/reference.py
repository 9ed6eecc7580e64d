"""DPO's reference: each pair's log-probabilities of its chosen and rejected answers under the weights the run starts
from (with LoRA, the base model: its adapters disabled), computed once in a pass before the first step, every rank
its share, and handed to the pairs' blocks, so that each step's batch carries them: one forward a step, and no
second model in memory (TRL's precompute_ref_log_probs).

They are kept in the data cache beside the prepared pairs, named by the data (both splits' contents), the block
length, the truncation and the fingerprint of those weights; a requeue or a resume reads them back (rank 0 reads, every rank gets them). The
checkpoint keeps the fingerprint: a resume whose starting weights are not those the run started from (another
--model) is refused in one line, as is one whose reference file is gone (the starting weights are no longer in
memory to compute it again).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from model_utils.data import step_batches
from model_utils.errors import ConfigError
from model_utils.launch.distributed import decide_on_main
from model_utils.loop.hooks import Observer
from model_utils.loop.state import TrainState
from model_utils.model import lora
from model_utils.observe import watchdog
from model_utils.observe.log import end_progress0, print0, progress0

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext

REFERENCE = "reference"  # its name in the checkpoint, and the data cache's folder
SAY_EVERY_S = 30.0  # a long pass says how far it is in the log this often (the progress bar is a terminal's)


class Reference(Observer):
    name = REFERENCE

    def __init__(self, ctx: LoopContext, weights: str) -> None:
        self.ctx, self.weights = ctx, weights
        run = ctx.run
        data = run.config.data
        self.file = (
            Path(data.data_cache_dir)
            / REFERENCE
            / f"{run.data_fingerprint}-{run.validation_fingerprint}-{run.seq_length}-{data.truncation_mode}-{weights}.npz"
        )

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Reference | None:
        weights = ctx.engine.objective.reference_weights
        if weights is None:  # an objective without a reference
            return None
        saved = ctx.saved.get(REFERENCE, {}).get("weights")
        if saved is not None and saved != weights:
            raise ConfigError(
                f"the run's DPO reference was the weights it started from (fingerprint {saved}), and "
                f"{ctx.run.source.name} now has other weights ({weights}): resume with the --model the run "
                "started from, or start a new run (a new --checkpoint_dir)"
            )
        return cls(ctx, weights)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights}

    def on_start(self, state: TrainState) -> None:
        ctx = self.ctx
        splits = [("train", ctx.run.train_blocks), ("validation", ctx.run.val_blocks)]
        splits = [(name, blocks) for name, blocks in splits if blocks is not None]
        kept = decide_on_main(lambda: self._read([len(blocks) for _, blocks in splits]), ctx.dist)
        if kept is None:
            if ctx.run.resume is not None:  # the weights in memory are a checkpoint's, not the starting ones
                raise ConfigError(
                    f"the DPO reference log-probabilities of these pairs under the weights the run started from "
                    f"({self.file}) are gone or were never computed (other pairs: --new_data), and those weights are "
                    "no longer the ones in memory: restore the file (it is in --data_cache_dir), or start a new run "
                    "(a new --checkpoint_dir; from an export of this one to go on from here)"
                )
            kept = self._compute(splits)
        for (_, blocks), values in zip(splits, kept, strict=True):
            blocks.reference = values  # type: ignore[attr-defined]

    def _read(self, lengths: list[int]) -> list[np.ndarray] | None:
        if not self.file.is_file():
            return None
        with np.load(self.file) as saved:
            arrays = [saved[f"split{i}"] for i in range(len(lengths))]
        if [len(a) for a in arrays] != lengths:
            return None
        print0(
            f"Reference: the DPO reference log-probabilities of {self._counted(lengths)}, from {self.file}"
        )
        return arrays

    @staticmethod
    def _counted(lengths: list[int]) -> str:
        return " and ".join(
            f"{n:,} {name} pairs" for name, n in zip(("train", "validation"), lengths, strict=False)
        )

    def _compute(self, splits: list[tuple[str, Any]]) -> list[np.ndarray]:
        """The pass: each rank its share of each split's pairs, in micro-batches (the same number on every rank:
        a sharded model's forward needs every rank), gathered on every rank; rank 0 writes the file."""
        ctx = self.ctx
        started = time.perf_counter()
        engine, dist = ctx.engine, ctx.dist
        micro = ctx.run.micro_batch_size
        assert isinstance(micro, int)
        engine.eval()
        arrays = []
        said = started
        with lora.adapters_off(engine.module):
            for name, blocks in splits:
                count = len(blocks)
                per_rank = math.ceil(count / dist.world_size)
                # Pair i of this rank's share is pair rank + i * world; past the end, the last pair again.
                mine = np.minimum(dist.rank + dist.world_size * np.arange(per_rank), count - 1)
                values = torch.zeros(per_rank, 2, dtype=torch.float64, device=dist.device)
                for start in range(0, per_rank, micro):
                    ctx.hooks.on_phase(watchdog.VALIDATION, 0)  # progress, for the watchdog
                    progress0(start, per_rank, "DPO reference log-probabilities")
                    if time.perf_counter() - said > SAY_EVERY_S:  # no minutes of silence in the log
                        said = time.perf_counter()
                        print0(
                            f"Reference: {name} pairs {start * dist.world_size:,} of {count:,} "
                            f"({start / per_rank:.0%}) after {said - started:.0f} s"
                        )
                    indices = mine[start : start + micro]
                    batch = step_batches.gather(blocks, indices, pin=False).to(dist.device)
                    values[start : start + len(indices)] = engine.sequence_logps(batch).double().view(2, -1).T
                if dist.world_size > 1:  # pair rank + i * world lands at row i * world + rank
                    every = [torch.empty_like(values) for _ in range(dist.world_size)]
                    torch.distributed.all_gather(every, values)
                    values = torch.stack(every, dim=1).reshape(-1, 2)
                arrays.append(values[:count].float().cpu().numpy())
        end_progress0()
        engine.train()
        seconds = time.perf_counter() - started
        if dist.is_main:
            self._write(arrays)
        print0(
            f"Reference: the DPO reference log-probabilities of {self._counted([len(a) for a in arrays])} computed "
            f"in {seconds:.1f} s (weights {self.weights}), kept in {self.file}"
        )
        return arrays

    def _write(self, arrays: list[np.ndarray]) -> None:
        """Whole or not at all: another job reading the same cache finds the file complete or absent."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.file.with_name(f".{self.file.name}.{os.getpid()}.tmp")
        with open(partial, "wb") as f:
            np.savez(f, **{f"split{i}": a for i, a in enumerate(arrays)})
        os.replace(partial, self.file)
