"""The training engines behind one seam (base.py), each one module owning everything engine-specific; this registry
is the only way to an engine's module from outside engines/ (tests/unit/engines/test_no_backend_branches.py).

An engine is named by its --backend value; its module is imported on first use, so a rank imports the engine it
trains with and no other. The config, a layer below, names them (--backend's choices, config/arguments.py
BACKENDS; tests/unit/engines/test_registry.py holds the two equal). A third engine is one new module implementing
base.py's protocols, one line in ENGINES and its name there.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_utils.errors import ConfigError
from model_utils.launch import ops

if TYPE_CHECKING:
    from model_utils.engines.base import CheckpointFormat, ConfigRules, Engine, MemoryModel

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


def _class(name: str) -> Any:
    module, cls = _entry(name)
    return getattr(importlib.import_module(module), cls)


def engine_class(name: str) -> type[Engine]:
    """The class of engine `name` (a --backend value), importing its module on first use. It builds the training
    step (from_run) and is the engine's ConfigRules, CheckpointFormat and MemoryModel too, as handed out below."""
    return _class(name)


def config_rules(name: str) -> type[ConfigRules]:
    return _class(name)


def checkpoint_format(name: str) -> type[CheckpointFormat]:
    return _class(name)


def memory_model(name: str) -> type[MemoryModel]:
    return _class(name)


def engine_of_tag(tag_dir: Path) -> str | None:
    """The engine that wrote the checkpoint tag `tag_dir` (each engine recognises its own files), None when no
    engine's files are there. Asks the engines in ENGINES order, importing each until one claims the tag."""
    for name in ENGINES:
        if checkpoint_format(name).owns_tag(tag_dir):
            return name
    return None


def jit_ops(backend: str, ds: dict[str, Any], device_type: str) -> tuple[str, ...]:
    """Every DeepSpeed op builder (class name) a run of engine `backend` with the checked DeepSpeed-format config
    `ds` on ranks of `device_type` ("cpu", "cuda") JIT-loads: the process group's, then the engine's. The ranks
    build these (ops.build_ops, announced) and `dskit doctor` checks them."""
    return ops.comm_ops(device_type) + config_rules(backend).jit_ops(ds, device_type)
