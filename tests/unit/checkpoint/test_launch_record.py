"""The launch record (launch.json) saved with each checkpoint: what it records of the launch, its hash of the
resolved run, and the resume check against another architecture, sequence length, world size or optimizer groups."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from model_utils.checkpoint import launch_record
from model_utils.config.presets import PRESETS
from model_utils.errors import ConfigError
from model_utils.optim.schedules import RanSchedule
from support.checkpoint_tags import fake_tag

REPO = Path(__file__).resolve().parents[3]


def _launch_tag(tmp_path: Path, world_size: int = 2, seq_length: int = 64) -> tuple[Path, object]:
    config = PRESETS["tiny-qwen3"].build_config()
    tag = fake_tag(tmp_path, 4)
    config.save_pretrained(tag / "hf_config")
    # As a run with the default --seq_length records it: the user's config says None, the resolved run 64.
    launch = {
        "config": {"data": {"seq_length": None}},
        "resolved": {"seq_length": seq_length},
        "world_size": world_size,
    }
    (tag / "launch.json").write_text(json.dumps(launch))
    return tag, config


def test_launch_manifest_refuses_another_architecture_or_sequence_length(tmp_path: Path) -> None:
    tag, config = _launch_tag(tmp_path)
    assert launch_record.check_resume(tag, config, 64, world_size=2) is None
    # Weights only: another world size, or optimizer groups this checkpoint was not saved with.
    assert launch_record.check_resume(tag, config, 64, world_size=1) == "world size changed from 2 to 1"
    why = launch_record.check_resume(tag, config, 64, world_size=2, optimizer_groups=[[3, 100], [2, 8]])
    assert (
        why
        == "the optimizer's parameter groups changed from one group (a kit before weight-decay groups) to [[3, 100], [2, 8]]"
    )
    wider = PRESETS["tiny-qwen3"].build_config()
    wider.hidden_size = 128
    with pytest.raises(ConfigError, match="has hidden_size=64 but the model now has hidden_size=128"):
        launch_record.check_resume(tag, wider, 64, world_size=2)
    with pytest.raises(ConfigError, match="was trained with --seq_length 64, not 128"):
        launch_record.check_resume(tag, config, 128, world_size=2)
    # A checkpoint of a kit before the resolved run: the resolved length was written into the config.
    (tag / "launch.json").write_text(json.dumps({"config": {"data": {"seq_length": 64}}, "world_size": 2}))
    assert launch_record.check_resume(tag, config, 64, world_size=2) is None
    with pytest.raises(ConfigError, match="was trained with --seq_length 64, not 128"):
        launch_record.check_resume(tag, config, 128, world_size=2)


def test_launch_manifest_records_how_the_run_was_launched(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("FI_PROVIDER", "efa")
    monkeypatch.setenv("CUDA_VERSION", "12.9")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    info = launch_record.collect(
        {"a": 1}, {"seq_length": 64}, {"zero_optimization": {"stage": 2}}, world_size=16
    )
    assert (info["config"], info["resolved"]) == ({"a": 1}, {"seq_length": 64})
    assert info["env"] == {"FI_PROVIDER": "efa", "NCCL_DEBUG": "INFO"}
    assert (info["nodes"], info["world_size"], info["cuda_version"]) == ("node[1-2]", 16, "12.9")
    assert info["uv_lock_sha256"] and len(info["uv_lock_sha256"]) == 64
    # The tests run from a git checkout (CI clones the repo): the record names its exact commit.
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert len(head) == 40 and info["git_commit"] == head


def test_launch_record_holds_no_credentials(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_IB_AUTH", "nccl_secret")  # recorded env: NCCL_*/FI_*, secret-named ones masked
    config = {"report": {"tracking_uri": "https://admin:pw@mlflow.example/x", "run_name": "r"}}
    info = launch_record.collect(config, {"seq_length": 64}, {}, world_size=1)
    assert info["config"]["report"] == {"tracking_uri": "https://mlflow.example/x", "run_name": "r"}
    assert info["env"]["NCCL_IB_AUTH"] == "***"
    assert "pw" not in json.dumps(info) and "nccl_secret" not in json.dumps(info)


def test_launch_manifest_has_no_commit_outside_a_git_checkout(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(launch_record, "REPO_ROOT", tmp_path)  # the kit unpacked from an archive, say
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repo above tmp_path either
    for name in ("GIT_DIR", "GIT_WORK_TREE"):
        monkeypatch.delenv(name, raising=False)
    info = launch_record.collect({}, {}, {}, world_size=1)
    assert info["git_commit"] is None
    assert info["uv_lock_sha256"] is None  # no uv.lock there either


def test_launch_record_hashes_the_resolved_run() -> None:
    one = launch_record.collect({"a": 1}, {"seq": 64}, {"zero": 2}, world_size=2)
    assert one["run_sha256"] == launch_record.collect({"a": 1}, {"seq": 64}, {"zero": 2}, 4)["run_sha256"]
    assert one["run_sha256"] != launch_record.collect({"a": 1}, {"seq": 64}, {"zero": 3}, 2)["run_sha256"]


def test_a_launch_record_says_the_schedule_its_run_trained(tmp_path: Path) -> None:
    tag, _ = _launch_tag(tmp_path)
    assert launch_record.ran_schedule(tag) is None  # a kit before the schedule was recorded: nothing kept
    launch = json.loads((tag / "launch.json").read_text())
    launch["resolved"] |= {"max_steps": 200, "warmup_steps": 61}
    (tag / "launch.json").write_text(json.dumps(launch))
    assert launch_record.ran_schedule(tag) == RanSchedule(61, 200)
