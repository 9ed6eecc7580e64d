"""The spike guard's false positives, measured offline: recorded clean runs replayed through the real guard.

    .venv/bin/python tools/spike_guard_replay.py --corpus embedded logs/run-a.jsonl logs/run-b.jsonl \
        --corpus python-source logs/run-c.jsonl [--set spike_grad_norm_ratio=4 ...] [--save_trace FILE]

Each file is a metrics file of a run with `--logging_freq 1` (best with `--spike_guard off`, so that no verdict
changed its path), or a trace as `--save_trace` writes it (one `loss grad_norm` line per optimizer step). Every
run is replayed twice, as a rollback-mode guard (spike_guard.replay): with the kit's old settings (judging from a
full window by mean + sigma alone: `--spike_warmup_steps 0`, both ratios 1) and with the current defaults
(changed by `--set NAME=VALUE`, the flag's name without dashes). Prints skips, grad-norm spikes and rollbacks
per run and per corpus, and per 10,000 steps. A clean run's verdicts are all false positives.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from model_utils.config.arguments import GuardArgs
from model_utils.errors import ConfigError
from model_utils.loop import spike_guard

OLD = {"spike_warmup_steps": 0, "spike_loss_ratio": 1.0, "spike_grad_norm_ratio": 1.0}


def read_trace(path: Path) -> tuple[list[float], list[float]]:
    """(losses, grad norms), one per optimizer step, from a metrics file or a saved trace."""
    if not path.is_file():
        sys.exit(f"error: {path} is not a file ... fix: give a metrics file or a trace --save_trace wrote")
    text = path.read_text()
    if path.suffix == ".jsonl":
        steps: dict[int, tuple[float, float]] = {}
        for record in map(json.loads, text.splitlines()):
            if "event" not in record and "grad_norm" in record:  # a step trained again: its last record
                steps[record["step"]] = (record["loss"], record["grad_norm"])
        if not steps or sorted(steps) != list(range(1, len(steps) + 1)):
            sys.exit(
                f"error: {path} does not have every step from 1 ... fix: record it with --logging_freq 1"
            )
        pairs = [steps[s] for s in sorted(steps)]
    else:
        lines = [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        try:
            pairs = [(float(loss), float(norm)) for loss, norm in lines]
        except ValueError:
            sys.exit(
                f"error: {path} is not a trace of `loss grad_norm` lines ... fix: name a .jsonl metrics file so"
            )
    return [p[0] for p in pairs], [p[1] for p in pairs]


def save_trace(path: Path, losses: list[float], grad_norms: list[float], source: Path) -> None:
    lines = [f"# loss grad_norm per optimizer step, from {source.name} (tools/spike_guard_replay.py)"]
    lines += [f"{loss:.5g} {norm:.5g}" for loss, norm in zip(losses, grad_norms, strict=True)]
    path.write_text("\n".join(lines) + "\n")


def guard_args(overrides: dict[str, str]) -> GuardArgs:
    types = {f.name: f.type for f in dataclasses.fields(GuardArgs) if f.name != "spike_guard"}
    values = {}
    for name, value in overrides.items():
        if name not in types:
            sys.exit(f"error: --set {name}: not a guard setting ... fix: one of {', '.join(sorted(types))}")
        try:
            values[name] = float(value) if types[name] in (float, "float") else int(value)
        except ValueError:
            sys.exit(
                f"error: --set {name}={value}: not a number ... fix: e.g. --set {name}={getattr(GuardArgs(), name)}"
            )
    try:
        return GuardArgs(spike_guard="rollback", **values)
    except ConfigError as e:
        sys.exit(f"error: --set: {e} ... fix: set it in that range")


def row(label: str, steps: int, replays: list[spike_guard.Replay]) -> str:
    cells = [f"{label:<34} {steps:>7}"]
    for r in replays:
        counts = (r.skips, r.grad_norm_spikes, r.rollbacks)
        cells.append(
            " ".join(f"{len(c):>5}" for c in counts)
            + " ("
            + " ".join(f"{r.per_10k(c):6.1f}" for c in counts)
            + ")"
        )
    return " | ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", nargs="+", action="append", required=True, metavar=("NAME", "FILE"))
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--save_trace", type=Path, help="write the first file's trace here, compact")
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.set):
        parser.error("--set takes NAME=VALUE, e.g. --set spike_grad_norm_ratio=10")
    overrides = dict(item.split("=", 1) for item in args.set)
    settings = {"old": guard_args(OLD), "new": guard_args(overrides)}
    print(f"new: {', '.join(f'{k}={v}' for k, v in dataclasses.asdict(settings['new']).items())}")
    heading = "skips grad-norm-spikes rollbacks (per 10k steps)"
    print(f"{'run':<34} {'steps':>7} | old: {heading} | new: {heading}")
    for corpus, *files in args.corpus:
        if not files:
            parser.error(f"--corpus {corpus}: name at least one file")
        steps, sums = 0, {name: spike_guard.Replay(0, [], [], []) for name in settings}
        for file in map(Path, files):
            losses, grad_norms = read_trace(file)
            if args.save_trace is not None:
                save_trace(args.save_trace, losses, grad_norms, file)
                args.save_trace = None
            replays = [spike_guard.replay(s, losses, grad_norms) for s in settings.values()]
            print(row(f"  {file.name}", len(losses), replays))
            steps += len(losses)
            for name, r in zip(settings, replays, strict=True):
                s = sums[name]
                sums[name] = spike_guard.Replay(
                    s.steps + r.steps,
                    s.skips + r.skips,
                    s.grad_norm_spikes + r.grad_norm_spikes,
                    s.rollbacks + r.rollbacks,
                )
        print(row(f"{corpus} ({len(files)} runs)", steps, list(sums.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
