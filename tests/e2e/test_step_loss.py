"""The loss over the step's tokens, through both engines: one optimizer step over the same 8 rows, whose targets
differ in number by an order of magnitude, laid out as micro batch 8 x accumulation 1, 1 x 8 and 2 ranks x 4,
gives the loss and the gradients of the token mean over all 8 rows (fp32, within 1e-5), and so do ranks that share
each row (sequence parallelism); DeepSpeed's layouts at
ZeRO stages 0 (8 x 1), 2 (1 x 8, 2 ranks x 4) and 3 (2 ranks x 4), whose gradients are reduced and partitioned
differently. A mean of per-micro-batch means would not: the last check shows how far it lands. The ranks are the
rank pool's (tests/support/rank_pool.py); what a rank runs: tests/support/step_gradients.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from model_utils.data.step_batches import gather
from model_utils.engines import preference
from support.rank_pool import run_ranks
from support.step_gradients import ROWS, FixedPairs, FixedRows, tiny_model
from support.torchrun import succeeded

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "step_gradients.py"
DATA_PARALLEL = {
    "8x1": (1, 8, 1),
    "1x8": (1, 1, 8),
    "2 ranks x 4": (2, 1, 4),
}  # ranks, micro batch, accumulation
# ... and the ranks sharing each row (--sequence_parallel).
SEQUENCE_PARALLEL = {"2 ranks share 4x2": (2, 4, 2, 2), "4 ranks, 2 groups of 2 share 2x2": (4, 2, 2, 2)}
LAYOUTS = {**DATA_PARALLEL, **SEQUENCE_PARALLEL}
# DeepSpeed's ZeRO stages per layout: the stage changes how the gradients are reduced, accumulated and partitioned
# (stage 0: the module's own; 2: reduce-scattered into partitioned buffers; 3: the parameters partitioned too).
ZERO_STAGES = {"8x1": (0,), "1x8": (2,), "2 ranks x 4": (2, 3)}
ZERO_STAGES |= {"2 ranks share 4x2": (2,), "4 ranks, 2 groups of 2 share 2x2": (3,)}


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    """The token mean over every target of the 8 rows in one forward of the plain model, and its gradients."""
    model = tiny_model()
    batch = gather(FixedRows(), np.arange(ROWS), pin=False)
    total = torch.tensor(float(batch.targets))
    loss = model(**batch.model_inputs(), num_items_in_batch=total).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def dpo_reference() -> tuple[float, dict[str, torch.Tensor]]:
    """DPO's loss over the 8 pairs in one forward of the plain model (the mean of the pairs' losses), and its
    gradients."""
    model = tiny_model()
    batch = gather(FixedPairs(), np.arange(ROWS), pin=False)
    objective = preference.Preference(preference.Settings("dpo"))
    loss = objective.summed_loss(model, batch, torch.tensor(float(ROWS)))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def engine_step(engine: str, layout: str, tmp_path: Path, zero_stage: int = 0, objective: str = "lm") -> dict:
    ranks, micro, accumulation, *sequence_parallel = LAYOUTS[layout]
    out = tmp_path / f"{engine}-{layout.replace(' ', '')}-zero{zero_stage}-{objective}.pt"
    argv = [engine, micro, accumulation, out, zero_stage, *(sequence_parallel or [1]), objective]
    succeeded(run_ranks(argv, script=SCRIPT, nproc=ranks))
    return torch.load(out, weights_only=False)


def assert_reference_step(got: dict, where: str, want: tuple[float, dict] | None = None) -> None:
    want_loss, want_grads = want or reference()
    assert got["loss"] == pytest.approx(want_loss, abs=1e-5), where
    assert set(got["grads"]) == set(want_grads), where
    for name, grad in want_grads.items():
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-5, msg=f"{where}: {name}")


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_every_layout_trains_the_token_mean_of_the_step(engine: str, tmp_path: Path) -> None:
    for layout in DATA_PARALLEL:
        for stage in ZERO_STAGES[layout] if engine == "deepspeed" else (0,):
            where = f"{layout}, ZeRO-{stage}" if engine == "deepspeed" else layout
            assert_reference_step(engine_step(engine, layout, tmp_path, stage), where)


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_ranks_sharing_each_sequence_train_the_same_step(engine: str, tmp_path: Path) -> None:
    """Sequence parallelism (DeepSpeed's Ulysses attention): 2 ranks each holding half of every row, and 4 ranks as
    2 groups of 2, give the loss and gradients of the whole rows in one forward, rows of two documents included
    (their attention kept apart); DeepSpeed at ZeRO-2 (all-reduced gradients) and ZeRO-3 (reduce-scattered:
    DeepSpeed divides by every rank there, deepspeed_engine._reduction_ranks), FSDP2 in 2 groups of 2."""
    for layout in SEQUENCE_PARALLEL if engine == "deepspeed" else list(SEQUENCE_PARALLEL)[1:]:
        for stage in ZERO_STAGES[layout] if engine == "deepspeed" else (0,):
            where = f"{engine} {layout}, ZeRO-{stage}"
            assert_reference_step(engine_step(engine, layout, tmp_path, stage), where)


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_dpo_is_the_mean_over_the_steps_pairs_whatever_the_layout(engine: str, tmp_path: Path) -> None:
    """--objective dpo: the step's loss is the mean of its pairs' losses (TRL's, sequence-weighted), whatever the
    accumulation and the ranks: 1 rank x 1 pair x 8 and 2 ranks x 4 pairs give the loss and gradients of the 8 pairs
    in one forward (fp32, 1e-5); DeepSpeed at ZeRO-2 and 3, FSDP2."""
    want = dpo_reference()
    layouts = {
        "deepspeed": [("1x8", 2), ("2 ranks x 4", 2), ("2 ranks x 4", 3)],
        "fsdp": [("2 ranks x 4", 0)],
    }
    for layout, stage in layouts[engine]:
        got = engine_step(engine, layout, tmp_path, stage, "dpo")
        assert_reference_step(got, f"DPO {engine} {layout}, ZeRO-{stage}", want)


def test_a_mean_of_micro_batch_means_would_differ_here() -> None:
    """The check above can fail: on these rows the per-micro-batch mean of 1 x 8 is far from the token mean."""
    model = tiny_model()
    want, _ = reference()
    with torch.no_grad():
        means = [
            float(model(**gather(FixedRows(), np.array([row]), pin=False).model_inputs()).loss)
            for row in range(ROWS)
        ]
    assert abs(sum(means) / ROWS - want) > 1e-3
