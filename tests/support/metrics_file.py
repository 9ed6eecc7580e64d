"""A run's metrics as the tests read them: its metrics file (JSON lines) and its TensorBoard scalars."""

from __future__ import annotations

import json
from pathlib import Path


def step_records(path: Path) -> dict[int, dict]:
    """The logged training steps by step number (start events and validation records left out)."""
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each scalar's (step, value)s in the order they were written. The accumulator reads a run dir's event files in
    name order, and two writers' files named in the same second order by a per-process counter (9 after 10): so by
    wall time (a stable sort: one file's events are in order already)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in sorted(acc.Scalars(tag), key=lambda event: event.wall_time)]
        for tag in acc.Tags()["scalars"]
    }


def tensorboard_texts(run_dir: Path, tag: str) -> dict[int, str]:
    """The text a TensorBoard run holds under `tag` (add_text), by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")}


def sample_records(path: Path) -> dict[int, dict]:
    """The samples events (--sample_prompts) by step."""
    records = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r for r in records if r.get("event") == "samples"}
