"""Experiment trackers (`--report_to`): TensorBoard event files, an MLflow run, a Weights & Biases run, or several
of them at once, each continued across requeues.

Rank 0 opens the trackers. `open_tracker` also returns a small JSON-able resume state that the trainer keeps in
every checkpoint and hands back after a resume or requeue, so the job continues the same TensorBoard run dir, the
same MLflow run and the same W&B run instead of starting new ones. mlflow and wandb are imported only when they are
selected (seconds each).

W&B runs online with an API key (WANDB_API_KEY or `wandb login`), or offline (WANDB_MODE=offline: a cluster
without internet) into <report_dir>/wandb/, which `wandb sync` uploads later; each attempt of a run is then one
offline dir of the same W&B run id, so the sync continues one run. W&B keeps a run's steps increasing: steps an
interrupted attempt logged after the checkpoint its requeue resumed from keep that attempt's values. What the
user's environment sets of W&B's own settings (WANDB_DIR, WANDB_NAME, WANDB_RUN_ID, WANDB_RESUME,
WANDB_SILENT, WANDB_CONSOLE, WANDB_X_DISABLE_STATS) wins over the kit's choices.

With `--mlflow_parent_run_id` the MLflow run is a child of that run (tag mlflow.parentRunId, in the parent's
experiment), created once and continued like any other. The kit talks to MLflow through `MlflowClient` with
explicit run ids; the environment's MLFLOW_RUN_ID, which makes MLflow's fluent API resume that run instead of
starting (or nesting) one, is checked against the parent and then removed from the ranks' environment.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import socket
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

from model_utils.config.arguments import ReportArgs
from model_utils.errors import ConfigError, first_line
from model_utils.observe import redact, step_line
from model_utils.observe.log import print0, warn0

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

DEFAULT_EXPERIMENT = "dskit"
# MLflow's fluent API resumes the run this names (mlflow run, orchestrators' child processes set it).
MLFLOW_RUN_ID_ENV = "MLFLOW_RUN_ID"
PARENT_TAG = "mlflow.parentRunId"

# The metrics records' keys (docs: metrics JSONL schema) grouped the way TensorBoard and MLflow show them: one
# section per concern. Keys not listed keep their name when it has a group ("a/b"), else go under "train/".
METRIC_NAMES: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "skipped_steps": "train/skipped_steps",
    "val_loss": "val/loss",
    "val_ppl": "val/ppl",
    "val_bpb": "val/bpb",
    "val_s": "val/seconds",
    "val_blocks": "val/blocks",
    "val_total_blocks": "val/total_blocks",
    "val_tokens": "val/tokens",
    "ppl": "train/ppl",
    # Preference objectives' metrics (engines/preference.py), under TRL's names
    "reward_chosen": "train/rewards/chosen",
    "reward_rejected": "train/rewards/rejected",
    "reward_margin": "train/rewards/margins",
    "reward_accuracy": "train/rewards/accuracies",
    "logp_chosen": "train/logps/chosen",
    "logp_rejected": "train/logps/rejected",
    "val_reward_chosen": "val/rewards/chosen",
    "val_reward_rejected": "val/rewards/rejected",
    "val_reward_margin": "val/rewards/margins",
    "val_reward_accuracy": "val/rewards/accuracies",
    "val_logp_chosen": "val/logps/chosen",
    "val_logp_rejected": "val/logps/rejected",
    "val_pairs": "val/pairs",
    "tokens_per_s": "perf/tokens_per_s",
    "tokens_per_s_per_device": "perf/tokens_per_s_per_device",
    "trained_tokens_per_s": "perf/trained_tokens_per_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "data_wait_frac": "perf/data_wait_frac",
    "device_mem_alloc_gib": "memory/device_alloc_gib",
    "device_mem_peak_gib": "memory/device_peak_gib",
    "host_rss_gib": "memory/host_rss_gib",
    "tokens_seen": "progress/tokens_seen",
    "epoch": "progress/epoch",
    "consumed": "progress/consumed",
    "save_s": "checkpoint/save_s",
    "sample_s": "samples/seconds",
    # DeepSpeed's wall-clock breakdown (deepspeed_engine.WALL_CLOCK_TIMERS), ms per optimizer step
    "ds_fwd_ms": "perf/ds_fwd_ms",
    "ds_bwd_ms": "perf/ds_bwd_ms",
    "ds_bwd_inner_ms": "perf/ds_bwd_inner_ms",
    "ds_bwd_allreduce_ms": "perf/ds_bwd_allreduce_ms",
    "ds_step_ms": "perf/ds_step_ms",
}
SAMPLES_TAG = "samples"  # --sample_prompts' texts: TensorBoard's text tag, the W&B table's key


def samples_file(step: int) -> str:
    """The MLflow artifact that holds the samples of `step`."""
    return f"samples/step_{step:08d}.md"


# Record fields that are coordinates, not measurements.
NOT_METRICS = frozenset({"step", "time"})
# Old MLflow servers cap a param value at 500 characters (6000 today); configs rarely need more.
MAX_PARAM_CHARS = 500
HTTP_CONNECT_TIMEOUT_S = 10.0


class Tracker(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float | int | None]) -> None: ...

    def log_artifact(self, path: Path, folder: str) -> None:
        """Keep a file with the run (the profiler trace); trackers without artifacts keep nothing."""
        ...

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        """Generations at `step`, (prompt, text) each, as text the tracker shows."""
        ...

    def close(self) -> None: ...


def samples_markdown(samples: list[tuple[str, str]]) -> str:
    """The samples as a markdown table (TensorBoard's text tab, the MLflow artifact): one row each."""

    def cell(text: str) -> str:
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>") or " "

    rows = [f"| {k} | {cell(prompt)} | {cell(text)} |" for k, (prompt, text) in enumerate(samples, 1)]
    return "\n".join(["| # | prompt | sample |", "|---|---|---|", *rows])


def scalar_items(metrics: dict[str, Any]) -> list[tuple[str, float]]:
    """(tracker name, value) of every finite number in a record; None, NaN, inf and strings are skipped."""
    items = []
    for key, value in metrics.items():
        if key in NOT_METRICS or not isinstance(value, int | float):
            continue
        value = float(value)
        if not math.isfinite(value):
            continue
        name = METRIC_NAMES.get(key, key if "/" in key else f"train/{key}")
        items.append((name, value))
    return items


class NoTracker:
    """`--report_to none`: the metrics file and the log are the only record."""

    def log_metrics(self, step: int, metrics: dict[str, float | int | None]) -> None:
        pass

    def log_artifact(self, path: Path, folder: str) -> None:
        pass

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    def __init__(self, run_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides what an interrupted run logged after its last checkpoint, so the requeued run's
        # steps replace those instead of being drawn over them.
        self.run_dir = run_dir
        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)

    def log_config(self, config: dict[str, Any]) -> None:
        # Indented by 4 spaces: a markdown code block, so TensorBoard's text tab keeps the JSON layout.
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), global_step=0)
        self.writer.flush()

    def log_metrics(self, step: int, metrics: dict[str, float | int | None]) -> None:
        walltime = metrics.get("time")
        for name, value in scalar_items(metrics):
            self.writer.add_scalar(name, value, global_step=step, walltime=walltime)
        # Logging steps are seconds apart; flushing each keeps a preempted or killed job's last points.
        self.writer.flush()

    def log_artifact(self, path: Path, folder: str) -> None:
        pass  # the file stays where it was written, next to the metrics file

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        self.writer.add_text(SAMPLES_TAG, samples_markdown(samples), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    def __init__(self, client: MlflowClient, mlflow_run_id: str) -> None:
        self.client = client
        self.mlflow_run_id = mlflow_run_id
        self.failing = False

    def log_metrics(self, step: int, metrics: dict[str, float | int | None]) -> None:
        from mlflow.entities import Metric

        stamp = metrics.get("time")
        timestamp_ms = int((stamp if isinstance(stamp, int | float) else time.time()) * 1000)
        batch = [Metric(name, value, timestamp_ms, step) for name, value in scalar_items(metrics)]
        if not batch:
            return
        # The run was reachable when it opened; a tracking server that goes away later must not stop training.
        try:
            self.client.log_batch(self.mlflow_run_id, metrics=batch)
        except Exception as err:
            if not self.failing:
                warn0(f"MLflow: logging step {step} failed ({first_line(err)}); training continues")
            self.failing = True
        else:
            self.failing = False

    def log_artifact(self, path: Path, folder: str) -> None:
        # Like the metrics: a store that fails now costs the artifact (the file stays on disk), not the run.
        try:
            self.client.log_artifact(self.mlflow_run_id, str(path), artifact_path=folder)
        except Exception as err:
            warn0(f"MLflow: could not upload {path} ({first_line(err)}); it stays on disk")

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        try:
            self.client.log_text(self.mlflow_run_id, samples_markdown(samples), samples_file(step))
        except Exception as err:  # a store that fails now costs the samples' copy there, not the run
            warn0(f"MLflow: could not keep the samples of step {step} ({first_line(err)})")

    def close(self) -> None:
        try:
            self.client.set_terminated(self.mlflow_run_id, status="FINISHED")
        except Exception as err:
            warn0(f"MLflow: could not mark run {self.mlflow_run_id} finished: {first_line(err)}")


class WandbTracker:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log_metrics(self, step: int, metrics: dict[str, float | int | None]) -> None:
        items = dict(scalar_items(metrics))
        if items:
            self.run.log(items, step=step)

    def log_artifact(self, path: Path, folder: str) -> None:
        try:
            self.run.save(str(path), base_path=str(path.parent), policy="now")
        except Exception as err:
            warn0(f"W&B: could not keep {path} with the run ({first_line(err)}); it stays on disk")

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        import wandb

        try:
            table = wandb.Table(columns=["prompt", "sample"], data=[list(pair) for pair in samples])
            self.run.log({SAMPLES_TAG: table}, step=step)
        except Exception as err:
            warn0(f"W&B: could not log the samples of step {step} ({first_line(err)})")

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception as err:
            warn0(f"W&B: could not finish run {self.run.id}: {first_line(err)}")


class Trackers:
    """Several trackers at once: each gets every call, in --report_to's order."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log_metrics(self, step: int, metrics: dict[str, float | int | None]) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(step, metrics)

    def log_artifact(self, path: Path, folder: str) -> None:
        for tracker in self.trackers:
            tracker.log_artifact(path, folder)

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        for tracker in self.trackers:
            tracker.log_samples(step, samples)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_tracker(
    report_to: str,
    *,
    run_id: str,
    log_dir: Path,
    config: dict[str, Any],
    tracking_uri: str | None,
    resume_state: dict[str, Any] | None,
    resume_step: int | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    parent_run_id: str | None = None,
    wandb_project: str | None = None,
) -> tuple[Tracker, dict[str, Any]]:
    """Open the trackers `report_to` names, continuing the runs in `resume_state` when there are.

    Returns the tracker (several in one) and the resume state to keep in checkpoints: `resume_state` with each
    tracker's entry added, so switching trackers between requeues keeps the others' runs too. `resume_step` is the step the
    job resumed at; TensorBoard then hides what the interrupted job logged after it. `parent_run_id` (MLflow):
    the run is a child of that one, in its experiment.
    """
    names = ReportArgs(report_to=report_to).trackers  # the config's own parsing: one owner
    config = redact.tree(config)  # the params and config text a tracker keeps: no credentials
    state = dict(resume_state or {})
    opened: list[Tracker] = []
    try:
        for name in names:
            previous = state.get(name)
            if name == "tensorboard":
                tracker, state[name] = _open_tensorboard(run_id, log_dir, config, previous, resume_step)
            elif name == "mlflow":
                tracker, state[name] = _open_mlflow(
                    run_id, log_dir, config, tracking_uri, previous, experiment, parent_run_id
                )
            else:
                tracker, state[name] = _open_wandb(run_id, log_dir, config, previous, wandb_project)
            opened.append(tracker)
    except BaseException:
        for tracker in opened:  # one that failed to open ends the run: close the others first
            tracker.close()
        raise
    if not opened:
        return NoTracker(), state
    return (opened[0] if len(opened) == 1 else Trackers(opened)), state


def _open_tensorboard(
    run_id: str,
    log_dir: Path,
    config: dict[str, Any],
    previous: dict[str, Any] | None,
    resume_step: int | None,
) -> tuple[TensorBoardTracker, dict[str, Any]]:
    run_name = previous.get("run", run_id) if previous else run_id
    run_dir = log_dir / "tensorboard" / run_name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot create the TensorBoard dir {run_dir}: {first_line(err)}: choose a writable log dir"
        ) from err
    purge_step = resume_step + 1 if previous and resume_step is not None else None
    tracker = TensorBoardTracker(run_dir, purge_step)
    if previous is None:
        tracker.log_config(config)
    return tracker, {"run": run_name}


def _quiet_mlflow() -> None:
    # MLflow logs every table migration and store detail at INFO; the training log should show training.
    for name in ("mlflow", "alembic", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)


def default_tracking_uri(log_dir: Path) -> str:
    """A local SQLite store: MLflow 3 refuses the plain file store and recommends this."""
    return f"sqlite:///{(log_dir / 'mlflow.db').resolve()}"


def check_reachable(uri: str) -> None:
    """Fail in seconds, not after MLflow's ~4 minutes of retries, when a tracking server is not listening."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=HTTP_CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ConfigError(
            f"MLflow tracking server {redact.uri(uri)} is not reachable ({first_line(err)}): start it, fix --tracking_uri, "
            "or leave it unset for a local store under the log dir"
        ) from err


def take_env_run_id(parent_run_id: str | None) -> None:
    """Every rank, before training with MLflow: MLFLOW_RUN_ID agrees with --mlflow_parent_run_id, then goes.

    Set, it makes MLflow's fluent API log into that run instead of starting or nesting one. The kit's own
    client ignores it, so the only safe reading is the one `mlflow run` and orchestrators mean: the run that
    launched this job, i.e. the parent. Equal to the parent it is fine, different it is an error, without a
    parent it is ignored with a warning; either way it is removed so no library in a rank resumes that run.
    """
    env_run = os.environ.get(MLFLOW_RUN_ID_ENV, "").strip()
    if not env_run:
        os.environ.pop(MLFLOW_RUN_ID_ENV, None)  # set but empty: nothing to resume, nothing to say
        return
    if parent_run_id is not None and env_run != parent_run_id:
        raise ConfigError(
            f"MLFLOW_RUN_ID={env_run} is set and --mlflow_parent_run_id is {parent_run_id}: MLflow would log into "
            "that run instead of a child of the parent: unset MLFLOW_RUN_ID or pass it as the parent"
        )
    if parent_run_id is None:
        warn0(
            f"MLFLOW_RUN_ID={env_run} is ignored: dskit logs to its own MLflow run; pass "
            f"--mlflow_parent_run_id {env_run} to make that run its parent"
        )
    del os.environ[MLFLOW_RUN_ID_ENV]


def check_parent_run(tracking_uri: str | None, log_dir: Path, parent_run_id: str) -> None:
    """Fail before training, in one line, when the tracking store has no such parent run (rank 0, once)."""
    uri = tracking_uri or default_tracking_uri(log_dir)
    if tracking_uri is None and not (log_dir / "mlflow.db").is_file():
        raise ConfigError(
            f"--mlflow_parent_run_id {parent_run_id}: there is no MLflow store at {uri} to hold it: set "
            "--tracking_uri to the parent's store or --report_dir to the log dir that has it"
        )
    check_reachable(uri)
    _quiet_mlflow()
    from mlflow.tracking import MlflowClient

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            _parent_run(MlflowClient(tracking_uri=uri), parent_run_id, uri)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"cannot open MLflow tracking URI {redact.uri(uri)}: {first_line(err)}: fix --tracking_uri"
        ) from err


def _parent_run(client: MlflowClient, parent_run_id: str, uri: str) -> Any:
    """The parent run, or a ConfigError naming the fix when this store does not have it (live)."""
    from mlflow.exceptions import MlflowException

    try:
        parent = client.get_run(parent_run_id)
    except MlflowException as err:
        if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        raise ConfigError(
            f"--mlflow_parent_run_id {parent_run_id}: no such run in {redact.uri(uri)}: copy the id from the "
            "parent's run page, or point --tracking_uri at the store that has it"
        ) from err
    if parent.info.lifecycle_stage == "deleted":
        raise ConfigError(
            f"--mlflow_parent_run_id {parent_run_id} is a deleted run: restore it (mlflow runs restore) or choose "
            "another parent"
        )
    return parent


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b": "value"} with keys and values MLflow accepts."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = re.sub(r"[^\w.\-/ :]", "_", f"{prefix}{key}")
        if isinstance(value, dict) and value:
            params.update(flatten_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MAX_PARAM_CHARS:
            text = text[: MAX_PARAM_CHARS - 3] + "..."
        params[name[:250]] = text
    return params


def _log_params(client: MlflowClient, mlflow_run_id: str, config: dict[str, Any]) -> None:
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

    params = [Param(key, value) for key, value in flatten_params(config).items()]
    for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(mlflow_run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH])


def _experiment_id(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            raise ConfigError(
                f"MLflow experiment {name!r} is deleted in this store: restore it (mlflow experiments restore) "
                "or choose another experiment name"
            )
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:
        # Another job created it between the lookup and here.
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _reopen(
    client: MlflowClient, previous: dict[str, Any], uri: str, parent_run_id: str | None
) -> str | None:
    """The previous MLflow run's id when this store still has it, under the same parent, else None (with the
    reason logged)."""
    from mlflow.exceptions import MlflowException

    if previous.get("parent_run_id") != parent_run_id:
        was = previous.get("parent_run_id") or "no parent"
        warn0(
            f"MLflow: run {previous.get('run_id')} was under {was}, the parent is now {parent_run_id or 'none'}: "
            "starting a new run"
        )
        return None
    if previous.get("tracking_uri") != redact.uri(uri):
        warn0(
            f"MLflow: the run was tracked at {previous.get('tracking_uri')}, now at {redact.uri(uri)}: "
            "starting a new run"
        )
        return None
    try:
        run = client.get_run(previous["run_id"])
    except MlflowException as err:
        warn0(
            f"MLflow: run {previous['run_id']} not found in {redact.uri(uri)} ({first_line(err)}): "
            "starting a new run"
        )
        return None
    if run.info.lifecycle_stage == "deleted":
        warn0(f"MLflow: run {previous['run_id']} was deleted: starting a new run")
        return None
    client.update_run(run.info.run_id, status="RUNNING")
    return run.info.run_id


def _open_mlflow(
    run_id: str,
    log_dir: Path,
    config: dict[str, Any],
    tracking_uri: str | None,
    previous: dict[str, Any] | None,
    experiment: str,
    parent_run_id: str | None,
) -> tuple[MlflowTracker, dict[str, Any]]:
    uri = tracking_uri or default_tracking_uri(log_dir)
    check_reachable(uri)
    from mlflow.tracking import MlflowClient

    _quiet_mlflow()
    # Artifacts of a local store stay under the log dir (MLflow's default is ./mlruns in the working dir).
    artifact_location = None if tracking_uri else (log_dir / "mlflow-artifacts").resolve().as_uri()
    try:
        with warnings.catch_warnings():
            # SQLAlchemy deprecations inside MLflow's store are MLflow's business, not the training log's.
            warnings.simplefilter("ignore", DeprecationWarning)
            client = MlflowClient(tracking_uri=uri)
            mlflow_run_id = _reopen(client, previous, uri, parent_run_id) if previous else None
            if mlflow_run_id is not None:
                experiment = previous.get("experiment", experiment) if previous else experiment
            else:
                tags = {"dskit.run_id": run_id}
                if parent_run_id is None:
                    experiment_id = _experiment_id(client, experiment, artifact_location)
                else:
                    # A child lives in its parent's experiment: MLflow's UI nests runs within one experiment.
                    experiment_id = _parent_run(client, parent_run_id, uri).info.experiment_id
                    experiment = client.get_experiment(experiment_id).name
                    tags[PARENT_TAG] = parent_run_id
                run = client.create_run(experiment_id, run_name=run_id, tags=tags)
                mlflow_run_id = run.info.run_id
                _log_params(client, mlflow_run_id, config)
    except ConfigError:
        raise
    except Exception as err:  # the store's own errors: unsupported scheme, file store, unwritable path, SQL
        raise ConfigError(
            f"cannot open MLflow tracking URI {redact.uri(uri)}: {first_line(err)}: use sqlite:///ABS/PATH/mlflow.db or an "
            "http(s):// tracking server, or leave --tracking_uri unset for a local store under the log dir"
        ) from err
    state = {"run_id": mlflow_run_id, "tracking_uri": redact.uri(uri), "experiment": experiment}
    if parent_run_id is not None:
        state["parent_run_id"] = parent_run_id
    print0(step_line.mlflow_line(mlflow_run_id, experiment, redact.uri(uri), parent_run_id))
    return MlflowTracker(client, mlflow_run_id), state


WANDB_DEFAULT_PROJECT = "dskit"
# The log is the kit's, and no sampler; each is W&B's setting WANDB_<NAME>, which the user may set instead.
_WANDB_QUIET = {"silent": True, "console": "off", "x_disable_stats": True}


def _wandb_env(name: str) -> str:
    """The user's W&B setting `name` from the environment, "" when unset: it wins over the kit's choice."""
    return os.environ.get(name, "").strip()


def _wandb_mode() -> str:
    mode = _wandb_env("WANDB_MODE") or "online"
    if mode == "dryrun":  # W&B's old name for offline
        return "offline"
    if mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"WANDB_MODE={mode!r}: use online, offline or disabled")
    return mode


def _wandb_api_key_known() -> bool:
    """Whether W&B has a key without asking (it would prompt on a terminal, or fail after retries)."""
    if os.environ.get("WANDB_API_KEY", "").strip():
        return True
    import netrc

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _open_wandb(
    run_id: str,
    log_dir: Path,
    config: dict[str, Any],
    previous: dict[str, Any] | None,
    project: str | None,
) -> tuple[WandbTracker, dict[str, Any]]:
    mode = _wandb_mode()
    if mode == "online" and not _wandb_api_key_known():
        raise ConfigError(
            "--report_to wandb: no W&B API key: run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline "
            "to log into the log dir and `wandb sync` it later"
        )
    project = (
        (previous or {}).get("project") or project or _wandb_env("WANDB_PROJECT") or WANDB_DEFAULT_PROJECT
    )
    root = Path(_wandb_env("WANDB_DIR") or log_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the dir {root} for W&B: {first_line(err)}") from err
    import wandb

    # WANDB_RUN_ID (a sweep agent's, or the user's) names the run each attempt continues; ours: 8 of [a-z0-9].
    wandb_id = _wandb_env("WANDB_RUN_ID") or (previous or {}).get("run_id") or secrets.token_hex(4)
    try:
        run = wandb.init(
            project=project,
            name=_wandb_env("WANDB_NAME") or run_id,
            id=wandb_id,
            resume=None if _wandb_env("WANDB_RESUME") else "allow",  # allow: a requeue continues the run
            dir=str(root),
            config=None if previous else config,
            mode=mode,
            settings=wandb.Settings(
                **{k: v for k, v in _WANDB_QUIET.items() if not _wandb_env(f"WANDB_{k.upper()}")}
            ),
        )
    except Exception as err:
        raise ConfigError(
            f"W&B: cannot start run {wandb_id} in project {project} ({mode}): {first_line(err)}: check the key and "
            "network, or set WANDB_MODE=offline"
        ) from err
    offline_dir = run.settings.wandb_dir  # under WANDB_DIR or the log dir
    where = f"offline in {offline_dir} (upload: wandb sync {offline_dir})" if mode == "offline" else mode
    print0(f"W&B: run {wandb_id} in project {project}, {'continued' if previous else 'new'}, {where}")
    return WandbTracker(run), {"run_id": wandb_id, "project": project}
