"""Hub models and tokenizers: fetched once per job by the preflight, loaded by the ranks from the local cache.

The preflight (`dskit preflight` / `dskit prepare`, one process on the batch host) resolves a hub id and
--model_revision to a commit, downloads the files from_pretrained reads (config, tokenizer, generation config,
safetensors or, only where a repo has none, .bin weights) into the HF hub cache (HF_HUB_CACHE, or HF_HOME/hub: on
the shared filesystem for multi-node jobs) and pins the commit in <checkpoint_dir>/hub-pins.json. The ranks read
the pin and load from the snapshot directory with local_files_only, so no rank touches the network (the launchers
also set HF_HUB_OFFLINE=1 for them). A requeued job reads the same pin and trains from the same weights.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils.errors import ModelUnavailable, first_line
from model_utils.observe.log import print0

PIN_FILE = "hub-pins.json"
DEFAULT_REVISION = "main"
# The first call to the hub: a short timeout and no retries, so an unreachable hub fails in seconds.
METADATA_TIMEOUT_S = 10.0
# What from_pretrained reads besides the weights: config, generation config, tokenizer (json, sentencepiece,
# tiktoken, vocab/merges text), chat template, and the safetensors index.
SMALL_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubUnavailable(ModelUnavailable):
    """A hub model or tokenizer that could not be fetched and is not in the local cache."""


@dataclass(frozen=True)
class Snapshot:
    """A hub repo pinned to a commit, and its local snapshot directory in the HF cache."""

    repo: str
    revision: str  # as asked: a branch, tag or commit
    commit: str
    path: Path
    patterns: tuple[str, ...]  # the files fetched (SMALL_FILES, plus the weights for a model)

    def to_dict(self) -> dict[str, Any]:
        return {
            "repo": self.repo,
            "revision": self.revision,
            "commit": self.commit,
            "files": list(self.patterns),
        }


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def read_pins(checkpoint_dir: str | Path) -> dict[str, Any]:
    try:
        return json.loads((Path(checkpoint_dir) / PIN_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_pins(checkpoint_dir: str | Path, pins: dict[str, Snapshot]) -> None:
    from model_utils.storage.file_manifest import atomic_write_text

    text = json.dumps({role: snap.to_dict() for role, snap in pins.items()}, indent=2, sort_keys=True)
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(checkpoint_dir) / PIN_FILE, text + "\n")


def weight_patterns(files: list[str]) -> tuple[str, ...]:
    """safetensors when the repo has them (never their .bin duplicates), else the PyTorch .bin files."""
    if any(f.endswith(".safetensors") for f in files):
        return ("*.safetensors",)
    return ("*.bin",)


def _unavailable(what: str, repo: str, revision: str, reason: str) -> HubUnavailable:
    return HubUnavailable(
        f"{what} {repo}@{revision} is not in the HF cache ({cache_dir()}) and the hub cannot be reached "
        f"({reason}): fix the network, pre-fill the cache (`hf download {repo} --revision {revision}` where "
        "there is network, on the shared filesystem, or copy the cache there, then point HF_HOME/HF_HUB_CACHE at "
        "it), or pass a local directory"
    )


def _from_cache(
    repo: str, wanted: str, rev: str, weights: bool, patterns: tuple[str, ...] | None
) -> Snapshot:
    """The cached snapshot, checked complete (against the file list the fetch cached) for `patterns`, or for the
    small files and whichever weights the snapshot holds. Raises LocalEntryNotFoundError."""
    from huggingface_hub import snapshot_download

    def local(allow: tuple[str, ...]) -> Path:
        return Path(snapshot_download(repo, revision=rev, allow_patterns=list(allow), local_files_only=True))

    path = local(SMALL_FILES)
    if not weights:
        return Snapshot(repo, wanted, path.name, path, SMALL_FILES)
    patterns = patterns or SMALL_FILES + weight_patterns([p.name for p in path.iterdir()])
    return Snapshot(repo, wanted, path.name, local(patterns), patterns)


def resolve(
    repo: str,
    revision: str | None,
    what: str,
    *,
    weights: bool,
    local_only: bool,
    pinned: dict[str, Any] | None = None,
) -> Snapshot:
    """The snapshot of `repo` at `revision` (default: the hub's default branch), fetched where needed.

    `pinned`: this role's entry of the run's pin file: when it names the same repo and revision, its commit is
    used (a requeued job trains from the weights of its first run). `local_only` (the ranks): the cache alone,
    never the network. `weights`: fetch the weights too (a model), else the small files only.
    """
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    wanted = revision or DEFAULT_REVISION
    rev = wanted
    if pinned and pinned.get("repo") == repo and pinned.get("revision") == wanted:
        rev = pinned["commit"]
    pinned_patterns = tuple(pinned["files"]) if pinned and rev == pinned.get("commit") else None
    if local_only or is_offline():
        try:
            snap = _from_cache(repo, wanted, rev, weights, pinned_patterns)
        except LocalEntryNotFoundError as e:
            why = (
                "the ranks never fetch: run `dskit prepare` with the same flags first, as the launchers' preflight does"
                if local_only
                else "HF_HUB_OFFLINE is set"
            )
            if isinstance(e, IncompleteSnapshotError):  # which files are missing
                why += f"; {first_line(e)}"
            raise _unavailable(what, repo, rev, why) from None
        if not local_only:
            print0(f"HF_HUB_OFFLINE: {what} {repo}@{snap.commit[:12]} from the local cache {snap.path}")
        return snap
    return _fetch(repo, wanted, rev, what, weights)


def with_weights(snap: Snapshot, what: str) -> Snapshot:
    """`snap` (its small files, as resolve_settings fetched them) with its weights, at the same commit."""
    pin = {"repo": snap.repo, "revision": snap.revision, "commit": snap.commit, "files": []}
    return resolve(snap.repo, snap.revision, what, weights=True, local_only=False, pinned=pin)


def _fetch(repo: str, wanted: str, rev: str, what: str, weights: bool) -> Snapshot:
    import httpx2
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:  # one metadata call, no retries: the commit and the file list
        info = HfApi().model_info(repo, revision=rev, timeout=METADATA_TIMEOUT_S)
    except GatedRepoError:
        raise HubUnavailable(
            f"{what} {repo} is gated: accept its terms on the hub and set HF_TOKEN (or `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise HubUnavailable(
            f"{what} {repo} has no revision {rev!r}: check --model_revision (a branch, tag or commit)"
        ) from None
    except RepositoryNotFoundError:
        raise HubUnavailable(
            f"{what} {repo} is not on the hub (or is private): check the name, or set HF_TOKEN"
        ) from None
    except (httpx2.TransportError, HfHubHTTPError, OSError) as e:  # unreachable: the cache, if it has it
        reason = f"{type(e).__name__}: {first_line(e)}"
        try:
            snap = _from_cache(repo, wanted, rev, weights, None)
        except LocalEntryNotFoundError:
            raise _unavailable(what, repo, rev, reason) from None
        print0(
            f"hub unreachable ({reason}): {what} {repo}@{snap.commit[:12]} from the local cache {snap.path}"
        )
        return snap
    assert info.sha and _COMMIT.fullmatch(info.sha), info.sha
    files = [s.rfilename for s in info.siblings or []]
    patterns = SMALL_FILES + (weight_patterns(files) if weights else ())
    path = Path(snapshot_download(repo, revision=info.sha, allow_patterns=list(patterns)))
    if (
        rev != info.sha
    ):  # refs/<branch> for `hf` tools and offline use: snapshot_download only sees the commit
        ref = path.parents[1] / "refs" / rev
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(info.sha)
    return Snapshot(repo, wanted, info.sha, path, patterns)
