"""Read back what W&B wrote offline (`WANDB_MODE=offline`): the records of each offline run dir's `.wandb` file.

The file is W&B's transaction log, what `wandb sync` uploads: a ":W&B" header, then records in LevelDB's log
format (32 KiB blocks; each chunk: CRC32 (4 bytes), length (2), type (1: whole, 2: first, 3: middle, 4: last))
holding protobuf `Record`s. wandb >= 0.19 reads it only from its Go core, so the tests read it here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7  # ":W&B", a 2-byte magic, a version byte


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4) and pending:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@dataclass
class OfflineRun:
    dir: Path
    run_id: str = ""
    name: str = ""
    project: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> the values logged at it
    files: list[str] = field(default_factory=list)  # files saved with the run (run.save)


def read_run(run_dir: Path) -> OfflineRun:
    (log,) = run_dir.glob("run-*.wandb")
    # The run id from the file's name (W&B names it run-<id>.wandb in offline-run-<time>-<id>/): a resumed run's
    # log does not always carry a run record of its own.
    run = OfflineRun(run_dir, run_id=log.stem.removeprefix("run-"))
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            assert record.run.run_id == run.run_id, (record.run.run_id, log)
            run.name, run.project = record.run.display_name, record.run.project
            run.config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            run.history.setdefault(int(values["_step"]), {}).update(values)
        elif kind == "files":
            run.files += [f.path for f in record.files.files]
    return run


def offline_runs(log_dir: Path) -> list[OfflineRun]:
    """Every offline run under <log_dir>/wandb, oldest first (their dirs are named by start time)."""
    return [read_run(d) for d in sorted((log_dir / "wandb").glob("offline-run-*"))]
