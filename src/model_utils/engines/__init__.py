"""The training engines behind one seam (base.py), each one module owning everything engine-specific; this registry
is the only way in from outside engines/ (tests/unit/engines/test_no_backend_branches.py).

An engine is named by its --backend value; its module is imported on first use, so a rank imports the engine it
trains with and no other. The config parser reads the names here: this module imports nothing heavy. A third
engine is one new module implementing base.Engine and one line in ENGINES.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from model_utils.errors import ConfigError

if TYPE_CHECKING:
    from model_utils.engines.base import Engine

# --backend value -> "module:class"; the first is the default engine.
ENGINES = {
    "deepspeed": "model_utils.engines.deepspeed_engine:DeepSpeedEngine",
    "fsdp": "model_utils.engines.fsdp_engine:FsdpEngine",
}
NAMES = tuple(ENGINES)
DEFAULT = NAMES[0]


def _entry(name: str) -> tuple[str, str]:
    if name not in ENGINES:
        raise ConfigError(f"--backend {name!r} is not a training engine: use one of {', '.join(NAMES)}")
    module, _, cls = ENGINES[name].partition(":")
    return module, cls


def engine_module(name: str) -> str:
    """The dotted name of the module that holds engine `name`."""
    return _entry(name)[0]


def engine_class(name: str) -> type[Engine]:
    """The class of engine `name` (a --backend value), importing its module on first use."""
    module, cls = _entry(name)
    engine: type[Engine] = getattr(importlib.import_module(module), cls)
    return engine


def engine_of_tag(tag_dir: Path) -> str | None:
    """The engine that wrote the checkpoint tag `tag_dir` (each engine recognises its own files), None when no
    engine's files are there. Asks the engines in ENGINES order, importing each until one claims the tag."""
    for name in ENGINES:
        if engine_class(name).owns_tag(tag_dir):
            return name
    return None
