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
