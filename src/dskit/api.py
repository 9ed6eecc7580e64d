"""The kit as one call from Python: a pipeline node (Kedro, Airflow, a notebook) runs a whole distributed
training and gets back a small, serialisable result.

    from dskit import api
    result = api.train("configs/pretrain-default.yaml", flags=["--max_steps", "20"])
    result.final_step, result.validation_loss, result.checkpoint      # result.to_dict() is JSON
    scores = api.evaluate(result.checkpoint, ["dskit_tiny_mc"])       # lm-eval, into the run's trackers
    scores.metrics["dskit_tiny_mc"]["acc"]                            # scores.to_dict() is JSON

It runs the launcher once as a subprocess, as a person would (`./train-singlenode.sh [NODE]`, or `sbatch
train.sbatch` with `slurm=True`, then waits for the job), streams its log line by line to `on_line`, and reads
the result from the run's summary (a JSON file the run writes where DSKIT_RUN_SUMMARY names: observe/
run_summary.py), never from the log's text: the last step, the last train and validation losses, the newest
checkpoint, the metrics file, the MLflow run. A failed run raises `TrainingFailed` with the kit's own one-line
message (the one the launcher or a rank wrote where DSKIT_ERROR_FILE names). Nothing of the
training runtime is imported into the calling process: the orchestrator keeps its own imports and its own
MLflow run (pass its id as `mlflow_parent_run_id`, and the training logs into a child of it). With
`--validation_only true` among the flags the run measures a model without training it: `validation_loss`, and
`final_step` the step of the model measured (docs/evaluation.md).

`evaluate` runs `dskit eval` the same way (a subprocess: lm-eval and torch stay out of the caller) and returns
its `EvalResult`; a checkpoint's results land in the training run's trackers (its MLflow child run, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dskit.eval import EvalResult
from model_utils import launch_env
from model_utils.observe import run_summary, step_line
from model_utils.repo import REPO_ROOT

_SUBMITTED = re.compile(r"^(\d+)(?:;\S+)?$")
# Job states in which a job may still run (a requeued one comes back): sbatch --wait waits through them too.
_ACTIVE = {
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
    "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "SPECIAL_EXIT", "RESV_DEL_HOLD",
}  # fmt: skip
POLL_SECONDS = 2.0


class TrainingFailed(RuntimeError):
    """The run ended with a non-zero status; the message is the kit's one-line error, or where to look."""


class EvaluationFailed(RuntimeError):
    """`dskit eval` ended with a non-zero status; the message is its one-line error, or its last lines."""


@dataclass(frozen=True)
class TrainResult:
    final_step: int | None
    max_steps: int | None
    train_loss: float | None
    validation_loss: float | None
    checkpoint: str | None  # the newest checkpoint the run saved
    metrics_file: str | None
    run_id: str | None  # the kit's run name (metrics file, TensorBoard run)
    mlflow_run_id: str | None
    exported: str | None  # the Hugging Face model dir written by `dskit export`, when asked
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _command(
    config: str | os.PathLike[str] | None,
    flags: Sequence[str],
    node: str | None,
    slurm: Sequence[str] | None,
    mlflow_parent_run_id: str | None,
    repo: Path,
) -> list[str]:
    args = [*(["--config", str(config)] if config is not None else []), *flags]
    if mlflow_parent_run_id is not None:
        args += ["--report_to", "mlflow", "--mlflow_parent_run_id", mlflow_parent_run_id]
    if slurm is not None:
        return ["sbatch", "--parsable", *slurm, *args]
    return [str(repo / "train-singlenode.sh"), *([node] if node else []), *args]


def _follow(path: Path, running: Callable[[], bool]) -> Iterator[str]:
    """Lines of a log file another process writes, until it stops (and the file has no more)."""
    while not path.exists() and running():
        time.sleep(0.5)
    if not path.exists():
        return
    with path.open(errors="replace") as f:
        while True:
            line = f.readline()
            if line:
                yield line.rstrip("\n")
            elif running():
                time.sleep(0.5)
            else:
                rest = f.read()
                yield from rest.splitlines()
                return


class _SlurmJob:
    """A submitted job, watched with `scontrol show job` every POLL_SECONDS until it ends. Not `sbatch --wait`:
    that polls at 2, 10, 42, 74 ... s, so a short job's caller would wait up to half a minute past its end."""

    def __init__(self, job_id: str) -> None:
        self.id = job_id
        self.state: str | None = "PENDING"
        self.exit_code = 0
        self.log: Path | None = None
        self._polled = 0.0
        self._poll()

    def _poll(self) -> None:
        self._polled = time.monotonic()
        shown = subprocess.run(["scontrol", "-o", "show", "job", self.id], capture_output=True, text=True)
        fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        if "JobState" not in fields:
            # Gone from the controller (MinJobAge): the run summary tells how it ended. Else the controller
            # was busy: asked again at the next poll.
            if "Invalid job id" in shown.stderr:
                self.state = None
            return
        self.state = fields["JobState"]
        self.exit_code = int(fields.get("ExitCode", "0:0").split(":")[0])
        if self.log is None and fields.get("StdOut"):
            self.log = Path(fields["StdOut"])

    def running(self) -> bool:
        if self.state not in _ACTIVE:
            return False
        if time.monotonic() - self._polled >= POLL_SECONDS:
            self._poll()
        return self.state in _ACTIVE

    def wait(self) -> None:
        while self.running():
            time.sleep(POLL_SECONDS / 4)

    def status(self, summary: dict[str, Any]) -> int:
        """The job's exit status, as `sbatch --wait` returns it; of a job SLURM has forgotten, the one its end
        wrote into the run summary (dskit/launcher/requeue.py), else 1."""
        if self.state is None:
            status = summary.get("exit_status")
            return status if isinstance(status, int) else 1
        if self.state == "COMPLETED":
            return 0
        return self.exit_code or 1


def _slurm_lines(
    command: list[str], root: Path, env: dict[str, str], summary: Path, status: list[int]
) -> Iterator[str]:
    """Submit (sbatch --parsable prints the job id), follow the job's log until the job ends; its exit status
    goes into `status`. A job that ended other than COMPLETED adds a last line naming its state."""
    submitted = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    match = _SUBMITTED.match(submitted.stdout.strip())
    if submitted.returncode != 0 or match is None:  # sbatch refused the job: its own message
        yield from (submitted.stdout + submitted.stderr).splitlines()
        status.append(submitted.returncode or 1)
        return
    job = _SlurmJob(match.group(1))
    if job.log is not None:
        yield from _follow(job.log, job.running)
    job.wait()
    status.append(job.status(run_summary.read(summary)))
    if job.state not in (None, "COMPLETED"):
        yield f"SLURM job {job.id} ended {job.state} (exit code {job.exit_code})"


def _result(summary: dict[str, Any], seconds: float) -> TrainResult:
    """The run summary's values (observe/run_summary.py); paths in it are absolute."""
    # A finished run's last step, or the step of the model a --validation_only run validated; else the last logged.
    finished = summary.get("end") in ("done", step_line.VALIDATED)
    return TrainResult(
        final_step=summary.get("end_step") if finished else summary.get("step"),
        max_steps=summary.get("max_steps"),
        train_loss=summary.get("train_loss"),
        validation_loss=summary.get("validation_loss"),
        checkpoint=summary.get("checkpoint"),
        metrics_file=summary.get("metrics_file"),  # None: --metrics_file none
        run_id=summary.get("run_id"),
        mlflow_run_id=summary.get("mlflow_run_id"),
        exported=None,
        seconds=seconds,
    )


def _error(error_file: Path, lines: list[str], status: int, what: str = "training") -> str:
    """The message of the kit's error line (DSKIT_ERROR_FILE); a crash without one: the status and the last lines."""
    try:
        message = error_file.read_text().strip()
    except OSError:
        message = ""
    if message:
        return message
    tail = " | ".join(lines[-3:]) if lines else "no output"
    return f"{what} exited with status {status}: {tail}"


def train(
    config: str | os.PathLike[str] | None = None,
    *,
    flags: Sequence[str] = (),
    node: str | None = None,
    slurm: bool = False,
    sbatch_args: Sequence[str] = (),
    sbatch_script: str | os.PathLike[str] | None = None,
    export_dir: str | os.PathLike[str] | None = None,
    mlflow_parent_run_id: str | None = None,
    on_line: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
    repo: str | os.PathLike[str] = REPO_ROOT,
) -> TrainResult:
    """Run one training with the kit's launcher and return what it produced.

    `config`: a run file (--config); `flags`: training flags after it (they override it); `node`: a SLURM node
    for `train-singlenode.sh NODE`; `slurm`: submit train.sbatch and wait for it; `export_dir`: also write the
    final checkpoint as a Hugging Face model there; `mlflow_parent_run_id`: log into a child of this MLflow run;
    `on_line`: called with each log line as it comes (None: quiet); `env`: extra environment for the launcher;
    `sbatch_args`, `sbatch_script`: with `slurm`, sbatch options and the script (default: the repo's
    train.sbatch, submitted from the repo as it must be).
    """
    root = Path(repo)
    submit = None
    if slurm:
        submit = [*sbatch_args, str(sbatch_script if sbatch_script is not None else root / "train.sbatch")]
    command = _command(config, flags, node, submit, mlflow_parent_run_id, root)
    # The run's summary and error message, in the repo (on a cluster, where every node writes: it is shared).
    (root / ".cache").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dskit-api-", dir=root / ".cache") as scratch:
        summary, error_file = Path(scratch) / "summary.json", Path(scratch) / "error"
        child_env = {
            **os.environ,
            **(env or {}),
            launch_env.RUN_SUMMARY: str(summary),
            launch_env.ERROR_FILE: str(error_file),
        }
        # The orchestrator's own MLflow run must not leak into the ranks: MLflow would resume it, not nest under it.
        child_env.pop("MLFLOW_RUN_ID", None)
        started = time.monotonic()
        if slurm:
            ended: list[int] = []
            lines = _taken(_slurm_lines(command, root, child_env, summary, ended), on_line)
            status = ended[0]
        else:
            status, lines = _run(command, root, child_env, on_line)
        if status != 0:
            raise TrainingFailed(_error(error_file, lines, status))
        result = _result(run_summary.read(summary), time.monotonic() - started)
        if export_dir is None:
            return result
        if result.checkpoint is None:
            raise TrainingFailed(
                "the run saved no checkpoint to export: set --checkpoint_freq or --max_steps"
            )
        export = [sys.executable, "-m", "dskit.cli", "export", result.checkpoint, str(export_dir)]
        status, lines = _run(export, root, child_env, None)
        if status != 0:
            raise TrainingFailed(_error(error_file, lines, status, "dskit export"))
        return dataclasses.replace(result, exported=str(export_dir))


def _taken(stream: Iterator[str], on_line: Callable[[str], None] | None) -> list[str]:
    """The lines of `stream`, each passed to `on_line` as it comes."""
    lines = []
    for line in stream:
        lines.append(line)
        if on_line is not None:
            on_line(line)
    return lines


def _run(
    command: list[str], root: Path, env: dict[str, str], on_line: Callable[[str], None] | None
) -> tuple[int, list[str]]:
    """A command's exit status and output lines (stdout and stderr as they interleave), streamed to `on_line`."""
    proc = subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    try:
        lines = _taken((line.rstrip("\n") for line in proc.stdout), on_line)
    finally:
        status = proc.wait()
    return status, lines


def evaluate(
    model: str | os.PathLike[str],
    tasks: Sequence[str],
    *,
    flags: Sequence[str] = (),
    on_line: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
    repo: str | os.PathLike[str] = REPO_ROOT,
) -> EvalResult:
    """`dskit eval MODEL --tasks TASKS [FLAGS]` and its result: `model` a checkpoint dir (its newest verified tag),
    a tag dir (e.g. TrainResult.checkpoint) or an exported model dir; `tasks` shipped task names, lm-eval task
    YAML files or lm-eval task names; `flags` dskit eval's others (--limit, --batch_size, --report_to, ...).
    Each output line goes to `on_line` as it comes; a failure raises EvaluationFailed with the one-line error."""
    with tempfile.TemporaryDirectory(prefix="dskit-api-eval-") as scratch:
        output, error_file = Path(scratch) / "result.json", Path(scratch) / "error"
        command = [sys.executable, "-m", "dskit.cli", "eval", str(model), "--tasks", ",".join(tasks), *flags]
        command += ["--output", str(output)]
        child_env = {**os.environ, **(env or {}), launch_env.ERROR_FILE: str(error_file)}
        status, lines = _run(command, Path(repo), child_env, on_line)
        if status != 0:
            raise EvaluationFailed(_error(error_file, lines, status, "dskit eval"))
        return EvalResult.from_dict(json.loads(output.read_text()))
