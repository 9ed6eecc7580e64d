"""DeepSpeed configs for tests: the kit's default one with whole top-level sections replaced."""

from __future__ import annotations

import json
from pathlib import Path

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
