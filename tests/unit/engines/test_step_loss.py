"""The loss over the step's tokens, the parts every engine shares: the step's global target count and each
micro-batch's summed token losses over a divisor. Both engines end to end on 1 and 2 ranks, with gradients:
tests/e2e/test_step_loss.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_utils.data.rows import Rows
from model_utils.data.step_batches import Batch, gather
from model_utils.engines import step_loss
from support.pretrained import tiny_model


class Source:
    seq_length = 8

    def __init__(self, rows: Rows) -> None:
        self.answer = rows

    def __len__(self) -> int:
        return len(self.answer.tokens)

    def rows(self, indices: np.ndarray) -> Rows:
        targets = None if self.answer.targets is None else self.answer.targets[indices]
        return Rows(self.answer.tokens[indices], targets)


def batches() -> list[Batch]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2048, (3, 8))
    targets = np.zeros((3, 8), dtype=bool)
    targets[0, 1:] = True  # 7
    targets[1, 7] = True  # 1
    targets[2, 4:] = True  # 4
    source = Source(Rows(tokens, targets))
    return [gather(source, np.array([0, 1]), pin=False), gather(source, np.array([2]), pin=False)]


def test_the_step_counts_every_target_of_every_micro_batch_on_every_rank(gloo_rank) -> None:
    step = batches()
    assert [b.targets for b in step] == [8, 4]
    assert step_loss.world_ranks() == 1
    assert float(step_loss.step_targets(step)) == 12.0
    # DeepSpeed divides again by accumulation x ranks: the divisor gives that back.
    assert float(step_loss.loss_divisor(step, 2)) == 6.0
    nothing = gather(
        Source(Rows(np.zeros((1, 8), dtype=np.int64), np.zeros((1, 8), bool))), np.array([0]), False
    )
    assert float(step_loss.step_targets([nothing])) == 1.0  # no targets: loss 0, not 0/0


def test_a_count_the_ranks_agreed_already_is_the_divisor_without_a_collective(monkeypatch) -> None:
    """The trainer's per-step collective carried the step's targets (loop/consensus.py): the divisor is that
    count, as the counted one would be (float32, at least 1), and no all-reduce is made."""
    step = batches()

    def no_collective(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("an all-reduce for a count the ranks agreed already")

    monkeypatch.setattr(step_loss, "world_ranks", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", no_collective)
    agreed = step_loss.loss_divisor(step, 1, agreed=30)
    assert agreed.dtype == torch.float32 and float(agreed) == 30.0
    assert float(step_loss.loss_divisor(step, 2, agreed=30)) == 15.0
    assert float(step_loss.loss_divisor(step, 1, agreed=0)) == 1.0
    with pytest.raises(AssertionError, match="agreed already"):
        step_loss.step_targets(step)  # without it: the step's own collective


def test_the_divisor_of_an_agreed_count_is_made_once_per_count() -> None:
    """Every full step of a run agrees the same count: its divisor tensor is made once, not three tensor operations
    a step; another count, or another backward factor, gets its own."""
    step = batches()
    first = step_loss.loss_divisor(step, 2, agreed=30)
    assert step_loss.loss_divisor(step, 2, agreed=30) is first
    assert float(step_loss.loss_divisor(step, 2, agreed=40)) == 20.0
    assert float(step_loss.loss_divisor(step, 3, agreed=30)) == 10.0
    assert float(first) == 15.0  # untouched by the others


def test_a_micro_batch_loss_is_its_summed_token_losses_over_the_divisor() -> None:
    model = tiny_model()
    batch = batches()[0]
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
        per_token = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch.labels[:, 1:].reshape(-1), reduction="none"
        )
        summed = per_token.sum()  # the ignored labels add 0
        got = step_loss.summed_loss(model, batch, torch.tensor(6.0))
        assert torch.allclose(got, summed / 6.0, atol=1e-6)
        assert abs(step_loss.eval_summed_loss(model, batch) - float(summed)) < 1e-4
