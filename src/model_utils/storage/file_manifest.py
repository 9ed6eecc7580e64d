"""Checkpoint manifests: every file's size and checksum, written last, so a tag is complete only if it verifies.

Checksums are computed by the rank that wrote a file, right after writing it (`digest_written`: still in its page
cache), and handed to `build`, which hashes only what no rank did: no second pass over the checkpoint by one process.
At resume the ranks verify a tag's files in parallel (checkpoint/protocol.py) and tell the main rank which files
matched (`remember_verified`); its `verify` then re-reads none of those whose size and mtime are unchanged.

Also the one atomic-write helper (temp file, fsync, rename, fsync of the directory) used for `latest` and for
the manifest itself: a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import xxhash

MANIFEST = "dskit_manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """xxh3-64 of the file: fast enough (GB/s) to verify multi-GB checkpoints on every resume."""
    h = xxhash.xxh3_64()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest_written(path: Path) -> dict[str, Any]:
    """Size and checksum of a file this process has just written, fsynced first (so the manifest never outruns
    the data); the read is served from the page cache the write filled."""
    h = xxhash.xxh3_64()
    with path.open("rb") as f:
        os.fsync(f.fileno())
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        size = os.fstat(f.fileno()).st_size
    return {"size": size, "xxh3": h.hexdigest()}


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_path(path: Path) -> Path:
    """Where `path` is written before it takes its name. Host and pid: processes on several nodes may write the
    same file on a shared filesystem."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def write_durably(tmp: Path, text: str) -> None:
    """Write and fsync `tmp`; removed again when the write fails (a full disk keeps no half-written file)."""
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """The old file or the new one, never a torn one, and no temporary file left when the write fails."""
    tmp = temporary_path(path)
    write_durably(tmp, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def kept_json(path: Path, compute: Callable[[], Any], usable: Callable[[Any], bool]) -> Any:
    """What an earlier process left in `path`, when `usable`; else `compute()`, left there (a whole file: processes
    computing together each write theirs, one wins). A cache that cannot be read or written costs the computation,
    never the caller."""
    with contextlib.suppress(OSError, ValueError):
        kept = json.loads(path.read_text())
        if usable(kept):
            return kept
    value = compute()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(value))
    return value


def build(
    tag_dir: Path, extra: dict[str, Any], digests: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Size and checksum of every file under tag_dir. `digests`: those the writing ranks computed (digest_written),
    by path relative to tag_dir; used where the size still matches. Every other file is fsynced and hashed here."""
    digests = digests or {}
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in tag_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = str(path.relative_to(tag_dir))
        known = digests.get(rel)
        files[rel] = (
            known if known is not None and known["size"] == path.stat().st_size else digest_written(path)
        )
    return {"version": MANIFEST_VERSION, **extra, "files": files}


def write(tag_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_text(tag_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def read(tag_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((tag_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


# While set, verify() checks presence and sizes only (checksums_left_to_the_ranks).
_checksums_left_to_the_ranks = False


@contextlib.contextmanager
def checksums_left_to_the_ranks() -> Iterator[None]:
    """verify() checks that every file is there with its size, not its checksum, while this is active: for the
    one-process check before the ranks start (the launchers' preflight), whose ranks then verify the checksums in
    parallel and pass over a tag that fails them. One process reading a whole checkpoint is what this avoids."""
    global _checksums_left_to_the_ranks
    before, _checksums_left_to_the_ranks = _checksums_left_to_the_ranks, True
    try:
        yield
    finally:
        _checksums_left_to_the_ranks = before


# Files some rank of this job verified against a manifest: (path, size, mtime in ns, checksum) (see the module doc).
_verified: set[tuple[str, int, int, str]] = set()


def _verified_key(path: Path, st: os.stat_result, xxh3: str) -> tuple[str, int, int, str]:
    return (os.path.abspath(path), st.st_size, st.st_mtime_ns, xxh3)


def remember_verified(keys: list[tuple[str, int, int, str]]) -> None:
    """Record files verified by another rank (check_files' keys): verify skips their checksums while they are
    unchanged."""
    _verified.update(keys)


def check_files(tag_dir: Path, manifest: dict[str, Any], rels: list[str]) -> tuple[str | None, list]:
    """Verify the files `rels` of the manifest (size and checksum): the first problem (None: all match) and the
    keys of those that matched, for remember_verified."""
    keys = []
    for rel in rels:
        meta = manifest["files"][rel]
        path = tag_dir / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"{rel} is missing", keys
        if st.st_size != meta["size"]:
            return f"{rel} has {st.st_size} bytes, the manifest says {meta['size']}", keys
        if file_digest(path) != meta["xxh3"]:
            return f"{rel} does not match its checksum", keys
        keys.append(_verified_key(path, st, meta["xxh3"]))
    return None, keys


def verify(tag_dir: Path, checksums: bool = True) -> str | None:
    """None when every file of the manifest is present with its size (and checksum); else what is wrong. A file
    that a rank verified in parallel (remember_verified) and that is unchanged is not read again."""
    manifest = read(tag_dir)
    if manifest is None:
        return f"no readable {MANIFEST} (an unfinished save?)"
    for rel, meta in manifest["files"].items():
        path = tag_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        st = path.stat()
        if st.st_size != meta["size"]:
            return f"{rel} has {st.st_size} bytes, the manifest says {meta['size']}"
        if (
            not checksums
            or _checksums_left_to_the_ranks
            or _verified_key(path, st, meta["xxh3"]) in _verified
        ):
            continue
        if file_digest(path) != meta["xxh3"]:
            return f"{rel} does not match its checksum"
    return None
