"""The `dskit` command: tools around a training run."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

from model_utils.errors import ConfigError
from model_utils.observe import redact
from model_utils.observe.log import error_line


def _config(args: list[str]) -> int:
    from model_utils.config.arguments import parse_args

    output = "json"
    for i, arg in enumerate(args):  # anywhere among the training flags (none of which is --format)
        if arg == "--format" or arg.startswith("--format="):
            value = arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            if value not in ("json", "yaml"):
                raise ConfigError(
                    "dskit config --format takes json or yaml (dskit config --format yaml [FLAGS])"
                )
            output, args = value, args[:i] + args[i + (1 if "=" in arg else 2) :]
            break
    from dskit import machine

    planned, args = machine.split(args)
    prog = f"dskit config [--format json|yaml] {machine.USAGE}"
    if any(a in ("-h", "--help") for a in args):
        parse_args(args, prog=prog)  # prints the help to stdout and exits
    cfg = parse_args(args, prog=prog)
    from model_utils.resolve import resolver  # torch: after --help, which must stay instant

    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON (or YAML) alone, for scripts
        ranks_on = machine.machine(planned)
        run = resolver.prepare(cfg, plan=ranks_on.ranks)
        if run.complete:
            print(run.complete)
    if output == "yaml":
        from dskit import run_yaml

        print(run_yaml.dump(run), end="")
    else:
        resolved = run.to_dict()
        resolved["resolved"] = {"machine": ranks_on.to_dict(), **resolved["resolved"]}
        print(json.dumps(redact.tree(resolved), indent=2, default=str))
    return 0


def _prepare(train_args: list[str]) -> int:
    from model_utils.config.arguments import parse_args

    cfg = parse_args(train_args, prog="dskit prepare")  # --help exits here, before torch is imported
    from model_utils.loop import observers
    from model_utils.resolve import resolver

    observers.named(cfg.loop.observer_names)  # importable here, as on the ranks

    return _prepared(resolver.prepare(cfg, fetch_hub=True))


def _prepared(run: Any) -> int:
    val = "none" if run.val_blocks is None else f"{len(run.val_blocks)} blocks"
    tag = run.resume.load_dir / run.resume.tag if run.resume else None
    resume = f"resume from {tag}" if tag else "fresh start"
    if run.config.loop.validation_only:
        resume = f"validation only of {tag or run.source.name}"
    print(
        f"ok: {run.source.name}, train {len(run.train_blocks)} blocks x {run.seq_length} tokens, "
        f"validation {val}, {resume}"
    )
    if run.complete:
        print(run.complete)
    return 0


# Exit statuses a launcher tells apart (templates/_common.sh.j2's run_preflight): 1 is the doctor's FAIL, 2 an
# `error:` line, COMPLETE a run with nothing left to train, CRASHED a bug (EX_SOFTWARE).
COMPLETE, CRASHED = 3, 70

PREFLIGHT_USAGE = f"""\
usage: dskit preflight [TRAINING FLAGS...]

`dskit doctor`, then, when no check FAILs, `dskit prepare`, in one process with the same training flags: what
the launchers run before the ranks start. Exit status 1 when a doctor check FAILs (prepare does not run), 2 for
bad flags or what prepare refuses, {COMPLETE} when the run is complete (its checkpoint is at --max_steps: one line),
{CRASHED} for a crash, 0 otherwise. See `dskit doctor --help` for the launch settings it reads, `dskit config --help`
for every training flag."""


def _preflight(train_args: list[str]) -> int:
    # The launchers' checks before the ranks start, in one process: torch, transformers and deepspeed are
    # imported once instead of once per command (several seconds each).
    from dskit import doctor

    if any(a in ("-h", "--help") for a in train_args):
        print(PREFLIGHT_USAGE)
        return 0
    from model_utils.checkpoint import lease
    from model_utils.config.arguments import parse_args
    from model_utils.loop import observers
    from model_utils.resolve import resolver
    from model_utils.storage import file_manifest

    cfg = parse_args(train_args)
    observers.named(cfg.loop.observer_names)  # importable here, as on the ranks
    # A live run in this checkpoint dir refuses the launch here, before the ranks start; a launcher's own lease,
    # taken here, is its rank 0's once the ranks run (so a second launch is refused here at any spacing).
    held = lease.take_for_launch(Path(cfg.checkpoint.checkpoint_dir))
    status = 1
    try:
        ctx = doctor.LaunchContext.from_env(os.environ)
        results, settings = doctor.diagnose(cfg, ctx)
        status = doctor.report(results, ctx)
        if status != 0:
            return status  # 1: a FAIL row (its fix is in the table above): the launch stops before prepare
        # the settings the doctor resolved; a hub model's weights fetched here, once for the job's ranks. The
        # resume candidate's files are checked for presence and size: the ranks verify its checksums, in parallel.
        with file_manifest.checksums_left_to_the_ranks():
            run = resolver.prepare(cfg, settings=settings, fetch_hub=True)
        _prepared(run)
        status = COMPLETE if run.complete else 0
        return status
    finally:
        if held is not None and status != 0:  # no rank will take it over
            held.release()


def _render(args: list[str]) -> int:
    from dskit import render

    return render.main(args)


def _module_main(module: str) -> typing.Callable[[list[str]], int]:
    """A command implemented by `dskit.<module>.main(argv)`, imported only when it runs."""

    def run(args: list[str]) -> int:
        return importlib.import_module(f"dskit.{module}").main(args)

    return run


COMMANDS = {
    "config": (
        _config,
        "print the resolved run for these training flags (config and derived values), as JSON, or with "
        "--format yaml as a run file for --config",
    ),
    "prepare": (
        _prepare,
        "check training flags, model, tokenizer and data, and prepare a small dataset into the cache",
    ),
    "prepare-data": (
        _module_main("prepare_data"),
        "tokenize a dataset once, in parallel, into token shards for --dataset (OUT --dataset SOURCE)",
    ),
    "preflight": (
        _preflight,
        "dskit doctor, then dskit prepare, in one process: what the launchers run before the ranks start",
    ),
    "render": (
        _render,
        "write train.sbatch, train-singlenode.sh, prepare-data.sbatch and eval.sbatch from templates/ (--values FILE, "
        "--set k=v)",
    ),
    "export": (
        _module_main("export"),
        "write a checkpoint as a Hugging Face model dir (CHECKPOINT[/TAG] OUT_DIR)",
    ),
    "eval": (
        _module_main("eval"),
        "evaluate a checkpoint or export on lm-evaluation-harness tasks, into the run's trackers (MODEL --tasks ...)",
    ),
    "estimate": (
        _module_main("estimate"),
        "per-GPU memory and per-node host RAM of a training config, and a config that fits",
    ),
    "doctor": (_module_main("doctor"), "check this node for a run: a pass/warn/fail table with fixes"),
    "plot": (
        _module_main("plot"),
        "plot loss, lr, tokens/s and memory of a run, every launch of it (RUN: its id, a log or metrics file)",
    ),
    "cost": (_module_main("cost"), "a run's goodput and cost from its ledger: where the paid time went"),
    "bench": (_module_main("bench"), "benchmark the kit's training path against a plain PyTorch loop"),
    "wheelhouse": (
        _module_main("env.wheelhouse"),
        "air-gapped installs: build DIR of every locked wheel (connected machine), install it with no network",
    ),
    "gpu-check": (
        _module_main("bench.gpu_check"),
        "acceptance on this GPU: gpu tests, bench against plain PyTorch, the launcher; JSON + table in logs/",
    ),
    "sagemaker": (
        _module_main("sagemaker"),
        "run training as a SageMaker training job (submit [--values FILE] [FLAGS], status, logs, stop JOB)",
    ),
}


def _usage() -> str:
    lines = ["usage: dskit COMMAND [ARGS...]   (dskit COMMAND --help; dskit --version)", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from model_utils.repo import REPO_ROOT

    try:
        number = version("dskit")
    except PackageNotFoundError:  # the checkout on PYTHONPATH (DSKIT_PYTHON), not installed
        number = "unknown (not installed)"
    return f"dskit {number} from {REPO_ROOT}"


def main(argv: list[str] | None = None) -> int:
    from model_utils.launch import startup

    startup.fewer_full_collections()  # before a command's imports (launch/startup.py)
    # Dispatch by hand: training flags after the command pass through verbatim to the strict training parser.
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(_version())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        error_line(f"unknown command {command!r}: {hint}use one of {', '.join(COMMANDS)} (dskit --help)")
        return 2
    try:
        return COMMANDS[command][0](rest)
    except ConfigError as e:
        error_line(str(e))
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the user knows why it stopped, a traceback tells them nothing
        print(f"dskit {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except Exception:  # a bug: its traceback, and a status of its own (1 is the doctor's FAIL to a launcher)
        import traceback

        traceback.print_exc()
        error_line(
            f"dskit {command} crashed (the traceback above): please report it with the command you ran"
        )
        return CRASHED


if __name__ == "__main__":  # the launchers' `python -m dskit.cli preflight`: once per launch, torch loaded
    from model_utils.launch import process_exit

    process_exit.exit_now(main())
