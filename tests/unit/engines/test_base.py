"""The engine seam: each engine implements everything the Engine protocol names, and says whether it reshards a
checkpoint of another world size itself. The engines training for real: tests/e2e (test_training_runs.py,
test_fsdp.py, test_guarded_runs.py)."""

from __future__ import annotations

import inspect

import pytest

from model_utils.engines.base import Engine
from model_utils.engines.deepspeed_engine import DeepSpeedEngine
from model_utils.engines.fsdp_engine import FsdpEngine

ENGINES = [DeepSpeedEngine, FsdpEngine]


def seam() -> set[str]:
    """The members the protocol declares (methods and class attributes), not Protocol's own machinery."""
    declared = {name for name in vars(Engine) if not name.startswith("_")}
    return declared | set(inspect.get_annotations(Engine))


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_each_engine_implements_the_whole_seam(engine: type) -> None:
    names = seam()
    assert {"train_step", "save", "load", "convert_universal", "reshards_on_load", "close"} <= names
    missing = [name for name in sorted(names - {"module"}) if not hasattr(engine, name)]
    assert missing == [], f"{engine.__name__} lacks {missing}"
    for name in names - {"module", "reshards_on_load"}:
        ours, declared = inspect.signature(getattr(engine, name)), inspect.signature(getattr(Engine, name))
        assert list(ours.parameters) == list(declared.parameters), (engine.__name__, name)
    assert isinstance(engine.reshards_on_load, bool)
    assert isinstance(inspect.getattr_static(engine, "convert_universal"), staticmethod)


def test_only_an_engine_that_cannot_reshard_converts() -> None:
    assert (DeepSpeedEngine.reshards_on_load, FsdpEngine.reshards_on_load) == (False, True)
    with pytest.raises(AssertionError, match="reshard on load"):
        FsdpEngine.convert_universal(None, None)  # type: ignore[arg-type]
