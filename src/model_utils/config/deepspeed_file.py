"""The DeepSpeed-format config a run reads, as given: which file (or run-file section), its contents, and the
rule that joins it with the flags.

Both engines read this one format (DeepSpeed's JSON: its optimizer, scheduler, batch, clipping and precision keys;
ZeRO and the rest are DeepSpeed's own). Each flag with a key of its own fills that key when it is "auto" or
absent; an explicit key the user did not override by flag is adopted (and reported back as the value that
trains); an explicit key that disagrees with an explicit flag is an error (`adopt`). What the values mean for
training is resolved from here once: optim/settings.py (optimizer and schedule), resolve/train_settings.py (batch,
precision, the engine's checks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from model_utils import engines
from model_utils.config.arguments import AUTO, TrainConfig
from model_utils.errors import ConfigError
from model_utils.repo import REPO_ROOT

PRECISIONS = ("bf16", "fp16")


def load_deepspeed_json(path: str, given_as: str = "--deepspeed_config") -> dict[str, Any]:
    """`given_as`: the setting that named the file (TrainConfig.setting), for the message when it is missing."""
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = REPO_ROOT / p  # the kit's own configs work from any working directory
    if not p.is_file():
        raise ConfigError(
            f"DeepSpeed config {path} not found: fix {given_as} (the path of a DeepSpeed JSON file, e.g. "
            "deepspeed/ds_config.json)"
        )
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"DeepSpeed config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {path} must hold a JSON object, not {type(data).__name__}")
    return data


def default_in_use(cfg: TrainConfig) -> bool:
    """Whether the run reads its engine's default config and that default has a GPU-only sibling (no
    --deepspeed_config, no run-file section): on CUDA ranks resolution then picks the sibling where the memory
    estimate says it fits."""
    return (
        cfg.deepspeed_inline is None
        and "deepspeed_config" not in cfg.explicit
        and gpu_only_config(cfg) is not None
    )


def gpu_only_config(cfg: TrainConfig) -> str | None:
    """The GPU-only sibling of the run's engine's default config (see default_in_use), if it has one."""
    return engines.config_rules(cfg.optim.backend).gpu_only_config


def given(cfg: TrainConfig, gpu_only: bool = False) -> tuple[str, dict[str, Any]]:
    """The DeepSpeed-format config this run reads, as given (its path, or what names it), before any flag is
    merged in: the run file's section, --deepspeed_config, or the engine's default file (with `gpu_only`,
    resolution's choice on CUDA ranks, the default's GPU-only sibling)."""
    if cfg.deepspeed_inline is not None:
        return f"the run file {cfg.run_file}'s deepspeed section", json.loads(cfg.deepspeed_inline)
    engine = engines.config_rules(cfg.optim.backend)
    path = cfg.optim.deepspeed_config if "deepspeed_config" in cfg.explicit else engine.default_config
    if gpu_only:
        assert default_in_use(cfg) and engine.gpu_only_config, (
            "an explicit DeepSpeed config is never replaced"
        )
        path = engine.gpu_only_config
    explicit = "deepspeed_config" in cfg.explicit and not gpu_only
    return path, load_deepspeed_json(
        path, cfg.setting("deepspeed_config") if explicit else "the kit's default"
    )


def get(d: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at a key path (e.g. ("optimizer", "params", "lr")); None where any key is missing."""
    value: Any = d
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def precision_of(ds: Mapping[str, Any]) -> str:
    """The training precision a DeepSpeed-format dict asks for: its enabled bf16 or fp16 section, else fp32."""
    for name in PRECISIONS:
        section = ds.get(name)
        if isinstance(section, Mapping) and section.get("enabled"):
            return name
    return "fp32"


def adopt(
    cfg: TrainConfig, flag: str, flag_value: Any, ds: Mapping[str, Any], key_path: tuple[str, ...], path: str
) -> Any:
    """The value that trains for a flag that has a key in the DeepSpeed-format dict `ds` (read from `path`): the
    flag's where the key is "auto" or absent; the key's where the flag was not given (adopted); an error where
    both are given and disagree, or where the flag is given and the key's section is missing (the value would
    not be used)."""
    if len(key_path) > 1 and not isinstance(ds.get(key_path[0]), Mapping):
        if flag in cfg.explicit:
            raise ConfigError(
                f"{cfg.setting(flag)} given but {path} has no {key_path[0]!r} section: add one or drop "
                f"{cfg.key(flag)}"
            )
        return flag_value
    key_value = get(ds, key_path)
    if key_value is None or key_value == AUTO:
        return flag_value
    if flag in cfg.explicit and key_value != flag_value:
        raise ConfigError(
            f"{cfg.setting(flag)} {flag_value} disagrees with {'.'.join(key_path)} = {key_value} in {path}: "
            f'drop {cfg.key(flag)} or set the key to "auto"'
        )
    return type(flag_value)(key_value) if flag_value != AUTO else int(key_value)
