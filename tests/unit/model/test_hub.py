"""model_utils.model.hub against a pre-filled HF cache (the real layout: refs/<branch>, snapshots/<commit>/) and a
closed loopback port for an unreachable hub. The fetch itself, against a stand-in hub, is tests/e2e/test_hub_cache.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants

from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.model import hub
from support.ports import free_port

REPO = "org/tiny"
OLD, NEW = "a" * 40, "b" * 40
FILES = {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors": "weights"}


def prefill(cache: Path, commit: str, branch: str | None = "main") -> Path:
    """A snapshot of REPO at `commit` in the cache, as `hf download` leaves it; `branch` then names it."""
    repo_dir = cache / "models--org--tiny"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in FILES.items():
        (snapshot / name).write_text(text)
    if branch is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / branch).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def closed_hub(monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: connections are refused at once
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return url


def test_safetensors_are_fetched_without_their_bin_duplicates() -> None:
    assert hub.weight_patterns(["model.safetensors", "pytorch_model.bin", "config.json"]) == (
        "*.safetensors",
    )
    assert hub.weight_patterns(["pytorch_model.bin", "config.json"]) == ("*.bin",)


def test_offline_resolves_the_branch_from_the_cache(cache: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = prefill(cache, NEW)
    snap = hub.resolve(REPO, None, "model", weights=True, local_only=False)
    assert (snap.commit, snap.path, snap.revision) == (NEW, snapshot, "main")
    assert snap.patterns == (*hub.SMALL_FILES, "*.safetensors")
    assert f"HF_HUB_OFFLINE: model {REPO}@{NEW[:12]} from the local cache" in capsys.readouterr().out


def test_the_ranks_load_the_pinned_commit_not_the_branchs_new_head(cache: Path, tmp_path: Path) -> None:
    """A requeue: main moved on since the first launch; the run's pin keeps it on the weights it started from."""
    old = prefill(cache, OLD, branch=None)
    prefill(cache, NEW)
    first = hub.Snapshot(REPO, "main", OLD, old, (*hub.SMALL_FILES, "*.safetensors"))
    hub.write_pins(tmp_path / "ck", {"model": first})
    pins = hub.read_pins(tmp_path / "ck")
    snap = hub.resolve(REPO, None, "model", weights=True, local_only=True, pinned=pins["model"])
    assert (snap.commit, snap.path) == (OLD, old)
    # Another --model_revision than the pinned one is the user's choice, not a requeue: the pin does not apply.
    other = hub.resolve(REPO, NEW, "model", weights=True, local_only=True, pinned=pins["model"])
    assert other.commit == NEW


def test_a_rank_never_fetches_what_is_not_cached(cache: Path, closed_hub: str) -> None:
    with pytest.raises(hub.HubUnavailable) as err:
        hub.resolve(REPO, None, "model", weights=True, local_only=True)
    message = str(err.value)
    assert "\n" not in message
    assert f"model {REPO}@main is not in the HF cache ({cache})" in message
    assert "the ranks never fetch" in message and f"hf download {REPO} --revision main" in message


def test_an_unreachable_hub_and_an_empty_cache_is_one_line(cache: Path, closed_hub: str) -> None:
    with pytest.raises(hub.HubUnavailable) as err:
        hub.resolve(REPO, "v1.0", "tokenizer", weights=False, local_only=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"tokenizer {REPO}@v1.0 is not in the HF cache")
    assert "ConnectError" in message and "pass a local directory" in message


def test_an_unreachable_hub_falls_back_to_the_cache_and_says_so(cache: Path, closed_hub: str, capsys) -> None:
    snapshot = prefill(cache, NEW)
    snap = hub.resolve(REPO, None, "model", weights=True, local_only=False)
    assert (snap.commit, snap.path) == (NEW, snapshot)
    assert "hub unreachable (ConnectError: " in capsys.readouterr().out


def test_model_revision_needs_a_hub_model(tmp_path: Path) -> None:
    from model_utils.resolve import resolver

    cfg = parse_args(["--model_revision", "v1", "--checkpoint_dir", str(tmp_path / "ck")])
    with pytest.raises(ConfigError, match=r"--model_revision v1 applies to a hub --model, not tiny-qwen3"):
        resolver.resolve_settings(cfg)


def test_a_snapshot_missing_its_weights_is_named_in_one_line(cache: Path, tmp_path: Path) -> None:
    """A cache copied without the weights: the file list the fetch cached (trees/) says what is missing."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    snapshot = prefill(cache, OLD)
    (snapshot / "model.safetensors").unlink()
    entries = {name: TreeCacheEntry(len(text), "0" * 40, None, None, None) for name, text in FILES.items()}
    write_tree_cache(str(cache / "models--org--tiny"), OLD, entries)
    pin = hub.Snapshot(REPO, "main", OLD, snapshot, (*hub.SMALL_FILES, "*.safetensors")).to_dict()
    with pytest.raises(hub.HubUnavailable) as err:
        hub.resolve(REPO, None, "model", weights=True, local_only=True, pinned=pin)
    message = str(err.value)
    assert "\n" not in message and "model.safetensors" in message and "the ranks never fetch" in message
