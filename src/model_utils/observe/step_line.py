"""The run log's lines, rendered from the records they show (people read the log; tools read the records).

The step and validation lines come from the metrics record (one table of fields below), which SageMaker's metric
definitions also scrape (metric_regex); the lines that say how a run started and ended, the checkpoints it saved,
its files and trackers, and the one-line error.

    Step 10/100 | Loss 7.1234 | lr 3.00e-03 | grad_norm 1.23 | tokens/s 2600 (1300/device) | trained tokens/s 2500 | ... | ETA 0:00:42
    Step 40/40 | Validation Loss 5.2213 | Perplexity 185.17 | bits/byte 1.9325 | 16 of 1,777 blocks (32,752 target tokens) | took 2.3 s
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NOWHERE = "nowhere (--metrics_file none)"


@dataclass(frozen=True)
class Field:
    """One `label value` part of a line: record keys, their formats, and how they stand after the label."""

    label: str  # "" for a part that is its template alone
    keys: tuple[str, ...]
    formats: tuple[str, ...]  # "," for a count, read back as an int
    template: str = "{}"  # "{}" per key
    scale: float = 1.0  # e.g. 100 for a fraction shown as a percentage

    def render(self, record: dict[str, Any]) -> str | None:
        values = [record.get(k) for k in self.keys]
        if any(v is None for v in values):
            return None
        shown = [
            format(v if f == "," else v * self.scale, f) for v, f in zip(values, self.formats, strict=True)
        ]
        return f"{self.label} {self.template.format(*shown)}".lstrip()


STEP_FIELDS: tuple[Field, ...] = (
    Field("Loss", ("loss",), (".4f",)),
    Field("lr", ("lr",), (".2e",)),
    Field("grad_norm", ("grad_norm",), (".2f",)),
    # Preference objectives (engines/preference.py): the chosen answers' reward over the rejected ones', and the
    # share of pairs where it is higher.
    Field("reward margin", ("reward_margin",), (".4f",)),
    Field("reward accuracy", ("reward_accuracy",), (".1f",), "{}%", scale=100.0),
    Field("tokens/s", ("tokens_per_s", "tokens_per_s_per_device"), (".0f", ".0f"), "{} ({}/device)"),
    # Of those, the tokens trained on (targets): fewer under a masked loss or document packing.
    Field("trained tokens/s", ("trained_tokens_per_s",), (".0f",)),
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
    Field("bits/byte", ("val_bpb",), (".4f",)),
    Field("Validation reward margin", ("val_reward_margin",), (".4f",)),
    Field("Validation reward accuracy", ("val_reward_accuracy",), (".1f",), "{}%", scale=100.0),
    # What the loss covered: a few batches per rank, or all of the validation blocks (--validation_batches all),
    # and the target tokens of those blocks (masked and padded tokens are not scored).
    Field(
        "",
        ("val_blocks", "val_total_blocks", "val_tokens"),
        (",", ",", ","),
        "{} of {} blocks ({} target tokens)",
    ),
    Field("", ("val_pairs", "val_total_blocks"), (",", ","), "{} of {} pairs"),  # preference data's blocks
    Field("took", ("val_s",), (".1f",), "{} s"),
)
# Log scrapers with a regex engine of their own (SageMaker's metric definitions) get plain groups and classes only:
# no look-arounds, no non-capturing groups, the first group the value.
PLAIN_NUMBER = r"([-+]?[0-9][0-9.eE+-]*|nan|inf)"


def metric_regex(label: str) -> str:
    """A regex that captures the (first) number after `label` in a step or validation line, for log scrapers
    (SageMaker's metric definitions). The step line's first field is anchored on the step counter, so `Loss`
    never matches the validation line's `Validation Loss`."""
    fields = (*STEP_FIELDS, *VALIDATION_FIELDS)
    field = next(f for f in fields if f.label == label)
    before, _, after = field.template.partition("{}")
    unit = "" if "{}" in after else after  # a second number follows (tokens/s (N/device)): capture the first
    where = r"Step [0-9]+/[0-9]+ \| " if field is STEP_FIELDS[0] else r"\| "
    return where + _plain_escape(f"{label} {before}") + PLAIN_NUMBER + _plain_escape(unit)


def _plain_escape(text: str) -> str:
    """Regex metacharacters escaped, nothing else (re.escape also escapes spaces, which other engines misread)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _line(record: dict[str, Any], max_steps: int, fields: tuple[Field, ...], tail: list[str]) -> str:
    parts = [f"Step {record['step']}/{max_steps}"]
    parts += [text for f in fields if (text := f.render(record)) is not None]
    return " | ".join(parts + tail)


# --- the records: steps, validations, starts -------------------------------------------------


# A mixture's keys, one per source (data/mixture.py): the realised token share of the data read, in the step
# record ("share/web"); each source's validation loss, perplexity, bits per byte and target tokens, in the
# validation record ("val_loss/web", "val_ppl/web", "val_bpb/web", "val_tokens/web").
SHARE = "share/"
SOURCE_KEYS = ("val_loss", "val_ppl", "val_bpb", "val_tokens")


def _per_source(record: dict[str, Any], prefix: str, label: str, template: str) -> list[str]:
    named = [(key[len(prefix) :], value) for key, value in record.items() if key.startswith(prefix)]
    if not named:
        return []
    return [f"{label} " + " ".join(f"{name} {template.format(value)}" for name, value in named)]


def step_line(record: dict[str, Any], max_steps: int, time_left: float | None = None) -> str:
    """The log line of a metrics record; a mixture's shares read, skipped steps and the ETA (and the job's time
    left) at the end."""
    tail = _per_source(record, SHARE, "shares", "{:.1%}")
    tail += [f"skipped {record['skipped_steps']}"] if record.get("skipped_steps") else []
    eta = f"ETA {format_duration(record['eta_s'])}"
    tail.append(eta + ("" if time_left is None else f" (job time left {format_duration(time_left)})"))
    return _line(record, max_steps, STEP_FIELDS, tail)


def validation_line(record: dict[str, Any], max_steps: int) -> str:
    """The validation line; a mixture's score of each source at the end."""
    names = [key.split("/", 1)[1] for key in record if key.startswith("val_loss/")]
    parts = []
    for name in names:
        loss, ppl, bpb, tokens = (record.get(f"{key}/{name}") for key in SOURCE_KEYS)
        parts.append(f"{name} {loss:.4f} ppl {ppl:.2f} bits/byte {bpb:.4f} ({tokens:,} target tokens)")
    return _line(record, max_steps, VALIDATION_FIELDS, ["per source " + ", ".join(parts)] if parts else [])


SAMPLE_SHOWN = 60  # characters of a sample's prompt (its end) and text (its start) the log shows


def samples_lines(step: int, samples: list[tuple[str, str]], seconds: float) -> list[str]:
    """The samples in brief, one line each (the metrics file and the trackers have them whole)."""

    def one_line(text: str) -> str:
        return " ".join(text.split())

    lines = [f"Samples at step {step}: {len(samples)} prompts in {seconds:.1f} s"]
    for k, (prompt, text) in enumerate(samples, 1):
        prompt, text = one_line(prompt), one_line(text)
        shown_prompt = prompt if len(prompt) <= SAMPLE_SHOWN else "..." + prompt[-SAMPLE_SHOWN:]
        shown_text = text if len(text) <= SAMPLE_SHOWN else text[:SAMPLE_SHOWN] + "..."
        lines.append(f"  [{k}] {shown_prompt!r} -> {shown_text!r}")
    return lines


def resumed_line(path: Any, step: int, epoch: int, consumed: int, lr: float) -> str:
    return f"Resumed from {path} at step {step} (epoch {epoch}, block {consumed}, lr {lr:.2e})"


def fresh_line(checkpoint_dir: str) -> str:
    return f"No verified checkpoint in {checkpoint_dir}: starting fresh"


# --- how the loop ended ------------------------------------------------------------------------


def done_line(step: int, max_steps: int, tokens_seen: int) -> str:
    return f"Done: step {step}/{max_steps}, {tokens_seen} tokens seen"


def preempted_line(step: int, requested_by: str) -> str:
    return f"Preempted: stop requested by {requested_by}; saved at step {step}"


def interrupted_line(step: int) -> str:
    """Said when the ranks agree to stop for a Ctrl-C, before the save (launch/preemption.py)."""
    return (
        f"interrupted (Ctrl-C): saving a checkpoint at step {step}, then stopping; "
        "Ctrl-C again to abort without saving"
    )


def walltime_line(step: int) -> str:
    return f"Stopped at step {step} before the job's time limit; saved (a requeued job resumes here)"


def stopped_line(step: int, reason: str, why: str) -> str:
    """An observer asked to stop (`reason`: one word, as in the metrics file's end record)."""
    return f"Stopped at step {step} ({reason}): {why}; saved"


VALIDATED = "validated"  # why a --validation_only run ended: its end record's reason, its end line's


def validation_only_line(model: Any, step: int) -> str:
    """What a --validation_only run validates: a checkpoint's tag dir (at its step), or --model as built (step 0)."""
    return f"Validation only: {model} at step {step}"


def validated_line(step: int) -> str:
    """A --validation_only run's end (its end record's reason: VALIDATED)."""
    return f"Validated the model at step {step}: nothing trained or saved"


# --- checkpoints, the run's files and trackers, errors -------------------------------------------


def saved_line(tag_dir: Path, detail: str) -> str:
    """A checkpoint is complete; `detail`: its size and write speed."""
    return f"Saved checkpoint {tag_dir} ({detail})"


def run_line(run_id: str, metrics_file: Path | None, report_to: str, report_dir: str) -> str:
    where = _NOWHERE if metrics_file is None else str(metrics_file)
    tracker = "" if report_to == "none" else f", {report_to.replace(',', ', ')} under {report_dir}"
    return f"Run {run_id}: metrics to {where}{tracker}"


def mlflow_line(mlflow_run_id: str, experiment: str, tracking_uri: str, parent_run_id: str | None) -> str:
    """The MLflow run a job logs to (`tracking_uri` without credentials)."""
    child = f", child of {parent_run_id}" if parent_run_id is not None else ""
    return f"MLflow run {mlflow_run_id} in experiment {experiment!r} at {tracking_uri}{child}"


def error_line(message: str) -> str:
    """The one line a user sees for a mistake (stderr; the launchers print theirs the same way)."""
    return f"error: {message}"
