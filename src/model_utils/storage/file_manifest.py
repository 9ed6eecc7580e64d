"""Checkpoint manifests: every file's size and checksum, written last, so a tag is complete only if it verifies.

Also the one atomic-write helper (temp file, fsync, rename, fsync of the directory) used for `latest` and for
the manifest itself: a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import socket
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


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    # Host and pid: processes on several nodes may write the same file on a shared filesystem.
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def build(tag_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Size and checksum of every file under tag_dir (fsynced first, so the manifest never outruns the data)."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in tag_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        with path.open("rb") as f:
            os.fsync(f.fileno())
        files[str(path.relative_to(tag_dir))] = {"size": path.stat().st_size, "xxh3": file_digest(path)}
    return {"version": MANIFEST_VERSION, **extra, "files": files}


def write(tag_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_text(tag_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def read(tag_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((tag_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def verify(tag_dir: Path, checksums: bool = True) -> str | None:
    """None when every file of the manifest is present with its size (and checksum); else what is wrong."""
    manifest = read(tag_dir)
    if manifest is None:
        return f"no readable {MANIFEST} (an unfinished save?)"
    for rel, meta in manifest["files"].items():
        path = tag_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"{rel} has {size} bytes, the manifest says {meta['size']}"
        if checksums and file_digest(path) != meta["xxh3"]:
            return f"{rel} does not match its checksum"
    return None
