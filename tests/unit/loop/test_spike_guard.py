"""The spike guard's judgement (spike_guard.py), its settings, and where DeepSpeed can discard a step.

The guard in real runs, with injected faults: tests/e2e/test_guarded_runs.py."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model_utils.config.arguments import GuardArgs, parse_args
from model_utils.data.sampler import DataPosition
from model_utils.errors import ConfigError
from model_utils.loop import spike_guard
from model_utils.resolve import resolver
from support import faults
from support.deepspeed_files import config_with


def guard(mode: str = "rollback", **kw) -> spike_guard.SpikeGuard:
    """A guard judging from its 4-step window's filling, by mean + sigma alone unless a test sets a ratio."""
    defaults = {
        "spike_window": 4,
        "spike_warmup_steps": 0,
        "spike_loss_ratio": 1.0,
        "spike_grad_norm_ratio": 1.0,
    }
    return spike_guard.SpikeGuard(GuardArgs(spike_guard=mode, **{**defaults, **kw}), mode)


def test_the_window_judges_only_when_full_by_mean_plus_sigma_deviations_and_at_least_a_ratio_to_its_median() -> (
    None
):
    window = spike_guard.Window(4, [1.0, 2.0, 3.0])
    assert window.threshold(2.0, 1.0) is None  # three steps are no history
    window.values.append(4.0)
    mean, std = 2.5, math.sqrt(1.25)
    assert window.threshold(2.0, 1.0) == pytest.approx(mean + 2.0 * std)
    assert window.threshold(2.0, 3.0) == pytest.approx(3.0 * 2.5)  # the median floor is the higher one
    window.values.append(10.0)  # the oldest value leaves
    assert list(window.values) == [2.0, 3.0, 4.0, 10.0]


def test_a_loss_spike_is_judged_before_the_update_and_never_enters_the_window() -> None:
    g = guard()
    for step, loss in enumerate((3.0, 2.9, 3.1, 3.0), start=1):
        assert g.judge_loss(step, loss) is None  # the window fills first
        assert g.step_applied(step, loss, 1.0) == (None, spike_guard.CONTINUE)
    spike = g.judge_loss(5, 9.0)
    assert (
        spike is not None
        and spike.signal == "loss"
        and spike.threshold == pytest.approx(3.0 + 6 * math.sqrt(0.005))
    )
    assert "loss 9 above the window's 3.4" in spike.describe()
    assert g.step_skipped() == spike_guard.CONTINUE
    assert list(g.loss_window.values) == [3.0, 2.9, 3.1, 3.0]  # the outlier stays out
    nan = g.judge_loss(5, float("nan"))
    assert nan is not None and nan.threshold is None and nan.describe() == "loss is nan"
    assert guard().judge_loss(1, float("inf")) is not None  # not finite: a spike even with an empty window


def test_no_finite_value_is_judged_during_the_warm_up_but_a_non_finite_one_always_is() -> None:
    g = guard(spike_warmup_steps=6)
    for step, (loss, norm) in enumerate(((3.0, 1.0), (2.9, 1.2), (3.1, 0.9), (3.0, 1.1)), start=1):
        g.step_applied(step, loss, norm)
    # The window is full; steps 5 and 6 are still the warm-up: a jump there is the early descent's, not a spike.
    assert g.judge_loss(5, 90.0) is None
    assert g.step_applied(5, 3.0, 50.0) == (None, spike_guard.CONTINUE)
    assert 50.0 in g.grad_window.values  # judged or not, an accepted value joins the window
    assert g.judge_loss(6, float("nan")) is not None
    spike, action = g.step_applied(6, 3.0, float("inf"))
    assert spike is not None and spike.threshold is None and action == spike_guard.ROLLBACK
    assert g.judge_loss(7, 90.0) is not None  # from step 7 on it judges


def test_a_value_above_mean_plus_sigma_is_no_spike_below_the_ratio_to_the_windows_median() -> None:
    """A clean run's grad norm swings to 3-4x its median now and then, while mean + 6 sigma of a quiet window is
    far lower (the kit rolled back healthy 500-step runs so): the ratio floor keeps it; a fault's 1000x is far
    above both."""
    quiet = [1.0, 1.1, 0.9, 1.0] * 25
    for mode in ("rollback", "skip"):
        g = guard(mode, spike_window=100, spike_grad_norm_ratio=5.0, spike_loss_ratio=1.5)
        for step, norm in enumerate(quiet, start=1):
            g.step_applied(step, 3.0 - step / 100, norm)
        assert spike_guard.Window(100, quiet).threshold(6.0, 1.0) < 1.5  # sigma alone: 1.5 would be a spike
        assert g.step_applied(101, 2.0, 4.0) == (None, spike_guard.CONTINUE)
        assert g.judge_loss(102, 2.0 * 1.4) is None  # 1.4x the median loss: noise of one batch
        assert g.judge_loss(102, 2.0 * 1000) is not None
        spike, action = g.step_applied(102, 2.0, 1000.0)
        assert (
            spike is not None
            and spike.threshold == pytest.approx(5.0)
            and "above the window's 5" in spike.describe()
        )
        assert action == (spike_guard.ROLLBACK if mode == "rollback" else spike_guard.CONTINUE)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ({"spike_warmup_steps": -1}, "--spike_warmup_steps -1 must be zero or positive, e.g. 200"),
        ({"spike_loss_ratio": 0.5}, "--spike_loss_ratio 0.5 must be at least 1, e.g. 1.25"),
        ({"spike_grad_norm_ratio": float("nan")}, "--spike_grad_norm_ratio nan must be at least 1, e.g. 20"),
    ],
)
def test_a_warm_up_or_ratio_out_of_range_is_one_line(flags: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        GuardArgs(**flags)


def test_skips_in_a_row_roll_back_or_stop_and_an_applied_step_resets_the_count() -> None:
    for mode, last in (("rollback", spike_guard.ROLLBACK), ("skip", spike_guard.STOP)):
        g = guard(mode, max_consecutive_skips=3) if mode == "rollback" else guard(mode)
        assert [g.step_skipped(), g.step_skipped()] == [spike_guard.CONTINUE] * 2
        g.step_applied(1, 3.0, 1.0)
        assert g.consecutive_skips == 0
        assert [g.step_skipped() for _ in range(3)] == [spike_guard.CONTINUE, spike_guard.CONTINUE, last]
        assert g.skipped_steps == 5


def test_a_grad_norm_spike_rolls_back_only_in_rollback_mode_and_stays_out_of_the_window() -> None:
    for mode, action in (("rollback", spike_guard.ROLLBACK), ("skip", spike_guard.CONTINUE)):
        g = guard(mode)
        for step, norm in enumerate((1.0, 1.2, 0.9, 1.1), start=1):
            g.step_applied(step, 3.0, norm)
        spike, got = g.step_applied(5, 3.0, 50.0)
        assert spike is not None and spike.signal == "grad norm" and got == action
        assert 50.0 not in g.grad_window.values
        assert g.step_applied(5, 3.0, None) == (None, spike_guard.CONTINUE)  # the engine computed no norm


def test_a_rollback_skips_the_spike_and_the_steps_before_it_but_not_past_the_checkpoint() -> None:
    g = guard(rollback_skip_steps=2)
    for step, consumed in enumerate(range(0, 80, 8), start=1):  # steps 1..10, 8 blocks each
        g.step_starting(DataPosition(0, consumed))
        g.step_applied(step, 3.0, 1.0)
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
    for step, loss in enumerate((4.0, 3.0, 2.0, 1.0), start=1):
        g.step_applied(step, loss, loss)
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


# Clean runs of the default tiny model, recorded (their first lines say how): on the shipped corpus, 3000 steps,
# and on Python source, 1000 steps, where step 890's grad norm is 17x its window's median, the largest of 20,500
# clean steps measured (docs/spike-guard.md#calibration).
DATA = Path(__file__).parent / "data"
CLEAN_TRACE = DATA / "clean_trace_embedded_seed42.txt"
# The kit's settings before the warm-up and the ratio floors: they rolled both healthy runs back.
OLD_SETTINGS = {"spike_warmup_steps": 0, "spike_loss_ratio": 1.0, "spike_grad_norm_ratio": 1.0}


def clean_trace(path: Path = CLEAN_TRACE) -> tuple[list[float], list[float]]:
    rows = [line.split() for line in path.read_text().splitlines() if not line.startswith("#")]
    return [float(loss) for loss, _ in rows], [float(norm) for _, norm in rows]


@pytest.mark.parametrize(
    ("trace", "steps", "old_rollbacks"),
    [
        ("clean_trace_embedded_seed42.txt", 3000, [652, 730, 1114, 1247, 1362, 1511, 1670, 2533]),
        (
            "clean_trace_python_source_seed42.txt",
            1000,
            [150, 265, 280, 307, 309, 423, 428, 584, 615, 647, 664, 890],
        ),
    ],
)
def test_a_recorded_clean_run_replayed_through_the_default_guard_is_never_rolled_back(
    trace: str, steps: int, old_rollbacks: list[int]
) -> None:
    losses, grad_norms = clean_trace(DATA / trace)
    assert len(losses) == steps
    new = spike_guard.replay(GuardArgs(), losses, grad_norms)
    assert (new.rollbacks, new.grad_norm_spikes, new.skips) == ([], [], [])
    # Each trace tells them apart: the old settings rolled these healthy runs back.
    assert spike_guard.replay(GuardArgs(**OLD_SETTINGS), losses, grad_norms).rollbacks == old_rollbacks


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_every_fault_injected_into_the_clean_run_after_the_warm_up_is_caught_at_its_step(kind: str) -> None:
    """support/faults.py's damage (x FACTOR on the loss, or on the gradient only: the grad norm) at 15 steps spread over
    the judged part of the run, one per replay (which ends there): each is caught at its step, nothing else is."""
    losses, grad_norms = clean_trace()
    for step in range(GuardArgs().spike_warmup_steps + 1, len(losses) + 1, 197):
        hit_losses, hit_norms = losses[:step], grad_norms[:step]
        if kind == "loss":  # the loss's value and its gradient
            hit_losses[step - 1] *= faults.FACTOR
            hit_norms[step - 1] *= faults.FACTOR
        else:
            hit_norms[step - 1] *= faults.FACTOR
        got = spike_guard.replay(GuardArgs(), hit_losses, hit_norms)
        if kind == "loss":  # skipped before the update: its grad norm never comes
            assert (got.skips, got.rollbacks) == ([step], []), step
        else:
            assert (got.skips, got.grad_norm_spikes, got.rollbacks) == ([], [step], [step]), step


def test_the_replay_tool_prints_old_and_new_false_positives_per_corpus(tmp_path: Path) -> None:
    """`tools/spike_guard_replay.py` as docs/spike-guard.md shows it, on the committed trace."""
    repo = Path(__file__).resolve().parents[3]
    command = [sys.executable, "tools/spike_guard_replay.py", "--corpus", "embedded", str(CLEAN_TRACE)]
    out = subprocess.run(command, cwd=repo, capture_output=True, text=True, check=True).stdout
    (total,) = [line for line in out.splitlines() if line.startswith("embedded (1 runs)")]
    old, new = total.split(" | ")[1:]
    assert old.split() == ["0", "8", "8", "(", "0.0", "26.7", "26.7)"]
    assert new.split() == ["0", "0", "0", "(", "0.0", "0.0", "0.0)"]
    bad = tmp_path / "sparse.jsonl"
    bad.write_text('{"step": 2, "loss": 3.0, "grad_norm": 1.0}\n')
    refused = subprocess.run(
        [*command[:2], "--corpus", "x", str(bad)], cwd=repo, capture_output=True, text=True
    )
    assert refused.returncode != 0 and refused.stderr.startswith("error: ") and "fix: " in refused.stderr


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
