"""`--report_to`: real TensorBoard event files, a real MLflow SQLite store and W&B's offline run files, read back
with their own readers (W&B's: support/wandb_offline.py); the metrics and the samples' text.

A requeue is simulated in-process: open, log, close, then open again with the resume state the first open
returned (what the trainer keeps in checkpoints), as a requeued job does.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from model_utils.errors import ConfigError
from model_utils.observe.trackers import (
    MLFLOW_RUN_ID_ENV,
    PARENT_TAG,
    MlflowTracker,
    NoTracker,
    check_parent_run,
    flatten_params,
    open_tracker,
    samples_file,
    samples_markdown,
    scalar_items,
    take_env_run_id,
)
from support.metrics_file import tensorboard_scalars, tensorboard_texts
from support.ports import free_port
from support.wandb_offline import offline_runs

RUN_ID = "tiny_qwen3-20261122-160000"
CONFIG = {
    "model": {"model": "tiny-qwen3", "seq_length": 256},
    "optim": {"lr": 0.003, "betas": [0.9, 0.95], "deepspeed_config": "deepspeed/ds_config.json"},
    "loop": {"max_steps": 100, "metrics_file": None},
    "notes": "x" * 2000,
    "report": {"tracking_uri": "https://admin:pw@mlflow.example/", "hf_token": "hf_secret"},
}

# Generations of --sample_prompts, (prompt, text): what a tracker shows as text.
SAMPLES = [("Once upon a time", " there was | a\nking"), ("The capital of France is", " Paris")]


def record(step: int, offset: float = 0.0) -> dict:
    """A training record as the trainer writes it (CPU: no device memory, no MFU)."""
    return {
        "step": step,
        "time": 1_790_000_000.0 + step,
        "loss": 8.0 - step / 10 + offset,
        "lr": 1e-3 * step,
        "grad_norm": float("nan"),
        "tokens_per_s": 1000.0 + step,
        "mfu": None,
        "device_mem_alloc_gib": None,
        "host_rss_gib": 1.5,
        "skipped_steps": 0,
        "tokens_seen": 512 * step,
    }


def test_scalar_items_groups_names_and_skips_none_nan_and_strings():
    items = dict(scalar_items({**record(3), "event": "checkpoint", "val_loss": 4.5, "custom": 1, "x/y": 2}))
    assert items["train/loss"] == pytest.approx(7.7)
    assert items["val/loss"] == 4.5
    assert items["perf/tokens_per_s"] == 1003.0
    assert items["memory/host_rss_gib"] == 1.5
    assert items["progress/tokens_seen"] == 1536.0
    assert items["train/custom"] == 1.0 and items["x/y"] == 2.0
    for absent in ("train/grad_norm", "perf/mfu", "memory/device_alloc_gib", "step", "time", "event"):
        assert absent not in items


def test_none_is_a_no_op_that_keeps_other_trackers_state(tmp_path):
    previous = {"tensorboard": {"run": RUN_ID}}
    tracker, state = open_tracker(
        "none", run_id=RUN_ID, log_dir=tmp_path, config=CONFIG, tracking_uri=None, resume_state=previous
    )
    assert isinstance(tracker, NoTracker)
    tracker.log_metrics(1, {"loss": 1.0})
    tracker.close()
    assert state == previous
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("report_to", "message"),
    [
        ("comet", "'comet' is not a tracker: use one or more of tensorboard, mlflow, wandb"),
        ("wandb,wandb", "name each tracker once, and none alone"),
        ("none,tensorboard", "name each tracker once, and none alone"),
    ],
)
def test_unknown_or_repeated_report_to_is_a_config_error(tmp_path, report_to, message):
    with pytest.raises(ConfigError, match=message):
        open_tracker(
            report_to, run_id=RUN_ID, log_dir=tmp_path, config={}, tracking_uri=None, resume_state=None
        )
    assert list(tmp_path.iterdir()) == []


# W&B's settings a user may set, each of which the kit would otherwise choose: unset for the tests but one.
USERS_WANDB = (
    "WANDB_DIR", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME",
    "WANDB_SILENT", "WANDB_CONSOLE", "WANDB_X_DISABLE_STATS",
)  # fmt: skip


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_API_KEY", "WANDB_PROJECT", *USERS_WANDB):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # W&B's own settings, not ~'s
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def test_wandb_offline_with_tensorboard_requeue_continues_one_run_each(tmp_path, wandb_offline, capsys):
    logs = tmp_path / "logs"
    tracker, state = open_tracker(
        "tensorboard,wandb", run_id=RUN_ID, log_dir=logs, config=CONFIG, tracking_uri=None, resume_state=None
    )
    for step in (1, 2, 3):
        tracker.log_metrics(step, record(step))
    trace = tmp_path / "trace.json"
    trace.write_text("{}")
    tracker.log_artifact(trace, "profiler")
    tracker.log_samples(3, SAMPLES)
    tracker.close()
    out = capsys.readouterr().out
    wandb_id = state["wandb"]["run_id"]
    assert f"W&B: run {wandb_id} in project dskit, new, offline in {logs / 'wandb'}" in out
    assert f"wandb sync {logs / 'wandb'}" in out

    tracker, state2 = open_tracker(
        "tensorboard,wandb", run_id="tiny_qwen3-20261122-170000", log_dir=logs, config=CONFIG,
        tracking_uri=None, resume_state=state, resume_step=3,
    )  # fmt: skip
    for step in (4, 5):
        tracker.log_metrics(step, record(step))
    tracker.close()
    assert (
        state2 == state == {"tensorboard": {"run": RUN_ID}, "wandb": {"run_id": wandb_id, "project": "dskit"}}
    )
    assert "continued" in capsys.readouterr().out
    # A run's finish can return before W&B's service has written the run's last records out (seen on a loaded
    # machine): they are on disk once the service ends, which a process's exit does (W&B's atexit handler).
    import wandb

    wandb.teardown()

    first, second = offline_runs(logs)  # one offline dir per attempt, one W&B run id: `wandb sync` joins them
    assert first.run_id == second.run_id == wandb_id and first.name == RUN_ID and first.project == "dskit"
    assert sorted(first.history) == [1, 2, 3] and sorted(second.history) == [4, 5]
    assert first.history[2]["train/loss"] == pytest.approx(7.8) and second.history[5]["train/lr"] == 5e-3
    assert "train/grad_norm" not in first.history[1]  # NaN and None are not logged, as for the others
    assert first.config["optim"]["lr"] == 0.003 and "optim" not in second.config  # given once, at the start
    assert first.config["report"] == {"tracking_uri": "https://mlflow.example/", "hf_token": "***"}
    assert "trace.json" in first.files
    # The samples: a W&B table at their step (its rows in the run's media file), the TensorBoard text tab.
    table = {k.removeprefix("samples/"): v for k, v in first.history[3].items() if k.startswith("samples/")}
    assert table["_type"] == "table-file" and table["nrows"] == 2
    (table_file,) = first.dir.glob(f"files/{table['path']}")
    assert json.loads(table_file.read_text())["data"] == [list(pair) for pair in SAMPLES]
    assert tensorboard_texts(logs / "tensorboard" / RUN_ID, "samples") == {3: samples_markdown(SAMPLES)}
    # TensorBoard got the same steps in its one run dir.
    assert [s for s, _ in tensorboard_scalars(logs / "tensorboard" / RUN_ID)["train/loss"]] == [1, 2, 3, 4, 5]


def test_the_users_wandb_environment_wins_over_the_kits_choices(tmp_path, wandb_offline, monkeypatch, capsys):
    """WANDB_DIR, WANDB_NAME, WANDB_RUN_ID, WANDB_RESUME and W&B's output settings, set by the user, replace
    the kit's log dir, run id as name, new id, resume 'allow' and quiet run; a requeue continues that run."""
    import wandb

    users = tmp_path / "users-wandb"
    monkeypatch.setenv("WANDB_DIR", str(users))
    monkeypatch.setenv("WANDB_NAME", "my-sweep-trial")
    monkeypatch.setenv("WANDB_RUN_ID", "trial0042")
    monkeypatch.setenv("WANDB_RESUME", "never")
    monkeypatch.setenv("WANDB_CONSOLE", "wrap")
    wandb.teardown()  # W&B reads the environment when its session starts, as in a job's process
    logs = tmp_path / "logs"
    state = None
    for step in (1, 2):  # the first attempt, then its requeue
        tracker, state = open_tracker(
            "wandb", run_id=RUN_ID, log_dir=logs, config=CONFIG, tracking_uri=None, resume_state=state
        )
        assert (tracker.run.settings.resume, tracker.run.settings.console) == ("never", "wrap")
        tracker.log_metrics(step, record(step))
        tracker.close()
    wandb.teardown()  # the runs' last records on disk (as in the test above)

    assert state == {"wandb": {"run_id": "trial0042", "project": "dskit"}}
    assert (
        f"W&B: run trial0042 in project dskit, continued, offline in {users / 'wandb'}"
        in capsys.readouterr().out
    )
    assert not logs.exists()
    first, second = offline_runs(users)
    assert first.run_id == second.run_id == "trial0042" and first.name == "my-sweep-trial"
    assert (sorted(first.history), sorted(second.history)) == ([1], [2])


def test_samples_markdown_keeps_one_row_per_sample() -> None:
    text = samples_markdown([("a | b", "line one\nline two"), ("", "x\\y")])
    assert text.splitlines() == [
        "| # | prompt | sample |",
        "|---|---|---|",
        "| 1 | a \\| b | line one<br>line two |",
        "| 2 |   | x\\\\y |",
    ]


def test_wandb_online_without_a_key_or_a_bad_mode_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match=r"no W&B API key: run `wandb login` .* set WANDB_MODE=offline"):
        open_tracker(
            "wandb", run_id=RUN_ID, log_dir=tmp_path, config={}, tracking_uri=None, resume_state=None
        )
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ConfigError, match="WANDB_MODE='sometimes': use online, offline or disabled"):
        open_tracker(
            "wandb", run_id=RUN_ID, log_dir=tmp_path, config={}, tracking_uri=None, resume_state=None
        )
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_requeue_continues_the_same_run_dir(tmp_path):
    tracker, state = open_tracker(
        "tensorboard", run_id=RUN_ID, log_dir=tmp_path, config=CONFIG, tracking_uri=None, resume_state=None
    )
    for step in (1, 2, 3):
        tracker.log_metrics(step, record(step))
    tracker.log_metrics(3, {"step": 3, "val_loss": 6.5, "val_ppl": math.exp(6.5)})
    tracker.close()

    # The requeued job passes back what was stored in the checkpoint, and a new run_id it would not use.
    tracker, state2 = open_tracker(
        "tensorboard",
        run_id="tiny_qwen3-20261122-170000",
        log_dir=tmp_path,
        config=CONFIG,
        tracking_uri=None,
        resume_state=state,
        resume_step=3,
    )
    for step in (4, 5):
        tracker.log_metrics(step, record(step))
    tracker.close()

    assert state2 == state == {"tensorboard": {"run": RUN_ID}}
    run_dirs = list((tmp_path / "tensorboard").iterdir())
    assert run_dirs == [tmp_path / "tensorboard" / RUN_ID]
    scalars = tensorboard_scalars(run_dirs[0])
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([8.0 - s / 10 for s in range(1, 6)])
    assert scalars["train/lr"][-1] == (5, pytest.approx(5e-3))
    assert scalars["val/loss"] == [(3, 6.5)]
    assert "train/grad_norm" not in scalars and "perf/mfu" not in scalars
    # The config is logged once, by the fresh start.
    acc = EventAccumulator(str(run_dirs[0]), size_guidance={"tensors": 0})
    acc.Reload()
    config_events = acc.Tensors("config/text_summary")
    assert len(config_events) == 1
    logged = config_events[0].tensor_proto.string_val[0].decode()
    assert '"max_steps": 100' in logged and '"tracking_uri": "https://mlflow.example/"' in logged
    assert "pw@" not in logged and "hf_secret" not in logged and '"hf_token": "***"' in logged


def test_tensorboard_requeue_replaces_steps_logged_after_the_checkpoint(tmp_path):
    """A job killed at step 5 after checkpointing at 3: the requeued job's steps 4-5 replace the lost ones."""
    tracker, state = open_tracker(
        "tensorboard", run_id=RUN_ID, log_dir=tmp_path, config=CONFIG, tracking_uri=None, resume_state=None
    )
    for step in range(1, 6):
        tracker.log_metrics(step, record(step))
    tracker.log_metrics(5, {"step": 5, "val_loss": 9.0})
    tracker.close()
    time.sleep(1.1)  # event files are named by the second they were opened in
    tracker, _ = open_tracker(
        "tensorboard",
        run_id=RUN_ID,
        log_dir=tmp_path,
        config=CONFIG,
        tracking_uri=None,
        resume_state=state,
        resume_step=3,
    )
    for step in (4, 5):
        tracker.log_metrics(step, record(step, offset=100.0))
    tracker.close()

    scalars = tensorboard_scalars(tmp_path / "tensorboard" / RUN_ID)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in scalars["train/loss"]][3:] == pytest.approx([107.6, 107.5])
    # Not logged again after the resume, but lost with the interrupted job all the same.
    assert scalars.get("val/loss", []) == []


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> Path:
    """One log dir for the MLflow tests: creating the SQLite tables takes seconds."""
    return tmp_path_factory.mktemp("mlflow_logs")


def test_mlflow_requeue_continues_the_same_run(mlflow_store, capfd, recwarn):
    from mlflow.tracking import MlflowClient

    started = time.perf_counter()
    tracker, state = open_tracker(
        "mlflow", run_id=RUN_ID, log_dir=mlflow_store, config=CONFIG, tracking_uri=None, resume_state=None
    )
    first_open_s = time.perf_counter() - started
    # Creating the tables logs INFO lines and SQLAlchemy warns inside MLflow: none of it reaches the log.
    out, err = capfd.readouterr()
    assert "INFO" not in out + err, out + err
    assert not [w for w in recwarn if "sqlalchemy" in w.filename or "mlflow" in w.filename]
    for step in (1, 2, 3):
        tracker.log_metrics(step, record(step))
    tracker.log_metrics(3, {"step": 3, "time": 1_790_000_003.0, "val_loss": 6.5})
    tracker.log_samples(3, SAMPLES)
    tracker.close()

    started = time.perf_counter()
    tracker, state2 = open_tracker(
        "mlflow",
        run_id=RUN_ID,
        log_dir=mlflow_store,
        config={**CONFIG, "loop": {"max_steps": 200}},  # a changed flag must not clash with the logged param
        tracking_uri=None,
        resume_state=state,
        resume_step=3,
    )
    reopen_s = time.perf_counter() - started
    for step in (4, 5):
        tracker.log_metrics(step, record(step))
    tracker.close()
    print(f"mlflow first open {first_open_s:.1f}s, reopen {reopen_s:.2f}s")

    db = mlflow_store / "mlflow.db"
    assert db.is_file()
    assert state2 == state
    assert state["mlflow"]["tracking_uri"] == f"sqlite:///{db.resolve()}"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("dskit")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [state["mlflow"]["run_id"]]
    run = runs[0]
    assert run.info.run_name == RUN_ID and run.data.tags["dskit.run_id"] == RUN_ID
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(8.0 - s / 10)) for s in range(1, 6)]
    assert history[0].timestamp == 1_790_000_001_000
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")] == [(3, 6.5)]
    assert client.get_metric_history(run.info.run_id, "train/grad_norm") == []
    assert client.get_metric_history(run.info.run_id, "perf/mfu") == []
    params = run.data.params
    assert params["optim.lr"] == "0.003" and params["loop.max_steps"] == "100"
    assert params["optim.betas"] == "[0.9, 0.95]" and params["loop.metrics_file"] == "null"
    assert len(params["notes"]) == 500
    # Params go through the one redaction: a URI's password and a secret-named value never reach the store.
    assert params["report.tracking_uri"] == "https://mlflow.example/" and params["report.hf_token"] == "***"
    # Artifacts of the local store stay under the log dir, not in the working dir.
    assert experiment.artifact_location == (mlflow_store / "mlflow-artifacts").resolve().as_uri()
    kept = client.download_artifacts(run.info.run_id, samples_file(3), str(mlflow_store / "downloaded"))
    assert Path(kept).read_text() == samples_markdown(SAMPLES)


def test_mlflow_resume_state_from_a_lost_store_starts_a_new_run(mlflow_store, capsys):
    stale = {
        "mlflow": {"run_id": "0" * 32, "tracking_uri": f"sqlite:///{(mlflow_store / 'mlflow.db').resolve()}"}
    }
    tracker, state = open_tracker(
        "mlflow", run_id="other-run", log_dir=mlflow_store, config={}, tracking_uri=None, resume_state=stale
    )
    tracker.close()
    assert state["mlflow"]["run_id"] != "0" * 32
    assert "starting a new run" in capsys.readouterr().out


def test_mlflow_logging_failures_after_the_open_warn_once_and_do_not_stop_training(mlflow_store, capsys):
    from mlflow.tracking import MlflowClient

    tracker = MlflowTracker(MlflowClient(f"sqlite:///{mlflow_store / 'mlflow.db'}"), "f" * 32)  # no such run
    for step in (1, 2, 3):
        tracker.log_metrics(step, record(step))
    warnings = [line for line in capsys.readouterr().out.splitlines() if "WARNING: MLflow" in line]
    assert len(warnings) == 1 and "logging step 1 failed" in warnings[0]


def test_mlflow_unopenable_tracking_uris_are_config_errors(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    closed_port = free_port()
    cases = {
        f"sqlite:///{blocker}/mlflow.db": "cannot open MLflow tracking URI",
        "bogus://somewhere": "cannot open MLflow tracking URI",
        f"file://{tmp_path}/mlruns": "cannot open MLflow tracking URI",
        f"http://user:secret@127.0.0.1:{closed_port}": "not reachable",
    }
    for uri, message in cases.items():
        started = time.perf_counter()
        with pytest.raises(ConfigError, match=message) as err:
            open_tracker(
                "mlflow", run_id=RUN_ID, log_dir=tmp_path, config={}, tracking_uri=uri, resume_state=None
            )
        assert time.perf_counter() - started < 30, uri
        assert "secret" not in str(err.value)
        assert "\n" not in str(err.value)


def test_flatten_params_and_redaction():
    params = flatten_params({"a": {"b": {"c": 1}, "empty": {}}, "bad key!": "v", "long": "y" * 9000})
    assert params == {"a.b.c": "1", "a.empty": "{}", "bad key_": "v", "long": "y" * 497 + "..."}


def test_mlflow_child_of_a_parent_run_is_created_once_and_continued(mlflow_store, tmp_path, capsys):
    """--mlflow_parent_run_id: a child in the parent's experiment, the same child after a requeue, a new child
    when the parent changes; a trace uploaded as the child's artifact."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{(mlflow_store / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=uri)
    sweep = client.create_experiment("sweep", artifact_location=(tmp_path / "sweep").as_uri())
    parent = client.create_run(sweep, run_name="sweep-1").info.run_id
    check_parent_run(None, mlflow_store, parent)  # the store has it: no error

    tracker, state = open_tracker(
        "mlflow", run_id=RUN_ID, log_dir=mlflow_store, config=CONFIG, tracking_uri=None, resume_state=None,
        parent_run_id=parent,
    )  # fmt: skip
    tracker.log_metrics(1, record(1))
    trace = tmp_path / "job.profile-steps1-1.pt.trace.json.gz"
    trace.write_bytes(b"trace")
    tracker.log_artifact(trace, "profiler")
    tracker.close()
    tracker, state2 = open_tracker(
        "mlflow", run_id="tiny_qwen3-other", log_dir=mlflow_store, config=CONFIG, tracking_uri=None,
        resume_state=state, resume_step=1, parent_run_id=parent,
    )  # fmt: skip
    tracker.log_metrics(2, record(2))
    tracker.close()

    child = state["mlflow"]["run_id"]
    assert state2 == state and state["mlflow"]["parent_run_id"] == parent
    assert state["mlflow"]["experiment"] == "sweep"
    runs = client.search_runs([sweep])
    assert sorted(r.info.run_id for r in runs) == sorted([parent, child])
    run = client.get_run(child)
    assert run.data.tags[PARENT_TAG] == parent and run.info.run_name == RUN_ID
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(child, "train/loss")] == [1, 2]
    assert [a.path for a in client.list_artifacts(child, "profiler")] == [f"profiler/{trace.name}"]

    other = client.create_run(sweep).info.run_id
    tracker, state3 = open_tracker(
        "mlflow", run_id=RUN_ID, log_dir=mlflow_store, config=CONFIG, tracking_uri=None, resume_state=state,
        parent_run_id=other,
    )  # fmt: skip
    tracker.close()
    assert state3["mlflow"]["run_id"] != child
    assert client.get_run(state3["mlflow"]["run_id"]).data.tags[PARENT_TAG] == other
    assert "the parent is now" in capsys.readouterr().out


def test_mlflow_parent_run_that_the_store_lacks_is_one_line(mlflow_store, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(mlflow_store / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("dskit") or client.get_experiment(
        client.create_experiment("dskit")
    )
    deleted = client.create_run(experiment.experiment_id).info.run_id
    client.delete_run(deleted)
    cases = [
        (None, mlflow_store, "0" * 32, "no such run in sqlite:///"),
        (None, mlflow_store, "not-an-id", "no such run"),
        (None, mlflow_store, deleted, "is a deleted run"),
        (None, tmp_path, "0" * 32, "there is no MLflow store at"),  # nothing created there
    ]
    for uri, log_dir, parent, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            check_parent_run(uri, log_dir, parent)
        assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_mlflow_run_id_in_the_environment(monkeypatch, capsys):
    """MLFLOW_RUN_ID would make MLflow resume that run: equal to the parent it is fine, different an error,
    without a parent ignored with a warning; the ranks drop it."""
    parent = "a" * 32
    monkeypatch.setenv(MLFLOW_RUN_ID_ENV, parent)
    take_env_run_id(parent)
    assert MLFLOW_RUN_ID_ENV not in os.environ

    monkeypatch.setenv(MLFLOW_RUN_ID_ENV, "b" * 32)
    with pytest.raises(ConfigError, match=r"MLFLOW_RUN_ID=b+ is set and --mlflow_parent_run_id is a+") as err:
        take_env_run_id(parent)
    assert "\n" not in str(err.value)

    take_env_run_id(None)
    assert MLFLOW_RUN_ID_ENV not in os.environ
    assert f"--mlflow_parent_run_id {'b' * 32}" in capsys.readouterr().out
    take_env_run_id(None)  # unset: nothing to do


def test_train_perplexity_and_deepspeed_timers_are_grouped():
    items = dict(scalar_items({"ppl": 12.5, "ds_fwd_ms": 3.0, "ds_step_ms": 1.5}))
    assert items == {"train/ppl": 12.5, "perf/ds_fwd_ms": 3.0, "perf/ds_step_ms": 1.5}
