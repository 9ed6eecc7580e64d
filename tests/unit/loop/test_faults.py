"""The faults (launch_env.SPIKE_FAULT) the spike guard's real-run tests inject: KIND@N once, KIND@N+ from draw N on,
`/R` for rank R alone (the slow rank of the straggler tests), anything else refused in one line."""

from __future__ import annotations

import pytest
import torch

from model_utils.errors import ConfigError
from model_utils.launch import launch_env
from model_utils.loop import faults


def test_the_test_faults_parse_and_hit_the_draws_they_name() -> None:
    once, lasting = faults.Fault.parse("loss@3"), faults.Fault.parse("grad@5+")
    assert [once.hits(d) for d in (2, 3, 4)] == [False, True, False]
    assert [lasting.hits(d) for d in (4, 5, 9)] == [False, True, True]
    slow = faults.Fault.parse("slow@2+/1")
    assert (slow.kind, slow.first, slow.lasting, slow.rank) == ("slow", 2, True, 1)
    assert faults.Fault.parse("loss@3").rank is None
    for bad in ("loss", "boom@3", "loss@0", "loss@x", "slow@2+/x", "slow@2/"):
        with pytest.raises(ConfigError, match="is not KIND@N"):
            faults.Fault.parse(bad)


def test_a_slow_fault_on_one_rank_delays_its_steps_by_a_fifth_of_their_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(launch_env.SPIKE_FAULT, "slow@2+/1")
    model = torch.nn.Linear(2, 2)
    assert faults.FaultInjector.from_env(model, rank=0) is None  # another rank's fault
    injector = faults.FaultInjector.from_env(model, rank=1)
    assert injector is not None
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    assert injector.draw() is None  # draw 1: not yet
    injector.step_done()
    injector.step_times.clear()
    injector.step_times.extend([0.4, 0.5, 3.0])  # the recent steps: their median
    assert injector.draw() == "slow" and injector.armed is None  # the loss is left alone
    assert slept == []  # not before the step: in its first forward
    model(torch.zeros(1, 2))
    model(torch.zeros(1, 2))  # a second micro-batch's forward: no second sleep
    injector.step_done()
    assert slept == [pytest.approx(0.1)]
    assert injector.step_times[-1] < 0.1  # the step's own time, without the sleep
    injector.close()
