"""DeepSpeed configs for tests: the kit's default one with whole top-level sections replaced, a config written
as given, and the dict deepspeed.initialize gets from a parsed config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model_utils.config.arguments import parse_args
from model_utils.resolve import train_settings

DEFAULT = Path(__file__).resolve().parents[2] / "deepspeed" / "ds_config.json"


def config_with(directory: Path, **sections) -> str:
    """deepspeed/ds_config.json with each given top-level section replaced (None: removed), written to
    directory/ds.json; its path."""
    ds = json.loads(DEFAULT.read_text())
    for key, value in sections.items():
        if value is None:
            ds.pop(key, None)
        else:
            ds[key] = value
    path = directory / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


def write_ds(tmp_path: Path, cfg: dict | str) -> str:
    """A DeepSpeed config (a dict, or text as given) written to tmp_path/ds.json; its path."""
    path = tmp_path / "ds.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def resolve_ds(argv: list[str]) -> Any:
    """The train settings of these flags (the DeepSpeed config read, checked and joined with the flags)."""
    return train_settings.resolve(parse_args(argv))


def ds_dict(cfg: Any, total_steps: int | None = None) -> dict:
    """The dict deepspeed.initialize gets (an "auto" micro batch as the probe's smallest, 1)."""
    settings = train_settings.resolve(cfg)
    micro_batch = settings.micro_batch_size if isinstance(settings.micro_batch_size, int) else 1
    return settings.deepspeed_json(micro_batch, total_steps or cfg.loop.max_steps)
