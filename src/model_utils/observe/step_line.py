"""The run log's step, validation, resume and fresh-start lines: rendered here from the metrics record, and
parsed back here (for `dskit plot` on a log without its metrics file), so the two cannot drift apart.

    Step 10/100 | Loss 7.1234 | lr 3.00e-03 | grad_norm 1.23 | tokens/s 2600 (1300/device) | ... | ETA 0:00:42
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
_STEP = re.compile(r"(?:^|\|)\s*Step (\d+)/\d+\s*\|(.*)$")
_RESUMED = re.compile(r"(?:^|\|)\s*Resumed from .+? at step (\d+)")
_FRESH = re.compile(r"(?:^|\|)\s*No (?:verified )?checkpoint in .*: starting fresh")


@dataclass(frozen=True)
class Field:
    """One `label value` part of a line: record keys, their formats, and how they stand after the label."""

    label: str
    keys: tuple[str, ...]
    formats: tuple[str, ...]
    template: str = "{}"  # "{}" per key
    scale: float = 1.0  # e.g. 100 for a fraction shown as a percentage

    def render(self, record: dict[str, Any]) -> str | None:
        values = [record.get(k) for k in self.keys]
        if any(v is None for v in values):
            return None
        shown = [format(v * self.scale, f) for v, f in zip(values, self.formats, strict=True)]
        return f"{self.label} {self.template.format(*shown)}"

    def pattern(self) -> re.Pattern[str]:
        value = re.escape(self.template).replace(re.escape("{}"), NUMBER)
        return re.compile(rf"^{re.escape(self.label)} {value}$")


STEP_FIELDS: tuple[Field, ...] = (
    Field("Loss", ("loss",), (".4f",)),
    Field("lr", ("lr",), (".2e",)),
    Field("grad_norm", ("grad_norm",), (".2f",)),
    Field("tokens/s", ("tokens_per_s", "tokens_per_s_per_device"), (".0f", ".0f"), "{} ({}/device)"),
    Field("TFLOPs/device", ("tflops_per_device",), (".3g",)),
    Field("MFU", ("mfu",), (".1f",), "{}%", scale=100.0),
    Field("mem", ("device_mem_alloc_gib", "device_mem_peak_gib"), (".1f", ".1f"), "{}/{} GiB"),
    Field("RSS", ("host_rss_gib",), (".1f",), "{} GiB"),
    Field("data", ("data_wait_frac",), (".1f",), "{}%", scale=100.0),
    Field("s/step", ("step_time_s",), (".3f",)),
)
VALIDATION_FIELDS: tuple[Field, ...] = (
    Field("Validation Loss", ("val_loss",), (".4f",)),
    Field("Perplexity", ("val_ppl",), (".2f",)),
)
_PATTERNS: tuple[tuple[Field, re.Pattern[str]], ...] = tuple(
    (f, f.pattern()) for f in (*STEP_FIELDS, *VALIDATION_FIELDS)
)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _line(record: dict[str, Any], max_steps: int, fields: tuple[Field, ...], tail: list[str]) -> str:
    parts = [f"Step {record['step']}/{max_steps}"]
    parts += [text for f in fields if (text := f.render(record)) is not None]
    return " | ".join(parts + tail)


def step_line(record: dict[str, Any], max_steps: int, time_left: float | None = None) -> str:
    """The log line of a metrics record; skipped steps and the ETA (and the job's time left) at the end."""
    tail = [f"skipped {record['skipped_steps']}"] if record.get("skipped_steps") else []
    eta = f"ETA {format_duration(record['eta_s'])}"
    tail.append(eta + ("" if time_left is None else f" (job time left {format_duration(time_left)})"))
    return _line(record, max_steps, STEP_FIELDS, tail)


def validation_line(record: dict[str, Any], max_steps: int) -> str:
    return _line(record, max_steps, VALIDATION_FIELDS, [])


def resumed_line(path: Any, step: int, epoch: int, consumed: int, lr: float) -> str:
    return f"Resumed from {path} at step {step} (epoch {epoch}, block {consumed}, lr {lr:.2e})"


def fresh_line(checkpoint_dir: str) -> str:
    return f"No verified checkpoint in {checkpoint_dir}: starting fresh"


def parse(line: str) -> dict[str, Any] | None:
    """The record (in the metrics file's keys) or start event a log line shows, else None."""
    if match := _STEP.search(line):
        record: dict[str, Any] = {"step": int(match.group(1))}
        for part in match.group(2).split("|"):
            for field, pattern in _PATTERNS:
                if found := pattern.match(part.strip()):
                    values = (float(v) / field.scale for v in found.groups())
                    record.update(zip(field.keys, values, strict=True))
        return record
    if match := _RESUMED.search(line):
        return {"event": "start", "step": int(match.group(1)), "resumed_from": "checkpoint"}
    if _FRESH.search(line):
        return {"event": "start", "step": 0, "resumed_from": None}
    return None


def parse_log(text: str) -> list[dict[str, Any]]:
    return [record for line in text.splitlines() if (record := parse(line)) is not None]
