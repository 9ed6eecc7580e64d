"""DPO's reference observer on one gloo rank with a stand-in engine: the pass computes each pair's log-probabilities
once (the adapters off), writes them whole into the data cache and hands them to the pairs' blocks; a second run
reads them back without a forward; a resume from other starting weights, or without the file, is refused in one
line; an objective without a reference has no observer. The pass over real ranks and engines:
tests/e2e/test_preference.py."""

from __future__ import annotations

import contextlib
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from model_utils.data.rows import Rows
from model_utils.engines.step_loss import TokenMean
from model_utils.errors import ConfigError
from model_utils.loop.hooks import Hooks
from model_utils.loop.observers.reference import Reference
from model_utils.loop.state import TrainState

PAIRS = 5


class Pairs:
    """PAIRS pairs of 4 tokens: pair i's chosen sequence is all i, its rejected all 10 + i."""

    seq_length = 4

    def __init__(self, count: int = PAIRS) -> None:
        self.count = count
        self.reference: np.ndarray | None = None

    def __len__(self) -> int:
        return self.count

    def rows(self, indices: np.ndarray) -> Rows:
        tokens = np.concatenate([np.repeat(indices[:, None], 4, 1), np.repeat(10 + indices[:, None], 4, 1)])
        return Rows(tokens, np.ones(tokens.shape, bool), paired=True)


class Module:
    def __init__(self) -> None:
        self.adapters_off = 0

    @contextlib.contextmanager
    def disable_adapter(self):  # peft's PeftModel
        self.adapters_off += 1
        yield


class Engine:
    """A row's log-probability: minus its first token (so the values name the rows they came from)."""

    def __init__(self, weights: str | None = "w1") -> None:
        self.objective = types.SimpleNamespace(reference_weights=weights)
        self.module = Module()
        self.forwards = 0
        self.mode = "train"

    def sequence_logps(self, batch) -> torch.Tensor:
        assert self.mode == "eval" and self.module.adapters_off
        self.forwards += 1
        return -batch.input_ids[:, 0].double()

    def eval(self) -> None:
        self.mode = "eval"

    def train(self) -> None:
        self.mode = "train"


def context(tmp_path: Path, dist, engine: Engine, saved: dict | None = None, validation: bool = True):
    data = types.SimpleNamespace(data_cache_dir=str(tmp_path / "cache"), truncation_mode="keep_start")
    run = types.SimpleNamespace(
        train_blocks=Pairs(),
        val_blocks=Pairs(2) if validation else None,
        micro_batch_size=2,
        seq_length=4,
        resume=None if not saved else types.SimpleNamespace(tag="tiny-4steps"),
        data_fingerprint="data1",
        validation_fingerprint="val1" if validation else None,
        source=types.SimpleNamespace(name="out/tiny-sft"),
        config=types.SimpleNamespace(data=data),
    )
    return types.SimpleNamespace(run=run, dist=dist, engine=engine, hooks=Hooks(), saved=saved or {})


def test_the_pass_computes_each_pair_once_keeps_them_and_a_second_run_reads_them_back(
    tmp_path: Path, gloo_rank, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = Engine()
    ctx = context(tmp_path, gloo_rank, engine)
    observer = Reference.from_loop(ctx)
    assert observer is not None and observer.state_dict() == {"weights": "w1"}
    observer.on_start(TrainState())
    train = ctx.run.train_blocks.reference
    assert train.tolist() == [[-i, -10 - i] for i in range(PAIRS)]  # pair i: its chosen, its rejected
    assert ctx.run.val_blocks.reference.tolist() == [[0, -10], [-1, -11]]
    assert engine.forwards == 3 + 1 and engine.module.adapters_off == 1 and engine.mode == "train"
    (kept,) = (tmp_path / "cache" / "reference").iterdir()
    # The training and validation data, the block length, the truncation, the weights.
    assert kept.name == "data1-val1-4-keep_start-w1.npz"
    assert "computed in" in capsys.readouterr().out

    again = context(tmp_path, gloo_rank, Engine(), saved={"reference": {"weights": "w1"}})
    Reference.from_loop(again).on_start(TrainState(step=3))  # a requeue: read back, no forward
    assert again.engine.forwards == 0
    assert np.array_equal(again.run.train_blocks.reference, train)
    assert (
        f"Reference: the DPO reference log-probabilities of 5 train pairs and 2 validation pairs, from {kept}"
        in (capsys.readouterr().out)
    )
    other = context(tmp_path, gloo_rank, Engine())
    other.run.train_blocks = Pairs(4)  # a file of other pairs under the same name: not theirs, computed anew
    Reference.from_loop(other).on_start(TrainState())
    assert other.engine.forwards == 2 + 1 and other.run.train_blocks.reference.shape == (4, 2)
    # Other validation pairs beside the same training pairs (another --validation_dataset): their own file.
    held_out = context(tmp_path, gloo_rank, Engine())
    held_out.run.validation_fingerprint = "val2"
    Reference.from_loop(held_out).on_start(TrainState())
    assert held_out.engine.forwards == 3 + 1
    assert (tmp_path / "cache" / "reference" / "data1-val2-4-keep_start-w1.npz").is_file()


def test_a_resume_from_other_weights_or_without_the_file_is_refused(tmp_path: Path, gloo_rank) -> None:
    with pytest.raises(
        ConfigError, match=r"^the run's DPO reference was the weights it started from \(fingerprint w0\)"
    ):
        Reference.from_loop(
            context(tmp_path, gloo_rank, Engine("w1"), saved={"reference": {"weights": "w0"}})
        )
    resumed = Reference.from_loop(
        context(tmp_path, gloo_rank, Engine("w1"), saved={"reference": {"weights": "w1"}})
    )
    with pytest.raises(ConfigError, match="are gone or were never computed"):
        resumed.on_start(TrainState(step=4))


def test_an_objective_without_a_reference_has_no_observer(tmp_path: Path, gloo_rank) -> None:
    ctx = context(tmp_path, gloo_rank, Engine(None))
    ctx.engine.objective = TokenMean()
    assert Reference.from_loop(ctx) is None
    assert Reference.from_loop(context(tmp_path, gloo_rank, Engine(None))) is None


def test_a_long_pass_says_how_far_it_is_in_the_log(
    tmp_path: Path, gloo_rank, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from model_utils.loop.observers import reference

    monkeypatch.setattr(reference, "SAY_EVERY_S", -1.0)  # every micro-batch
    Reference.from_loop(context(tmp_path, gloo_rank, Engine(), validation=False)).on_start(TrainState())
    said = [line for line in capsys.readouterr().out.splitlines() if "pairs 2 of 5" in line]
    assert said and said[0].endswith("| Reference: train pairs 2 of 5 (40%) after 0 s"), said
