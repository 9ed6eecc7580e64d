"""The `dskit` command: tools around a training run (later issues add render, export, plot, estimate, ...)."""

from __future__ import annotations

import json
import sys

from model_utils.errors import ConfigError
from model_utils.log import error_line


def _config(train_args: list[str]) -> int:
    from model_utils.arguments import parse_args

    cfg = parse_args(train_args)
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def _prepare(train_args: list[str]) -> int:
    from model_utils import preflight
    from model_utils.arguments import parse_args

    cfg = parse_args(train_args)
    run = preflight.prepare(cfg)
    val = "none" if run.val_blocks is None else f"{len(run.val_blocks)} blocks"
    resume = f"resume from {run.resume.load_dir / run.resume.tag}" if run.resume else "fresh start"
    print(
        f"ok: {run.source.name}, train {len(run.train_blocks)} blocks x {cfg.data.seq_length} tokens, "
        f"validation {val}, {resume}"
    )
    return 0


def _render(args: list[str]) -> int:
    from model_utils import render

    return render.main(args)


COMMANDS = {
    "config": (_config, "print the resolved training config for these training flags, as JSON"),
    "prepare": (_prepare, "check training flags, model, tokenizer and data, and build the packed-data cache"),
    "render": (
        _render,
        "write train.sbatch and train-singlenode.sh from templates/ (--values FILE, --set k=v)",
    ),
}


def _usage() -> str:
    lines = ["usage: dskit COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # Dispatch by hand: training flags after the command pass through verbatim to the strict training parser.
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        error_line(f"unknown command {command!r}: use one of {', '.join(COMMANDS)} (dskit --help)")
        return 2
    try:
        return COMMANDS[command][0](rest)
    except ConfigError as e:
        error_line(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
