"""`dskit eval`: downstream evaluation of a trained model with EleutherAI's lm-evaluation-harness (`lm_eval`),
as a command or a job (eval.sbatch, chained after training with --dependency=afterok).

The model is a Hugging Face model dir (`dskit export`'s output) or a checkpoint (a run's --checkpoint_dir: its
newest verified tag; or a tag dir), which is exported first by `dskit export`'s own code, into --export_dir or a
temporary dir removed afterwards. lm-eval's HFLM loads it.

With --apply_chat_template each request is prompted in the model's chat template (lm-eval's option of that name):
the one its run trained with, which every checkpoint and export carries in its tokenizer; a model without one is
refused in one line.

Tasks are named by --tasks: a task shipped in dskit/eval/tasks/ (dskit_tiny_mc: 40 multiple-choice questions for
the tests), a task YAML file of lm-eval's format (its `dataset_kwargs.data_files` may be relative to the YAML's
folder: it is loaded from there), or a task of lm-eval's own registry (hellaswag, ...; those fetch their data
from the hub unless the datasets cache holds it: HF_DATASETS_OFFLINE=1 on a cluster without internet).

A checkpoint's results go into the training run's trackers (launch.json's --report_to, --report_dir,
--tracking_uri; the tag's train state names the TensorBoard run dir, the MLflow run and the W&B run) at the
checkpoint's step, as `eval/<task>/<metric>`. An export dir names no training run: its results are printed and
written to --output only. lm_eval is imported only when an evaluation runs: a training rank never imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils.errors import CommandParser, ConfigError, first_line

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LM_EVAL = "lm_eval"  # the module: in the `eval` dependency group, not a requirement of a training interpreter
METRIC_PREFIX = "eval"
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def shipped_tasks() -> dict[str, Path]:
    """The tasks shipped with dskit: name -> its YAML (tasks/<name>/<name>.yaml)."""
    return {path.stem: path for path in sorted(TASKS_DIR.glob("*/*.yaml")) if path.parent.name == path.stem}


@dataclass(frozen=True)
class EvalResult:
    """What `dskit eval` (and `dskit.api.evaluate`) hands back; to_dict() is JSON."""

    # the export dir given or kept (--export_dir), else the checkpoint given (its export is removed)
    model: str
    checkpoint: str | None  # the tag evaluated, when a checkpoint was given
    step: int | None  # its optimizer step: the step the trackers record the results at
    metrics: dict[str, dict[str, float]]  # task -> metric -> value (metric "acc"; "acc_stderr", ...)
    samples: dict[str, int]  # task -> items evaluated
    # where the results went: "tensorboard <run dir>", "mlflow <run id>", "wandb <run id>"
    recorded: list[str]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResult:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


# --- what to evaluate: the model and the tasks -----------------------------------------------------------------


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def check_lm_eval() -> None:
    import importlib.util
    import sys

    if importlib.util.find_spec(LM_EVAL) is None:
        raise ConfigError(
            f"lm-eval (lm-evaluation-harness) is not installed in {sys.executable}: `uv sync --frozen` installs it "
            "into the kit's .venv (the eval dependency group); into another interpreter: pip install lm-eval at "
            "uv.lock's version"
        )


def check_model(path: Path) -> None:
    if not path.exists():
        raise ConfigError(
            f"{path} does not exist: pass a run's checkpoint dir, one of its tag dirs, or a model dir written by "
            "dskit export"
        )
    if not path.is_dir():
        raise ConfigError(
            f"{path} is not a directory: pass a checkpoint dir, a tag dir or an exported model dir"
        )


def check_chat_template(tokenizer_dir: Path, model: Path) -> None:
    """--apply_chat_template: the model's tokenizer (a checkpoint's hf_config/, an export's own) has a template."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(tokenizer_dir).chat_template is None:
        raise ConfigError(
            f"{model} has no chat template (its run trained with none and its tokenizer has none): drop "
            "--apply_chat_template"
        )


def resolve_tasks(specs: list[str]) -> list[str | Path]:
    """--tasks' entries as YAML paths (shipped names, files) or lm-eval registry names, checked before anything
    is exported or loaded; an unknown name or a missing file is a ConfigError."""
    if not specs:
        raise ConfigError(
            f"--tasks is empty: name one or more tasks, e.g. --tasks {next(iter(shipped_tasks()))}"
        )
    shipped = shipped_tasks()
    resolved: list[str | Path] = []
    registry: list[str] = []
    for spec in specs:
        path = Path(spec)
        if spec in shipped:
            resolved.append(shipped[spec])
        elif path.suffix in (".yaml", ".yml") or "/" in spec:
            if not path.is_file():
                raise ConfigError(
                    f"task file {spec} not found: pass an lm-eval task YAML file or a task name"
                )
            resolved.append(path.resolve())
        else:
            resolved.append(spec)
            registry.append(spec)
    if registry:
        known = set(_registry().all_subtasks) | set(_registry().all_groups) | set(_registry().all_tags)
        for name in registry:
            if name not in known:
                import difflib

                close = difflib.get_close_matches(name, [*shipped, *known], n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ConfigError(
                    f"unknown task {name!r}: {hint}use a task shipped with dskit ({', '.join(shipped)}), an "
                    "lm-eval task name, or the path of a task YAML file"
                )
    return resolved


_REGISTRY: list[Any] = []


def _registry() -> Any:
    """lm-eval's own task index (seconds to build: only when a registry name is asked for)."""
    if not _REGISTRY:
        from lm_eval.tasks import TaskManager

        _REGISTRY.append(TaskManager())
    return _REGISTRY[0]


def load_tasks(resolved: list[str | Path]) -> list[Any]:
    """lm-eval Task objects. A YAML's task is built (its data loaded) from the YAML's folder, so data_files
    relative to it are found whatever the working directory."""
    from lm_eval.tasks import TaskManager

    tasks: list[Any] = []
    for spec in resolved:
        if isinstance(spec, Path):
            manager = TaskManager(include_defaults=False)
            try:
                with contextlib.chdir(spec.parent):
                    loaded = manager.load([str(spec)])
            except Exception as err:  # lm-eval's and datasets' own errors: a bad YAML or unreadable data
                raise ConfigError(
                    f"task {spec} cannot be loaded ({first_line(err)}): fix the task file"
                ) from None
        else:
            loaded = _registry().load([spec])
        tasks.extend(loaded["tasks"].values())
    return tasks


# --- results ---------------------------------------------------------------------------------------------------


def task_metrics(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's results ({"acc,none": 0.3, "alias": ...}) as task -> metric -> finite value; a filter other
    than lm-eval's "none" stays in the name (acc_strict-match)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        metrics: dict[str, float] = {}
        for key, value in values.items():
            name, _, filter_name = key.partition(",")
            if not filter_name or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                metrics[name if filter_name == "none" else f"{name}_{filter_name}"] = float(value)
        out[task] = metrics
    return out


def tracker_record(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    """The trackers' names: eval/<task>/<metric>."""
    return {
        f"{METRIC_PREFIX}/{task}/{name}": value
        for task, values in metrics.items()
        for name, value in values.items()
    }


def summary_line(task: str, metrics: dict[str, float], samples: int) -> str:
    shown = [
        f"{name} {value:.4f}" + (f" ± {metrics[f'{name}_stderr']:.4f}" if f"{name}_stderr" in metrics else "")
        for name, value in metrics.items()
        if not name.endswith("_stderr")
    ]
    return f"{task}: {', '.join(shown)} ({samples} items)"


# --- the training run's trackers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingRun:
    """The run a tag belongs to, as its records say: launch.json's report settings and the train state's run
    id and tracker runs."""

    tag_dir: Path
    step: int
    run_id: str
    report: dict[str, Any]
    tracker_state: dict[str, Any]
    config: dict[str, Any]

    @classmethod
    def of_tag(cls, tag_dir: Path) -> TrainingRun:
        from model_utils.checkpoint import launch_record, protocol
        from model_utils.loop.state import tracker_ids

        launch = launch_record.read(tag_dir) or {}
        state = protocol.read_train_state(tag_dir)
        config = launch.get("config") or {}
        return cls(
            tag_dir=tag_dir,
            step=int(state["step"]),
            run_id=str(state.get("run_id") or ""),
            report=dict(config.get("report") or {}),
            tracker_state=tracker_ids(state),
            config=config,
        )

    @property
    def log_dir(self) -> Path:
        """The run's --report_dir (relative ones from the working dir, as the launchers ran it: the repo)."""
        from model_utils.config.arguments import ReportArgs

        return Path(self.report.get("report_dir") or ReportArgs().report_dir)

    def record(self, report_to: str, metrics: dict[str, float]) -> list[str]:
        """Log the results into the run's trackers at its step; returns where they went."""
        from model_utils.config.arguments import ReportArgs
        from model_utils.observe import trackers

        names = ReportArgs(report_to=report_to).trackers
        if not names or not self.run_id:
            return []
        tracker, state = trackers.open_tracker(
            report_to,
            run_id=self.run_id,
            log_dir=self.log_dir,
            config=self.config,
            tracking_uri=self.report.get("tracking_uri"),
            resume_state=self.tracker_state or None,
            resume_step=None,  # nothing to hide: the eval adds to the run, it does not replay it
            parent_run_id=self.report.get("mlflow_parent_run_id"),
            wandb_project=self.report.get("wandb_project"),
        )
        try:
            tracker.log_metrics(self.step, {"time": time.time(), **metrics})
        finally:
            tracker.close()
        # the TensorBoard run dir, the MLflow and W&B run ids, as the tracker state names them
        return [
            f"tensorboard {self.log_dir / 'tensorboard' / state[name]['run']}"
            if name == "tensorboard"
            else f"{name} {state[name]['run_id']}"
            for name in names
        ]


# --- the evaluation ------------------------------------------------------------------------------------------


def evaluate(
    model: str | Path,
    tasks: list[str],
    *,
    export_dir: str | Path | None = None,
    dtype: str = "bf16",
    device: str | None = None,
    batch_size: int = 16,
    limit: int | None = None,
    report_to: str | None = None,
    apply_chat_template: bool = False,
    on_line: Any = print,
) -> EvalResult:
    """Evaluate `model` (a checkpoint dir, a tag dir or an exported model dir) on `tasks` with lm-eval; a
    checkpoint's results go into its training run's trackers (`report_to`: default the run's own --report_to;
    "none": nowhere); `apply_chat_template`: prompted in the model's chat template. Bad input raises ConfigError
    before anything is exported."""
    started = time.monotonic()
    path = Path(model)
    check_lm_eval()
    check_model(path)
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if batch_size < 1 or (limit is not None and limit < 1):
        raise ConfigError("--batch_size and --limit take a positive number of items: e.g. --batch_size 16")
    if report_to is not None and report_to != "none":
        from model_utils.config.arguments import ReportArgs

        ReportArgs(report_to=report_to)  # the trainer's own check of the names
    resolved = resolve_tasks(tasks)
    run: TrainingRun | None = None
    if not is_model_dir(path):
        from dskit import export

        load_dir, tag = export.resolve_tag(path)
        run = TrainingRun.of_tag(load_dir / tag)
    elif report_to not in (None, "none"):
        raise ConfigError(
            f"{path} is an exported model dir, which names no training run to record into: pass the run's "
            "checkpoint dir instead, or drop --report_to"
        )
    if export_dir is not None and run is None:
        raise ConfigError(f"{path} is already a model dir: drop --export_dir")
    if apply_chat_template:
        from model_utils.checkpoint.protocol import HF_CONFIG_DIR

        check_chat_template(path if run is None else run.tag_dir / HF_CONFIG_DIR, path)
    with contextlib.ExitStack() as cleanup:
        model_dir = path
        if run is not None:
            from dskit import export

            if export_dir is None:
                scratch = Path(tempfile.mkdtemp(prefix="dskit-eval-"))
                cleanup.callback(shutil.rmtree, scratch, ignore_errors=True)
                model_dir = scratch / "model"
            else:
                model_dir = Path(export_dir)
            export.export(run.tag_dir, model_dir, dtype, on_line=on_line)
            on_line(f"exported {run.tag_dir} to {model_dir} ({dtype})")
        output = _run_lm_eval(model_dir, resolved, dtype, device, batch_size, limit, apply_chat_template)
    metrics = task_metrics(output["results"])
    samples = {task: int(n.get("effective", 0)) for task, n in (output.get("n-samples") or {}).items()}
    for task, values in metrics.items():
        on_line(summary_line(task, values, samples.get(task, 0)))
    recorded: list[str] = []
    if run is not None:
        trackers_of_run = run.report.get("report_to", "none") if report_to is None else report_to
        recorded = run.record(trackers_of_run, tracker_record(metrics))
        if recorded:
            on_line(f"recorded at step {run.step} of run {run.run_id}: {'; '.join(recorded)}")
        elif report_to == "none":
            on_line("not recorded in a tracker (--report_to none)")
        else:
            on_line(f"not recorded in a tracker: run {run.run_id or '?'} trained with --report_to none")
    return EvalResult(
        model=str(model_dir if export_dir is not None or run is None else path),
        checkpoint=str(run.tag_dir) if run is not None else None,
        step=run.step if run is not None else None,
        metrics=metrics,
        samples=samples,
        recorded=recorded,
        seconds=round(time.monotonic() - started, 3),
    )


def _run_lm_eval(
    model_dir: Path,
    resolved: list[str | Path],
    dtype: str,
    device: str | None,
    batch_size: int,
    limit: int | None,
    apply_chat_template: bool = False,
) -> dict[str, Any]:
    import torch

    from model_utils.launch import startup

    startup.transformers_bars_off()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tasks = load_tasks(resolved)
    lm = HFLM(pretrained=str(model_dir.resolve()), device=device, batch_size=batch_size, dtype=DTYPES[dtype])
    output = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, limit=limit, log_samples=False, apply_chat_template=apply_chat_template
    )
    assert output is not None  # None only on the non-zero ranks of a multi-process lm-eval
    return output


# --- the command ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    shipped = ", ".join(shipped_tasks())
    parser = CommandParser(
        prog="dskit eval",
        description="Evaluate a checkpoint or an exported model on downstream tasks with lm-evaluation-harness; a "
        "checkpoint's results go into its training run's trackers.",
    )
    parser.add_argument(
        "model", help="a run's checkpoint dir (its newest verified tag), a tag dir, or a dskit export dir"
    )
    parser.add_argument(
        "--tasks",
        required=True,
        help=f"comma-separated: tasks shipped with dskit ({shipped}), lm-eval task YAML files, or lm-eval task names",
    )
    parser.add_argument(
        "--export_dir", help="export a checkpoint here and keep it (default: a temp dir, removed)"
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="weight dtype (default: bf16)")
    parser.add_argument("--device", help="torch device (default: cuda when there is a GPU, else cpu)")
    parser.add_argument("--batch_size", type=int, default=16, help="items per forward pass (default: 16)")
    parser.add_argument("--limit", type=int, help="evaluate only the first N items of each task")
    parser.add_argument(
        "--report_to",
        help="trackers to record into (default: the training run's own --report_to; none: no tracker)",
    )
    parser.add_argument(
        "--apply_chat_template",
        action="store_true",
        help="prompt the model in its chat template (the one its run trained with, carried by every export)",
    )
    parser.add_argument("--output", metavar="FILE", help="also write the result as JSON to FILE")
    return parser


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    result = evaluate(
        ns.model,
        [name.strip() for name in ns.tasks.split(",") if name.strip()],
        export_dir=ns.export_dir,
        dtype=ns.dtype,
        device=ns.device,
        batch_size=ns.batch_size,
        limit=ns.limit,
        report_to=ns.report_to,
        apply_chat_template=ns.apply_chat_template,
    )
    if ns.output:
        Path(ns.output).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.output).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    print(f"evaluated {len(result.metrics)} task(s) in {result.seconds:.1f} s")
    return 0
