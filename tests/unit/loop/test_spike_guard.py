"""The spike guard's judgement (spike_guard.py), its settings, and where DeepSpeed can discard a step.

The guard in real runs, with injected faults: tests/e2e/test_guarded_runs.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from model_utils.config.arguments import GuardArgs, parse_args
from model_utils.data.sampler import DataPosition
from model_utils.errors import ConfigError
from model_utils.loop import spike_guard
from model_utils.resolve import resolver
from support.deepspeed_files import config_with


def guard(mode: str = "rollback", **kw) -> spike_guard.SpikeGuard:
    return spike_guard.SpikeGuard(GuardArgs(spike_guard=mode, **{"spike_window": 4, **kw}), mode)


def test_the_window_judges_only_when_full_by_mean_plus_sigma_deviations() -> None:
    window = spike_guard.Window(4, [1.0, 2.0, 3.0])
    assert window.threshold(2.0) is None  # three steps are no history
    window.values.append(4.0)
    mean, std = 2.5, math.sqrt(1.25)
    assert window.threshold(2.0) == pytest.approx(mean + 2.0 * std)
    window.values.append(10.0)  # the oldest value leaves
    assert list(window.values) == [2.0, 3.0, 4.0, 10.0]


def test_a_loss_spike_is_judged_before_the_update_and_never_enters_the_window() -> None:
    g = guard()
    for loss in (3.0, 2.9, 3.1, 3.0):
        assert g.judge_loss(loss) is None  # the window fills first
        assert g.step_applied(loss, 1.0) == (None, spike_guard.CONTINUE)
    spike = g.judge_loss(9.0)
    assert (
        spike is not None
        and spike.signal == "loss"
        and spike.threshold == pytest.approx(3.0 + 6 * math.sqrt(0.005))
    )
    assert "loss 9 above the window's 3.4" in spike.describe()
    assert g.step_skipped() == spike_guard.CONTINUE
    assert list(g.loss_window.values) == [3.0, 2.9, 3.1, 3.0]  # the outlier stays out
    nan = g.judge_loss(float("nan"))
    assert nan is not None and nan.threshold is None and nan.describe() == "loss is nan"
    assert guard().judge_loss(float("inf")) is not None  # not finite: a spike even with an empty window


def test_skips_in_a_row_roll_back_or_stop_and_an_applied_step_resets_the_count() -> None:
    for mode, last in (("rollback", spike_guard.ROLLBACK), ("skip", spike_guard.STOP)):
        g = guard(mode, max_consecutive_skips=3) if mode == "rollback" else guard(mode)
        assert [g.step_skipped(), g.step_skipped()] == [spike_guard.CONTINUE] * 2
        g.step_applied(3.0, 1.0)
        assert g.consecutive_skips == 0
        assert [g.step_skipped() for _ in range(3)] == [spike_guard.CONTINUE, spike_guard.CONTINUE, last]
        assert g.skipped_steps == 5


def test_a_grad_norm_spike_rolls_back_only_in_rollback_mode_and_stays_out_of_the_window() -> None:
    for mode, action in (("rollback", spike_guard.ROLLBACK), ("skip", spike_guard.CONTINUE)):
        g = guard(mode)
        for norm in (1.0, 1.2, 0.9, 1.1):
            g.step_applied(3.0, norm)
        spike, got = g.step_applied(3.0, 50.0)
        assert spike is not None and spike.signal == "grad norm" and got == action
        assert 50.0 not in g.grad_window.values
        assert g.step_applied(3.0, None) == (None, spike_guard.CONTINUE)  # the engine computed no norm


def test_a_rollback_skips_the_spike_and_the_steps_before_it_but_not_past_the_checkpoint() -> None:
    g = guard(rollback_skip_steps=2)
    for consumed in range(0, 80, 8):  # steps 1..10, 8 blocks each
        g.step_starting(DataPosition(0, consumed))
        g.step_applied(3.0, 1.0)
    saved = {"loss_window": [5.0, 4.0, 3.5, 3.2], "grad_window": [2.0, 1.0, 1.0, 1.0]}
    # The spike was step 10 (blocks 72..79); the checkpoint is at step 8 (position 64): skip steps 9 and 10.
    start, end = g.rolled_back(saved, checkpoint_at=DataPosition(0, 64), now=DataPosition(0, 80))
    assert (start, end) == (DataPosition(0, 64), DataPosition(0, 80))
    assert [g.skips_data_at(DataPosition(0, c)) for c in (56, 64, 72, 80)] == [False, True, True, False]
    assert list(g.loss_window.values) == saved["loss_window"]  # the steps since will be trained again
    assert g.rollbacks == 1 and g.may_roll_back()
    # Across an epoch boundary the range still orders positions by (epoch, block).
    g.skipped_data = [((0, 96), (1, 8))]
    assert g.skips_data_at(DataPosition(1, 0)) and not g.skips_data_at(DataPosition(1, 8))


def test_the_guard_state_round_trips_through_json_and_a_resized_window_keeps_the_newest() -> None:
    g = guard()
    for loss in (4.0, 3.0, 2.0, 1.0):
        g.step_applied(loss, loss)
    g.step_skipped()
    g.skipped_data = [((0, 8), (0, 16))]
    state = json.loads(json.dumps(g.state_dict()))
    again = guard()
    again.load_state_dict(state)
    assert again.state_dict() == g.state_dict()
    smaller = guard(spike_window=2)
    smaller.load_state_dict(state)
    assert list(smaller.loss_window.values) == [2.0, 1.0]
    fresh = guard()
    fresh.load_state_dict({})  # a checkpoint of a kit without the guard
    assert fresh.skipped_steps == 0 and not fresh.loss_window.values


CAN_DISCARD = {
    "bf16 ZeRO-2 offload (the default)": ({}, True),
    "bf16 without ZeRO": ({"zero_optimization": {"stage": 0}}, True),
    "bf16 without its overflow check": ({"bf16": {"enabled": True, "check_grad_overflow": False}}, False),
    "fp16": ({"bf16": None, "fp16": {"enabled": True}}, True),
    "fp32 ZeRO-2": ({"bf16": None, "zero_optimization": {"stage": 2}}, True),
    "fp32 ZeRO-3": ({"bf16": None, "zero_optimization": {"stage": 3}}, True),
    "fp32 without ZeRO": ({"bf16": None, "zero_optimization": {"stage": 0}}, False),
}


@pytest.mark.parametrize("case", list(CAN_DISCARD))
def test_where_deepspeed_can_discard_a_step_the_default_guard_runs_and_elsewhere_it_is_off(
    case: str, tmp_path: Path, capsys
) -> None:
    changes, discards = CAN_DISCARD[case]
    settings = resolver.resolve_settings(parse_args(["--deepspeed_config", config_with(tmp_path, **changes)]))
    assert settings.train.discards_nonfinite_steps is discards
    assert settings.spike_guard == ("skip" if discards else "off")
    assert (
        "Spike guard off: DeepSpeed applies non-finite gradients" in capsys.readouterr().out
    ) is not discards
    if not discards:  # asked for explicitly: an error, not a silent downgrade
        with pytest.raises(ConfigError, match="cannot be discarded: train in bf16 or under ZeRO"):
            resolver.resolve_settings(
                parse_args(["--deepspeed_config", config_with(tmp_path, **changes), "--spike_guard", "skip"])
            )
