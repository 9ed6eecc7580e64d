"""The real Trainer in this process (one gloo rank, DeepSpeed ZeRO-2 with CPU Adam): one shared run that stops
for the job's time limit at step 5 and is resumed to step 8 (a requeue), asserted feature by feature: the
walltime reaction, the progress bar, the metrics records, the continued metrics file and TensorBoard run, and
`dskit plot` of the result.

The walltime *decisions* are scripted here (their arithmetic is tested in test_walltime.py); what is tested is
what the loop does with them: an early save that keeps training, and a save-and-stop that a requeue resumes.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import pty
import select
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from model_utils import launch_env
from model_utils.config.arguments import parse_args
from model_utils.data.step_batches import StepBatches
from model_utils.launch.walltime import Decision, WalltimePlanner
from model_utils.loop import trainer as training
from model_utils.loop.observers.reporting import Reporting
from model_utils.loop.observers.walltime import Walltime
from model_utils.observe import log as rank_log
from model_utils.resolve import resolver
from support.observers import find
from support.wandb_offline import offline_runs

pytestmark = pytest.mark.e2e


class ScriptedPlanner(WalltimePlanner):
    def __init__(self, max_steps: int, script: dict[int, Decision]) -> None:
        super().__init__(end_time_source=lambda: None)
        self.max_steps, self.script = max_steps, script

    def decide(self, step: int, step_time: float, next_checkpoint_step: int) -> Decision:
        assert step_time > 0 and step < next_checkpoint_step <= self.max_steps
        return self.script.get(step, Decision())


def make_trainer(tmp_path: Path, dist, max_steps: int, *extra: str) -> training.Trainer:
    cfg = parse_args(
        [
            "--max_steps", str(max_steps), "--logging_freq", "2", "--checkpoint_freq", "100",
            "--validation_freq", "4", "--validation_batches", "2", "--seq_length", "64",
            "--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ckpt"),
            "--report_dir", str(tmp_path / "logs"), "--report_to", "tensorboard", *extra,
        ]
    )  # fmt: skip
    return training.Trainer(resolver.prepare(cfg, world_size=dist.world_size), dist)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _read_ready(fd: int, timeout_s: float = 10.0) -> str:
    """What was written to the terminal `fd`; empty (never blocking) when nothing was."""
    ready, _, _ = select.select([fd], [], [], timeout_s)
    return os.read(fd, 1 << 16).decode() if ready else ""


@dataclass(frozen=True)
class Requeued:
    tmp: Path
    log: Path  # what the launcher's tee would have written
    first_out: str  # rank 0's stdout of the first job
    bar: str  # what reached the terminal named in DSKIT_TTY
    first_state: training.TrainState
    resumed_state: training.TrainState  # the second job's state right after it resumed
    flops_per_token: float
    overhead_s: float
    first: list[dict]  # the metrics records of the first job
    second: list[dict]  # ... and of the requeued one


def _job_exits() -> None:
    """What a job's exit does for W&B: its service flushes the offline run and stops (its atexit hook; both jobs
    run in this one process here). Without it the requeued job's history was once missing from its offline
    file when read under a loaded suite."""
    import wandb

    wandb.teardown()


@pytest.fixture(scope="module")
def requeued(tmp_path_factory: pytest.TempPathFactory, single_rank) -> Requeued:
    tmp = tmp_path_factory.mktemp("trainer")
    log = tmp / "logs" / "job_123.out"
    primary, replica = pty.openpty()
    with pytest.MonkeyPatch.context() as mp:
        # The bar opens its terminal once per process (a rank's life); an in-process Trainer of an earlier test
        # opened it with no terminal named, so this job gets the fresh bar a new rank would have.
        mp.setattr(rank_log, "_bar", rank_log._ProgressBar())
        mp.setenv(launch_env.LOG_FILE, str(log))
        mp.setenv(launch_env.STOP_REASON_FILE, str(tmp / "stop_reason"))
        mp.setenv(launch_env.TTY, os.ttyname(replica))
        # W&B beside TensorBoard, offline as on a cluster without internet (its settings kept under tmp).
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_CONFIG_DIR", str(tmp / "wandb-config"))
        mp.setenv("WANDB_CACHE_DIR", str(tmp / "wandb-cache"))
        first_out = io.StringIO()
        with contextlib.redirect_stdout(first_out):
            trainer = make_trainer(tmp, single_rank, 8, "--report_to", "tensorboard,wandb")
            find(trainer, Walltime).planner = ScriptedPlanner(
                8, {3: Decision(save_now=True), 5: Decision(stop_now=True)}
            )
            try:
                first_state = trainer.fit()
            finally:
                trainer.close()
                _job_exits()
        bar = _read_ready(primary)
        metrics_file = log.with_suffix(".metrics.jsonl")  # next to the launcher's log
        first = records(metrics_file)
        # The requeued job: same checkpoint dir, same log; it resumes at step 5 and continues run and file.
        second_out = io.StringIO()
        with contextlib.redirect_stdout(second_out):
            again = make_trainer(tmp, single_rank, 8, "--report_to", "tensorboard,wandb")
            resumed_state = training.TrainState.from_dict(again.state.to_dict())
            try:
                again.fit()
            finally:
                again.close()
                _job_exits()
    log.write_text(first_out.getvalue() + second_out.getvalue())
    return Requeued(
        tmp=tmp,
        log=log,
        first_out=first_out.getvalue(),
        bar=bar,
        first_state=first_state,
        resumed_state=resumed_state,
        flops_per_token=find(trainer, Reporting).reporter.flops_per_token,
        overhead_s=find(trainer, Reporting).reporter.overhead_s,
        first=first,
        second=records(metrics_file)[len(first) :],
    )


def test_walltime_saves_early_then_stops_and_says_why(requeued: Requeued) -> None:
    assert requeued.first_state.step == 5
    assert (requeued.tmp / "stop_reason").read_text() == "walltime\n"
    assert sorted(p.name for p in (requeued.tmp / "ckpt").glob("tiny_qwen3-*"))[:2] == [
        "tiny_qwen3-3steps",
        "tiny_qwen3-5steps",
    ]
    out = requeued.first_out
    assert "Saving early at step 3" in out and "Stopped at step 5 before the job's time limit" in out
    events = [(r["event"], r["step"]) for r in requeued.first if "event" in r]
    assert events == [("start", 0), ("checkpoint", 3), ("checkpoint", 5), ("end", 5)]
    assert requeued.first[-1]["reason"] == "walltime"


def test_progress_bar_goes_to_the_terminal_never_into_the_log(requeued: Requeued) -> None:
    assert "] 1/8 (12%) loss" in requeued.bar and "ETA" in requeued.bar
    assert "[###" not in requeued.log.read_text() and "] 1/8" not in requeued.log.read_text()


def test_metrics_records_of_the_logged_steps(requeued: Requeued) -> None:
    train = [r for r in requeued.first if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_device"])  # one rank
        # The plain stream trains every token but each block's first: 63 of 64.
        assert r["trained_tokens_per_s"] == pytest.approx(r["tokens_per_s"] * 63 / 64)
        assert r["tflops_per_device"] == pytest.approx(
            r["tokens_per_s_per_device"] * requeued.flops_per_token / 1e12
        )
        assert r["mfu"] is None and r["device_mem_alloc_gib"] is None  # CPU: no known peak, no device memory
        assert 0 < r["data_wait_frac"] < 1 and r["host_rss_gib"] > 0.1 and r["step_time_s"] > 0
        assert r["skipped_steps"] == 0 and r["lr"] > 0 and r["grad_norm"] > 0
        assert r["tokens_seen"] == r["step"] * 64  # 1 rank x micro batch 1 x accumulation 1 x 64 tokens
        assert r["ppl"] == pytest.approx(math.exp(r["loss"]))
        assert "ds_fwd_ms" not in r  # DeepSpeed's wall_clock_breakdown is off in the kit's config
    assert [r["step"] for r in requeued.first if "val_loss" in r] == [4]
    assert "Metrics overhead:" in requeued.first_out and requeued.overhead_s > 0


def test_the_log_line_is_the_record_rendered(requeued: Requeued) -> None:
    from model_utils.observe import step_line

    log = requeued.log.read_text()
    for record in (r for r in requeued.first if "loss" in r):
        shown = step_line.step_line(record, 8).rpartition(" | ETA")[0]  # the ETA's job time left aside
        assert f"| {shown} | ETA " in log, (shown, log)


def test_requeue_resumes_and_continues_the_run_and_its_metrics_file(requeued: Requeued) -> None:
    assert requeued.resumed_state.step == 5 and requeued.resumed_state.run_id == requeued.first_state.run_id
    start = requeued.second[0]
    assert start["event"] == "start" and start["resumed_from"] == "tiny_qwen3-5steps"
    assert start["run_id"] == requeued.first_state.run_id
    assert [r["step"] for r in requeued.second if "loss" in r] == [6, 8]
    assert requeued.second[-1] == {**requeued.second[-1], "event": "end", "reason": "done", "step": 8}


def test_the_requeue_continues_the_same_wandb_run_with_the_same_metrics(requeued: Requeued) -> None:
    """`WANDB_MODE=offline` and `--report_to tensorboard,wandb` (the fixture's jobs), read back from W&B's files."""
    first, second = offline_runs(requeued.tmp / "logs")  # one offline dir per job, one W&B run: `wandb sync`
    assert first.run_id == second.run_id and first.name == requeued.first_state.run_id
    assert sorted(first.history) == [2, 4] and sorted(second.history) == [6, 8]
    for record, logged in [(r, first.history) for r in requeued.first if "loss" in r] + [
        (r, second.history) for r in requeued.second if "loss" in r
    ]:
        assert logged[record["step"]]["train/loss"] == pytest.approx(record["loss"])
    assert first.history[4]["val/loss"] == next(r["val_loss"] for r in requeued.first if "val_loss" in r)
    assert first.config["loop"]["max_steps"] == 8
    assert f"W&B: run {first.run_id} in project dskit, continued, offline" in requeued.log.read_text()


def test_plot_of_the_real_run_marks_the_resume(requeued: Requeued) -> None:
    from PIL import Image

    from dskit import cli, plot

    assert cli.main(["plot", str(requeued.log)]) == 0  # the log: its metrics file is read
    with Image.open(requeued.log.with_suffix(".png")) as image:
        assert image.format == "PNG" and image.size[0] >= 800
    plotted = plot.load_run(requeued.log)
    assert plotted.resumes == (5,) and plotted.run_id == requeued.first_state.run_id
    assert plotted.series["loss"].steps == (2, 4, 6, 8)
    # The log alone (no metrics file next to it): tools never read the log's text.
    bare = requeued.tmp / "bare.out"
    bare.write_text(requeued.log.read_text())
    assert cli.main(["plot", str(bare)]) == 2


def test_tensorboard_run_is_continued(requeued: Requeued) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((requeued.tmp / "logs" / "tensorboard").iterdir())
    assert [p.name for p in runs] == [requeued.first_state.run_id]  # one run, continued
    events = EventAccumulator(str(runs[0])).Reload()
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(losses) == [2, 4, 6, 8]
    first_loss = next(r["loss"] for r in requeued.first if "loss" in r)
    assert losses[2] == pytest.approx(first_loss)


def test_dskit_eval_of_the_final_checkpoint_lands_in_its_tensorboard_run(
    requeued: Requeued, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dskit eval CHECKPOINT_DIR` (lm-eval on the shipped task, offline): the newest tag exported and evaluated,
    the results in the run's own TensorBoard run at the tag's step. --report_to tensorboard leaves out the run's
    W&B (test_the_requeue_continues_the_same_wandb_run_with_the_same_metrics counts its attempts)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dskit import cli
    from dskit.eval import EvalResult

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = requeued.tmp / "eval.json"
    argv = ["eval", str(requeued.tmp / "ckpt"), "--tasks", "dskit_tiny_mc", "--report_to", "tensorboard"]
    assert cli.main([*argv, "--output", str(out)]) == 0
    result = EvalResult.from_dict(json.loads(out.read_text()))
    run_dir = requeued.tmp / "logs" / "tensorboard" / requeued.first_state.run_id
    assert result.step == 8 and result.checkpoint == str(requeued.tmp / "ckpt" / "tiny_qwen3-8steps")
    assert result.recorded == [f"tensorboard {run_dir}"] and result.samples == {"dskit_tiny_mc": 40}
    assert [p.name for p in (requeued.tmp / "logs" / "tensorboard").iterdir()] == [run_dir.name]
    events = EventAccumulator(str(run_dir)).Reload()
    for metric in ("acc", "acc_norm"):
        (logged,) = events.Scalars(f"eval/dskit_tiny_mc/{metric}")
        assert logged.step == 8 and logged.value == pytest.approx(result.metrics["dskit_tiny_mc"][metric])
    assert f"recorded at step 8 of run {requeued.first_state.run_id}: tensorboard" in capsys.readouterr().out
    assert not list(Path(tempfile.gettempdir()).glob("dskit-eval-*"))  # the temporary export is gone


@dataclass(frozen=True)
class NestedRun:
    tmp: Path
    parent: str  # the MLflow run the job was a child of
    experiment_id: str
    first_state: training.TrainState
    second_state: training.TrainState
    first_tracker: dict  # the tracker's ids each job kept (the reporting observer's state)
    second_tracker: dict
    first_out: str
    records: list[dict]  # both jobs' metrics records
    env_run_id_after_prepare: str | None


@pytest.fixture(scope="module")
def nested(tmp_path_factory: pytest.TempPathFactory, single_rank) -> NestedRun:
    """A 4-step MLflow run nested under a parent run, with DeepSpeed's wall-clock breakdown on, profiling steps
    2-3; the first job stops for the time limit at step 2 (inside the window), the requeued one finishes."""
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("nested")
    (tmp / "logs").mkdir()
    with warnings.catch_warnings():  # SQLAlchemy's deprecations inside MLflow, creating the store
        warnings.simplefilter("ignore", DeprecationWarning)
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'logs' / 'mlflow.db'}")
        experiment_id = client.create_experiment("sweep", artifact_location=(tmp / "artifacts").as_uri())
    parent = client.create_run(experiment_id, run_name="sweep-1").info.run_id
    ds = json.loads(Path("deepspeed/ds_config.json").read_text())
    (tmp / "ds.json").write_text(json.dumps({**ds, "wall_clock_breakdown": True}))
    flags = ["--report_to", "mlflow", "--mlflow_parent_run_id", parent, "--profile_steps", "2:3"]
    flags += ["--deepspeed_config", str(tmp / "ds.json"), "--logging_freq", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(launch_env.LOG_FILE, str(tmp / "logs" / "job_9.out"))
        mp.setenv("MLFLOW_RUN_ID", parent)  # as `mlflow run` sets it: the same run as the parent is fine
        first_out = io.StringIO()
        with contextlib.redirect_stdout(first_out):
            trainer = make_trainer(tmp, single_rank, 4, *flags)
            env_run_id = os.environ.get("MLFLOW_RUN_ID")
            find(trainer, Walltime).planner = ScriptedPlanner(4, {2: Decision(stop_now=True)})
            try:
                first_state = trainer.fit()
            finally:
                trainer.close()
        with contextlib.redirect_stdout(io.StringIO()):
            again = make_trainer(tmp, single_rank, 4, *flags)
            try:
                second_state = again.fit()
            finally:
                again.close()
    first_tracker, second_tracker = find(trainer, Reporting).tracker, find(again, Reporting).tracker
    return NestedRun(
        tmp=tmp,
        parent=parent,
        experiment_id=experiment_id,
        first_state=first_state,
        second_state=second_state,
        first_tracker=first_tracker,
        second_tracker=second_tracker,
        first_out=first_out.getvalue(),
        records=records(tmp / "logs" / "job_9.metrics.jsonl"),
        env_run_id_after_prepare=env_run_id,
    )


def test_nested_mlflow_child_run_is_continued_by_the_requeued_job(nested: NestedRun) -> None:
    from mlflow.tracking import MlflowClient

    assert nested.env_run_id_after_prepare is None  # the ranks dropped MLFLOW_RUN_ID
    assert nested.first_state.step == 2 and nested.second_state.step == 4
    child = nested.first_tracker["mlflow"]["run_id"]
    assert nested.second_tracker["mlflow"]["run_id"] == child
    client = MlflowClient(tracking_uri=f"sqlite:///{nested.tmp / 'logs' / 'mlflow.db'}")
    runs = client.search_runs([nested.experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted([nested.parent, child])
    run = client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == nested.parent
    assert run.info.run_name == nested.first_state.run_id and run.info.status == "FINISHED"
    assert client.get_experiment_by_name("dskit") is None  # the child lives in the parent's experiment
    assert [m.step for m in client.get_metric_history(child, "train/loss")] == [1, 2, 3, 4]
    ppl = client.get_metric_history(child, "train/ppl")
    assert [m.step for m in ppl] == [1, 2, 3, 4] and all(m.value > 1 for m in ppl)
    assert [m.step for m in client.get_metric_history(child, "val/ppl")] == [4]
    assert [m.step for m in client.get_metric_history(child, "perf/ds_fwd_ms")] == [1, 2, 3, 4]


def test_dskit_eval_records_into_the_runs_own_mlflow_run(nested: NestedRun, monkeypatch) -> None:
    """With no --report_to, the run's own trackers: its MLflow child run gets eval/<task>/<metric> at the tag's
    step, and no other run is made."""
    from mlflow.tracking import MlflowClient

    from dskit.eval import evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lines: list[str] = []
    result = evaluate(nested.tmp / "ckpt", ["dskit_tiny_mc"], on_line=lines.append)
    child = nested.second_tracker["mlflow"]["run_id"]
    assert result.step == 4 and result.recorded == [f"mlflow {child}"]
    client = MlflowClient(tracking_uri=f"sqlite:///{nested.tmp / 'logs' / 'mlflow.db'}")
    assert sorted(r.info.run_id for r in client.search_runs([nested.experiment_id])) == sorted(
        [nested.parent, child]
    )
    history = client.get_metric_history(child, "eval/dskit_tiny_mc/acc")
    assert [(m.step, m.value) for m in history] == [(4, result.metrics["dskit_tiny_mc"]["acc"])]
    assert client.get_run(child).info.status == "FINISHED"
    assert lines[-1] == f"recorded at step 4 of run {nested.first_state.run_id}: mlflow {child}"


def test_perplexity_and_wall_clock_breakdown_in_the_metrics_file(nested: NestedRun) -> None:
    train = [r for r in nested.records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert r["ppl"] == pytest.approx(math.exp(r["loss"]))
        assert r["ds_fwd_ms"] > 0 and r["ds_bwd_ms"] > 0 and r["ds_step_ms"] > 0, r
        # DeepSpeed's phases fit within the step the kit timed.
        assert r["ds_fwd_ms"] + r["ds_bwd_ms"] + r["ds_step_ms"] <= r["step_time_s"] * 1000 * 1.05


def test_profile_trace_of_the_window_is_written_and_uploaded(nested: NestedRun) -> None:
    from mlflow.tracking import MlflowClient

    # The first job stopped at step 2, inside the window: no trace from it, the requeued job profiled step 3.
    assert "no profiler trace of steps 2-3" in nested.first_out
    traces = sorted(p.name for p in (nested.tmp / "logs").glob("*.pt.trace.json.gz"))
    assert traces == ["job_9.profile-steps3-3.pt.trace.json.gz"]
    with gzip.open(nested.tmp / "logs" / traces[0]) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name") for e in events}
    assert "optimizer_step_3" in names and "optimizer_step_2" not in names
    client = MlflowClient(tracking_uri=f"sqlite:///{nested.tmp / 'logs' / 'mlflow.db'}")
    child = nested.second_tracker["mlflow"]["run_id"]
    assert [a.path for a in client.list_artifacts(child, "profiler")] == [f"profiler/{traces[0]}"]


def test_close_after_a_failed_step_ends_the_tracker_and_the_worker(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error inside the loop still ends the tracker's run and stops the batch worker (Trainer.close in the
    entry point's finally). A CPU rank reads on its training thread: the batches here get the worker a GPU rank's
    have."""
    trainer = make_trainer(tmp_path, single_rank, 4, "--metrics_file", "none")
    assert trainer.batches is not None and trainer.batches._worker is None
    trainer.batches = StepBatches(
        trainer.run.train_blocks, trainer.sampler, single_rank.device, background=True
    )
    # The optimizer DeepSpeed built (ZeRO-2, CPU Adam) got the decay groups: norms and biases undecayed.
    decays = [group["weight_decay"] for group in trainer.engine._engine.optimizer.param_groups]
    assert decays == [0.1, 0.0], decays
    closed = []
    monkeypatch.setattr(find(trainer, Reporting).reporter.tracker, "close", lambda: closed.append("tracker"))
    monkeypatch.setattr(trainer.engine, "train_step", lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        try:
            trainer.fit()
        finally:
            trainer.close()
    assert closed == ["tracker"]
    assert trainer.batches is not None and trainer.batches._worker._shutdown
    assert "engine" not in vars(trainer)  # released
    trainer.close()  # idempotent


def test_two_local_launches_of_a_named_run_are_one_run(tmp_path: Path, single_rank, monkeypatch) -> None:
    """train-singlenode.sh launched twice writes a log (and metrics file) per launch: --run_name is the run's id
    in both, its TensorBoard run, and what `dskit plot` stitches both launches by."""
    from dskit import plot

    logs = tmp_path / "logs"
    outs = []
    for launch, steps in ((1, 4), (2, 8)):
        monkeypatch.setenv(launch_env.LOG_FILE, str(logs / f"exp_{launch}.out"))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            trainer = make_trainer(tmp_path, single_rank, steps, "--run_name", "exp")
            try:
                trainer.fit()
            finally:
                trainer.close()
        outs.append(out.getvalue())
    assert "Run exp: metrics to " in outs[0] and "Run exp: metrics to " in outs[1]
    assert "Training tiny-qwen3 with DeepSpeed for 4 steps" in outs[0]
    starts = [
        r for n in (1, 2) for r in records(logs / f"exp_{n}.metrics.jsonl") if r.get("event") == "start"
    ]
    assert [(r["run_id"], r["step"]) for r in starts] == [("exp", 0), ("exp", 4)]
    assert [p.name for p in (logs / "tensorboard").iterdir()] == ["exp"]

    run = plot.load_run("exp", logs)
    assert run.sources == (logs / "exp_1.metrics.jsonl", logs / "exp_2.metrics.jsonl")
    assert run.series["loss"].steps == (2, 4, 6, 8) and run.resumes == (4,)
