"""When the validation runs (every --validation_freq trained steps and the last; at the start with
--validation_at_start or --validation_only) and that a run without validation data has no validator. The loss it
measures, against a reference computed apart, on 1 and 2 ranks and both engines: tests/e2e/test_validation.py."""

from __future__ import annotations

from types import SimpleNamespace

from model_utils.loop.observers.validation import Validator
from model_utils.observe import watchdog


def validator(every: int = 5, at_start: bool = False, only: bool = False) -> Validator:
    v = object.__new__(Validator)
    v.every, v.at_start, v.only = every, at_start, only
    return v


def test_due_every_validation_freq_steps_and_after_the_last() -> None:
    v = validator(every=5)
    assert [s for s in range(1, 13) if v.evaluation_due(s, last=False)] == [5, 10]
    assert v.evaluation_due(12, last=True) == watchdog.VALIDATION
    assert v.evaluation_due(0, last=False, start=True) is None  # no validation at the start unless asked


def test_at_the_start_of_a_fresh_run_when_asked_and_always_for_validation_only() -> None:
    assert validator(at_start=True).evaluation_due(0, last=False, start=True) == watchdog.VALIDATION
    assert validator(at_start=True).evaluation_due(40, last=False, start=True) is None  # a resume's start
    assert validator(only=True).evaluation_due(40, last=False, start=True) == watchdog.VALIDATION


def test_no_validation_data_no_validator() -> None:
    assert Validator.from_loop(SimpleNamespace(run=SimpleNamespace(val_blocks=None), dist=None)) is None  # type: ignore[arg-type]
