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


def _export(args: list[str]) -> int:
    import argparse
    import typing
    from pathlib import Path

    from model_utils import export

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> typing.NoReturn:
            raise ConfigError(f"{message} (dskit export --help)")

    parser = Parser(
        prog="dskit export",
        allow_abbrev=False,
        description="Write a checkpoint as a Hugging Face model dir (safetensors, config.json, tokenizer).",
    )
    parser.add_argument("checkpoint", help="a checkpoint dir (its 'latest' tag is exported) or a tag dir")
    parser.add_argument("out_dir", help="new (or empty) directory for the model")
    parser.add_argument("--dtype", choices=export.DTYPES, default="bf16", help="weight dtype (default: bf16)")
    ns = parser.parse_args(args)
    out = export.export(Path(ns.checkpoint), Path(ns.out_dir), ns.dtype)
    load_dir, tag = export.resolve_tag(Path(ns.checkpoint))
    print(f"exported {load_dir / tag} to {out} ({ns.dtype})")
    return 0


COMMANDS = {
    "config": (_config, "print the resolved training config for these training flags, as JSON"),
    "prepare": (_prepare, "check training flags, model, tokenizer and data, and build the packed-data cache"),
    "render": (
        _render,
        "write train.sbatch and train-singlenode.sh from templates/ (--values FILE, --set k=v)",
    ),
    "export": (_export, "write a checkpoint as a Hugging Face model dir (CHECKPOINT[/TAG] OUT_DIR)"),
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
