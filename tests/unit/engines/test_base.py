"""The engine seam: each engine implements everything the Engine protocol names, and says whether it reshards a
checkpoint of another world size itself. The engines training for real: tests/e2e (test_training_runs.py,
test_fsdp.py, test_guarded_runs.py)."""

from __future__ import annotations

import inspect
import typing

import pytest

from model_utils.engines.base import Engine
from model_utils.engines.deepspeed_engine import DeepSpeedEngine
from model_utils.engines.fsdp_engine import FsdpEngine

ENGINES = [DeepSpeedEngine, FsdpEngine]


def methods() -> set[str]:
    """The methods the protocol declares (instance, static and class methods), not Protocol's own machinery."""
    declared = {name: value for name, value in vars(Engine).items() if not name.startswith("_")}
    return {
        name
        for name, value in declared.items()
        if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))
    }


def class_attributes() -> dict[str, object]:
    """What every engine class says about itself (its ClassVars), with the type each must have; `module` is an
    instance's."""
    hints = typing.get_type_hints(Engine)
    return {name: typing.get_args(hint)[0] for name, hint in hints.items() if name != "module"}


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_each_engine_implements_the_whole_seam(engine: type) -> None:
    assert {"train_step", "save", "load", "convert_universal", "close"} <= methods()
    assert "reshards_on_load" in class_attributes()
    missing = [name for name in sorted(methods() | set(class_attributes())) if not hasattr(engine, name)]
    assert missing == [], f"{engine.__name__} lacks {missing}"
    for name in methods():
        ours, declared = inspect.signature(getattr(engine, name)), inspect.signature(getattr(Engine, name))
        assert list(ours.parameters) == list(declared.parameters), (engine.__name__, name)
        kind = type(inspect.getattr_static(Engine, name))
        assert type(inspect.getattr_static(engine, name)) is kind, (
            engine.__name__,
            name,
        )  # static stays static
    for name, kind in class_attributes().items():
        assert isinstance(getattr(engine, name), kind), (engine.__name__, name, kind)


def test_only_an_engine_that_cannot_reshard_converts() -> None:
    assert (DeepSpeedEngine.reshards_on_load, FsdpEngine.reshards_on_load) == (False, True)
    with pytest.raises(AssertionError, match="reshard on load"):
        FsdpEngine.convert_universal(None, None)  # type: ignore[arg-type]
