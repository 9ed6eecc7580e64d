"""The engine seam: small protocols by concern (the step, the config rules, the checkpoint format, the memory model),
each engine implementing every one of them, and whether it reshards a checkpoint of another world size itself. The
engines training for real: tests/e2e (test_training_runs.py, test_fsdp.py, test_guarded_runs.py)."""

from __future__ import annotations

import inspect
import typing

import pytest

from model_utils.engines import base
from model_utils.engines.deepspeed_engine import DeepSpeedEngine
from model_utils.engines.fsdp_engine import FsdpEngine

ENGINES = [DeepSpeedEngine, FsdpEngine]
PROTOCOLS = [base.Engine, base.ConfigRules, base.CheckpointFormat, base.MemoryModel]


def methods(protocol: type) -> set[str]:
    """The methods a protocol declares (instance, static and class methods), not Protocol's own machinery."""
    declared = {name: value for name, value in vars(protocol).items() if not name.startswith("_")}
    return {
        name
        for name, value in declared.items()
        if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))
    }


def class_attributes(protocol: type) -> dict[str, object]:
    """What every engine class says about itself (its ClassVars), with the type each must have; `module` and
    `objective` are an instance's (the objective's default a class attribute: checked below)."""
    hints = typing.get_type_hints(protocol)
    return {
        name: typing.get_args(hint)[0] for name, hint in hints.items() if name not in ("module", "objective")
    }


def test_the_seam_is_split_by_concern_into_small_protocols() -> None:
    members = {p.__name__: methods(p) | set(class_attributes(p)) for p in PROTOCOLS}
    assert {"train_step", "save", "load", "from_run", "close"} <= members["Engine"]
    assert {"check_config", "jit_ops", "default_config"} <= members["ConfigRules"]
    assert {"owns_tag", "writer_rank", "convert_universal", "reshards_on_load"} <= members["CheckpointFormat"]
    assert {"estimate_memory", "describe_layout", "layout_flags", "zero_stages"} <= members["MemoryModel"]
    names = [name for names in members.values() for name in names]
    assert len(names) == len(set(names)), "a member declared by two protocols"
    assert max(len(names) for names in members.values()) <= 20


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_each_engine_implements_every_protocol(engine: type, protocol: type) -> None:
    missing = [
        name
        for name in sorted(methods(protocol) | set(class_attributes(protocol)))
        if not hasattr(engine, name)
    ]
    assert missing == [], f"{engine.__name__} lacks {missing}"
    for name in methods(protocol):
        ours, declared = inspect.signature(getattr(engine, name)), inspect.signature(getattr(protocol, name))
        assert list(ours.parameters) == list(declared.parameters), (engine.__name__, name)
        kind = type(inspect.getattr_static(protocol, name))
        assert type(inspect.getattr_static(engine, name)) is kind, (
            engine.__name__,
            name,
        )  # static stays static
    for name, kind in class_attributes(protocol).items():
        assert isinstance(getattr(engine, name), kind), (engine.__name__, name, kind)


def test_only_an_engine_that_cannot_reshard_converts() -> None:
    assert (DeepSpeedEngine.reshards_on_load, FsdpEngine.reshards_on_load) == (False, True)
    with pytest.raises(AssertionError, match="reshard on load"):
        FsdpEngine.convert_universal(None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_an_engine_trains_the_next_token_loss_unless_given_another_objective(engine: type) -> None:
    from model_utils.engines.step_loss import TokenMean

    assert isinstance(engine.objective, TokenMean) and engine.objective.reference_weights is None
    assert engine.objective.take(base.TRAIN) == [] and engine.objective.means([]) == {}
    assert "objective" in inspect.signature(engine.from_run).parameters
