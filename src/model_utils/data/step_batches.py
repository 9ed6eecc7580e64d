"""A step's micro-batches on the device, gathered one step ahead so the device never waits for data.

The blocks are read from memory-mapped token shards (token_shards.TokenBlocks), so a batch is a gather of rows: no
tokenization or collation is left to do at training time, and one background thread is enough of a
"DataLoader worker" to keep the next step's rows read (from the page cache or a shared filesystem) while the
device computes. On CUDA the rows land in pinned host memory and are copied without blocking, so the copy
neither waits for the kernels queued before it nor stalls the Python thread queuing the next ones.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from model_utils.data.sampler import BlockSampler, DataPosition


def gather(blocks: np.ndarray, indices: np.ndarray, pin: bool) -> torch.Tensor:
    """Rows `indices` of `blocks` as a [len(indices), seq] int64 tensor in host memory (pinned if `pin`)."""
    rows = torch.from_numpy(np.asarray(blocks[indices], dtype=np.int64))
    return rows.pin_memory() if pin else rows


class StepBatches:
    """The micro-batches of each optimizer step, in the sampler's order, prepared one step ahead."""

    def __init__(self, blocks: np.ndarray, sampler: BlockSampler, device: torch.device) -> None:
        self.blocks = blocks
        self.sampler = sampler
        self.device = device
        self.pin = device.type == "cuda"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dskit-data")
        self._ahead: tuple[DataPosition, Future[list[torch.Tensor]]] | None = None

    def _gather_step(self, position: DataPosition) -> list[torch.Tensor]:
        return [gather(self.blocks, idx, self.pin) for idx in self.sampler.step_indices(position)]

    def at(self, position: DataPosition) -> list[torch.Tensor]:
        """The step at `position`, on the device; starts gathering the step after it in the background.

        Any position works (a resume, a jump); only the one right after the previous call is ready early.
        """
        if self._ahead is not None and self._ahead[0] == position:
            host = self._ahead[1].result()  # re-raises what went wrong in the worker
        else:
            host = self._gather_step(position)
        following = self.sampler.advance(position)
        self._ahead = (following, self._worker.submit(self._gather_step, following))
        return [rows.to(self.device, non_blocking=self.pin) for rows in host]

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._ahead = None
