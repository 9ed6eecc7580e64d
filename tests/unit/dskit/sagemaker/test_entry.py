"""The SageMaker entry's pieces without training: the contract read from an /opt/ml-like tree, the training flags
it builds, and the checkpoint bookkeeping across instances (tests/e2e/test_sagemaker_job.py runs it for real)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from dskit.sagemaker import entry
from dskit.sagemaker.entry import Contract, merge_host_shards, prune_staging, training_args
from model_utils.errors import ConfigError


def tree(base: Path, hps: dict[str, str], channels: tuple[str, ...] = ("model", "train")) -> dict[str, str]:
    config = base / "input" / "config"
    config.mkdir(parents=True)
    resource = {"current_host": "algo-2", "hosts": ["algo-1", "algo-2"], "network_interface_name": "eth0"}
    (config / "resourceconfig.json").write_text(json.dumps(resource))
    (config / "hyperparameters.json").write_text(json.dumps(hps))
    (config / "inputdataconfig.json").write_text(json.dumps({c: {} for c in channels}))
    return {"DSKIT_SM_BASE": str(base), "SM_NUM_GPUS": "8", "SM_NUM_CPUS": "192"}


def test_the_contract_and_the_training_flags(tmp_path: Path) -> None:
    env = tree(tmp_path, {"config": ".dskit-sagemaker/run.yaml", "max_steps": "100", "lr": "2e-5"})
    contract = Contract.read(env)
    assert (contract.hosts, contract.current_host, contract.host_index) == (["algo-1", "algo-2"], "algo-2", 1)
    assert (contract.gpus, contract.cpus, contract.network_interface) == (8, 192, "eth0")
    data = tmp_path / "input" / "data"
    assert contract.channels == {"model": data / "model", "train": data / "train"}
    assert training_args(contract) == [
        "--config", ".dskit-sagemaker/run.yaml", "--max_steps", "100", "--lr", "2e-5",
        "--model", str(data / "model"), "--dataset", str(data / "train"),
        "--checkpoint_dir", str(tmp_path / "checkpoints"),
        "--data_cache_dir", str(tmp_path / "input" / "dskit" / "data-cache"),
    ]  # fmt: skip
    # The training toolkit's variables win where they are set.
    toolkit = Contract.read(
        {**env, "SM_HOSTS": '["a", "b", "c"]', "SM_CURRENT_HOST": "c", "SM_CHANNEL_VALIDATION": "/val"}
    )
    assert toolkit.host_index == 2 and toolkit.channels["validation"] == Path("/val")
    assert training_args(toolkit)[-6:-4] == ["--validation_dataset", "/val"]


def test_contract_mistakes_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"resourceconfig\.json not found: this runs inside a SageMaker"):
        Contract.read({"DSKIT_SM_BASE": str(tmp_path / "none")})
    env = tree(tmp_path / "a", {"model": "Qwen/Qwen3-8B"})
    with pytest.raises(ConfigError, match="hyperparameter model is set by the job"):
        training_args(Contract.read(env))
    env = tree(tmp_path / "b", {}, channels=("model",))
    with pytest.raises(ConfigError, match="no train channel"):
        training_args(Contract.read(env))
    env = tree(tmp_path / "c", {})
    with pytest.raises(ConfigError, match="this host 'algo-9' is not in the job's hosts"):
        Contract.read({**env, "SM_CURRENT_HOST": "algo-9"})


def test_unwritable_paths_name_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"file/model is not writable by uid \d+ .*run the image as root"):
        entry.check_writable([blocker / "model"])


def committed(root: Path, tag: str, world: int, ranks: list[int]) -> None:
    (root / tag).mkdir(parents=True)
    (root / tag / "dskit_manifest.json").write_text("{}")
    (root / tag / "launch.json").write_text(json.dumps({"world_size": world}))
    for r in ranks:
        (root / tag / f"rng_state_rank{r}.pt").write_text(str(r))


def test_other_hosts_files_join_their_tag_and_an_incomplete_tag_is_set_aside(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoints"
    committed(ck, "m-4steps", 2, [0])
    (ck / ".staging-m-4steps").mkdir()
    (ck / ".staging-m-4steps" / "rng_state_rank1.pt").write_text("1")
    committed(ck, "m-8steps", 2, [0])  # rank 1's files never arrived
    (ck / ".staging-m-12steps").mkdir()  # a save that never committed: left for rank 0 to clear
    (ck / ".incomplete-m-2steps").mkdir()  # demoted by an older kit (or a delete cut short)
    (ck / ".incomplete-m-2steps" / "mp_rank_00_model_states.pt").write_text("w")
    done = merge_host_shards(ck)
    assert done == [
        "merged 1 files of other hosts into m-4steps",
        "m-8steps lacks the files of ranks [1] (not synced from their host): deleted",
    ]
    assert (ck / "m-4steps" / "rng_state_rank1.pt").read_text() == "1" and not (
        ck / ".staging-m-4steps"
    ).exists()
    # Gone from the synced dir, so not uploaded to S3 and restored at every restart.
    assert sorted(p.name for p in ck.iterdir()) == [".staging-m-12steps", "m-4steps"]


def test_pruning_keeps_the_newest_staging_dirs(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20, 25):
        (tmp_path / f".staging-m-{step}steps").mkdir()
    prune_staging(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".staging-m-15steps", ".staging-m-20steps", ".staging-m-25steps",
    ]  # fmt: skip


def test_a_channel_the_kit_cannot_read_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = tree(tmp_path, {})
    config = tmp_path / "input" / "config" / "inputdataconfig.json"
    config.write_text(
        json.dumps({"model": {"TrainingInputMode": "FastFile"}, "train": {"TrainingInputMode": "Pipe"}})
    )
    assert Contract.read(env).input_modes == {"model": "FastFile", "train": "Pipe"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert entry.main([]) == 2
    line = "error: channel train is in Pipe input mode, which the kit cannot read (it reads files): submit the job "
    line += "with input_mode File or FastFile in the values file"
    assert capsys.readouterr().err == line + "\n"
    assert (tmp_path / "output" / "failure").read_text() == line  # the job's FailureReason


def test_the_failure_reason_is_the_kits_error_line_or_a_crash_with_the_logs_tail() -> None:
    tail = [f"line {i} " + "x" * 60 for i in range(40)]
    named = "dataset path /opt/ml/input/data/train does not exist: fix it\n"  # the error file's message
    assert entry.failure_reason(named, 2, "algo-1", tail) == "error: " + named.strip()
    crash = entry.failure_reason(None, -9, "algo-2", tail)
    lines = crash.splitlines()
    assert (
        lines[0]
        == "torchrun exited with status -9 on algo-2 (a crash, no error line from the kit); log tail:"
    )
    assert lines[-1] == tail[-1] and lines[1:] == tail[-(len(lines) - 1) :] and len(lines) > 5
    assert (
        len(crash.encode()) <= entry.FAILURE_LIMIT < len(crash.encode()) + len(tail[0]) + 2
    )  # as much as fits


def test_the_failure_file_holds_no_credentials(tmp_path: Path) -> None:
    contract = Contract.read(tree(tmp_path, {}))
    tail = ["mlflow.exceptions.RestException: https://admin:pw@mlflow.example/api failed", "HF_TOKEN=hf_abc"]
    entry._fail(contract, entry.failure_reason(None, 1, "algo-1", tail))
    written = (tmp_path / "output" / "failure").read_text()
    assert written.splitlines()[1:] == [
        "mlflow.exceptions.RestException: https://mlflow.example/api failed",
        "HF_TOKEN=***",
    ]


@pytest.fixture(autouse=True)
def fresh_stop(monkeypatch: pytest.MonkeyPatch):
    """A stop state of the test's own, and this process's SIGTERM handler as it was after the test: entry.main()
    installs the job's handler (left in the test process, it kept pytest from ending on SIGTERM, and the pool
    workers lm-eval forks later would ignore their pool's terminate: a hung suite)."""
    state = entry.StopState()
    monkeypatch.setattr(entry, "STOP", state)
    before = signal.getsignal(signal.SIGTERM)
    yield state
    signal.signal(signal.SIGTERM, before)


def test_a_stop_before_main_is_held_and_answered_once_main_runs(fresh_stop: entry.StopState) -> None:
    signal.signal(signal.SIGTERM, fresh_stop._handle)  # what the module's first lines do under `python -m`
    os.kill(os.getpid(), signal.SIGTERM)  # recorded, nothing raised yet: main is not there to answer it
    assert fresh_stop.received_at is not None
    with pytest.raises(entry.Stopped):
        fresh_stop.install()


def test_a_stop_during_the_merge_lets_it_finish_then_main_exits_143_without_a_failure(
    fresh_stop: entry.StopState,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    for name, value in tree(tmp_path, {"max_steps": "5"}).items():
        monkeypatch.setenv(name, value)
    merged = []

    def merge(checkpoint_dir: Path) -> list[str]:
        os.kill(os.getpid(), signal.SIGTERM)  # StopTrainingJob while files move between dirs
        merged.append(checkpoint_dir)
        return ["merged 2 files of other hosts into model-4steps"]

    monkeypatch.setattr(entry, "merge_host_shards", merge)
    monkeypatch.setattr(entry.subprocess, "Popen", None)  # the ranks must not start
    assert entry.main([]) == entry.STOPPED_STATUS
    out = capsys.readouterr().out
    assert merged and "merged 2 files" in out  # the merge ran to its end
    assert "[dskit-sagemaker] SIGTERM during set-up: stopped" in out
    assert not (tmp_path / "output" / "failure").exists()  # a stop is not a failure


def test_the_job_command_runs_the_entry_once_and_says_only_its_own_line(tmp_path: Path) -> None:
    """`python3 -m dskit.sagemaker.entry`, as the job's bootstrap runs it, outside a job: one error line, no
    runpy warning first (the package does not import the entry, so it runs once, as __main__)."""
    import subprocess
    import sys

    src = Path(entry.__file__).parents[2]
    env = {**os.environ, "DSKIT_SM_BASE": str(tmp_path), "PYTHONPATH": str(src), "PYTHONWARNINGS": "default"}
    proc = subprocess.run(
        [sys.executable, "-m", "dskit.sagemaker.entry"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: {tmp_path}/input/config/resourceconfig.json not found: this runs inside a SageMaker training job "
        "(or set DSKIT_SM_BASE to a dir holding SageMaker's input/config tree)"
    ]
