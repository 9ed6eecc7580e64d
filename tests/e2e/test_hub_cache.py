"""A hub model fetched once by the preflight, trained by ranks that never touch the network.

A loopback stand-in for the hub (tests/support/hub_server.py, the real huggingface_hub client talking HTTP to it)
serves a tiny Qwen3 saved locally, with a duplicate .bin beside its safetensors. One module-scoped flow: `dskit
prepare` (what the launchers' `dskit preflight` runs after its doctor) fetches the snapshot into a fresh HF cache and pins its commit; the hub's main branch then moves on; a
2-rank torchrun, with the stand-in still up and HF_HUB_OFFLINE unset, trains from the pinned commit and makes no
request; a second preflight (a requeue) keeps the pin. Then: the same cache with HF_HUB_OFFLINE=1 works, and an
unreachable hub with an empty cache fails with one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.hub_server import HubStandIn
from support.ports import free_port
from support.pretrained import save_tiny_qwen3
from support.torchrun import ENV, run_torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

REPO = "stand-in/tiny-qwen3"
STEPS = 2


@dataclass(frozen=True)
class Flow:
    tmp: Path
    first_commit: str
    moved_commit: str
    preflight_requests: list[str]
    rank_requests: list[str]  # what the stand-in logged while the ranks ran
    train_out: str
    requeue_out: str


def _train_flags(tmp: Path, checkpoint_dir: str = "ck") -> list[str]:
    return [
        "--model", REPO, "--max_steps", str(STEPS), "--checkpoint_freq", str(STEPS), "--seq_length", "32",
        "--validation_fraction", "0", "--metrics_file", "none", "--checkpoint_dir", str(tmp / checkpoint_dir),
        "--data_cache_dir", str(tmp / "data"),
    ]  # fmt: skip


def _env(tmp: Path, endpoint: str, offline: str, hf_home: str = "hf") -> dict[str, str]:
    return {
        **ENV,
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(tmp / hf_home),
        "HF_HUB_OFFLINE": offline,
        "HF_DATASETS_OFFLINE": "1",
    }


def dskit(tmp: Path, command: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dskit.cli", command, *flags],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # generous: an unreachable hub must fail in seconds, not after minutes of retries
    )


@pytest.fixture(scope="module")
def flow(tmp_path_factory: pytest.TempPathFactory) -> Flow:
    tmp = tmp_path_factory.mktemp("hub")
    model = save_tiny_qwen3(tmp / "published")
    (model / "pytorch_model.bin").write_bytes(b"a .bin duplicate of the safetensors: never fetched")
    with HubStandIn() as hub:
        first = hub.publish(REPO, model)
        env = _env(tmp, hub.url, offline="0")
        proc = dskit(tmp, "prepare", env, *_train_flags(tmp))  # the launchers' preflight, less its doctor
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        preflight_requests = list(hub.requests)
        moved = hub.publish(REPO, model)  # main moves on: the run keeps the commit it was pinned to
        before = len(hub.requests)
        train_out = run_torchrun(_train_flags(tmp), nproc=2, cwd=tmp, env=env).stdout
        rank_requests = hub.requests[before:]
        # SLURM requeued the job after its run had finished (a node lost at the very end)
        requeue_env = {**env, "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
        requeue = dskit(tmp, "prepare", requeue_env, *_train_flags(tmp))
        assert requeue.returncode == 0, (requeue.stdout + requeue.stderr)[-4000:]
    return Flow(
        tmp, first, moved, preflight_requests, rank_requests, train_out, requeue.stdout + requeue.stderr
    )


def test_the_preflight_fetches_the_snapshot_once_and_pins_its_commit(flow: Flow) -> None:
    pins = json.loads((flow.tmp / "ck" / "hub-pins.json").read_text())
    assert pins["model"]["repo"] == REPO and pins["model"]["revision"] == "main"
    assert pins["model"]["commit"] == flow.first_commit
    snapshot = flow.tmp / "hf" / "hub" / "models--stand-in--tiny-qwen3" / "snapshots" / flow.first_commit
    files = sorted(p.name for p in snapshot.iterdir())
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files, files
    assert "pytorch_model.bin" not in files, "the .bin duplicate of the safetensors was fetched"
    downloads = [r for r in flow.preflight_requests if r.startswith("GET /stand-in/")]
    assert len(downloads) == len(set(downloads)) == len(files), downloads  # each file once


def test_the_ranks_train_from_the_pinned_commit_without_a_request(flow: Flow) -> None:
    assert flow.rank_requests == [], flow.rank_requests
    assert "Done: step 2/2" in flow.train_out, flow.train_out[-4000:]
    (tag,) = [p for p in (flow.tmp / "ck").iterdir() if (p / "launch.json").is_file()]
    resolved = json.loads((tag / "launch.json").read_text())["resolved"]
    assert resolved["model"] == REPO
    assert resolved["model_commit"] == flow.first_commit != flow.moved_commit


def test_a_requeue_keeps_the_pinned_commit(flow: Flow) -> None:
    pins = json.loads((flow.tmp / "ck" / "hub-pins.json").read_text())
    assert pins["model"]["commit"] == flow.first_commit, flow.requeue_out
    assert f"{REPO}@{flow.first_commit[:12]}" in flow.requeue_out


def test_offline_with_the_snapshot_cached_prepares_from_the_cache(flow: Flow) -> None:
    # no stand-in at all: the hub is off, the cache has the snapshot (refs/main from the first preflight)
    env = _env(flow.tmp, "http://127.0.0.1:9", offline="1")
    proc = dskit(flow.tmp, "prepare", env, *_train_flags(flow.tmp, "ck-offline"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"HF_HUB_OFFLINE: model {REPO}@{flow.first_commit[:12]} from the local cache" in proc.stdout


def test_an_unreachable_hub_and_an_empty_cache_fail_with_one_line(flow: Flow) -> None:
    env = _env(flow.tmp, f"http://127.0.0.1:{free_port()}", offline="0", hf_home="hf-empty")
    proc = dskit(flow.tmp, "prepare", env, *_train_flags(flow.tmp, "ck-unreachable"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    (line,) = errors
    assert f"model {REPO}@main is not in the HF cache" in line and "cannot be reached" in line
    assert f"hf download {REPO}" in line and "pass a local directory" in line
    assert not (flow.tmp / "hf-empty" / "hub" / "models--stand-in--tiny-qwen3" / "snapshots").exists()
