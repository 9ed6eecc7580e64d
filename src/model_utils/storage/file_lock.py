"""One process at a time on a shared dir: an exclusive lock file, for a preparation of data (the preflight's and
`dskit prepare-data`'s alike: data/token_shards.py) that two launches may start at the same moment.

flock where the filesystem has it: the kernel (or the NFS server) releases it when its holder dies, so a killed
holder leaves no stale lock. Elsewhere, a file created exclusively, naming its holder, taken over when stale (its
holder, on this host, is gone). Either way the lock file names its holder (host, pid, since when) for the line a
waiting process prints.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from model_utils import processes

POLL_S = 1.0
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def _holder() -> str:
    return f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%H:%M:%S')}"


@contextlib.contextmanager
def exclusive(lock: Path, waiting: Callable[[str], None]) -> Iterator[None]:
    """Hold `lock` while the block runs; when another process holds it, `waiting(its holder)` is called once and
    this one waits for it."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting(os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown holder")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            os.close(fd)
            fd = -1
            with _lock_file(lock.with_name(lock.name + ".held"), waiting):
                yield
            return
        with contextlib.suppress(
            OSError
        ):  # the holder's name is for the waiting line: a full disk may refuse it
            os.ftruncate(fd, 0)
            os.pwrite(fd, _holder().encode(), 0)
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the flock


@contextlib.contextmanager
def _lock_file(held: Path, waiting: Callable[[str], None]) -> Iterator[None]:
    """Where the filesystem has no flock: a file created exclusively, naming its holder; taken over when stale
    (its holder, on this host, is gone)."""
    said = False
    while True:
        try:
            fd = os.open(held, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            try:
                holder = held.read_text().strip()
            except FileNotFoundError:
                continue  # released meanwhile
            words = holder.split()  # host HOST pid PID since TIME (_holder)
            if (
                words[:1] == ["host"]
                and len(words) > 3
                and words[1] == socket.gethostname()
                and not (words[3].isdigit() and processes.running(int(words[3])))
            ):
                held.unlink(missing_ok=True)  # stale: a killed holder's
                continue
            if not said:
                waiting(f"{holder}; delete {held} if that process is gone")
                said = True
            time.sleep(POLL_S)
    try:
        with contextlib.suppress(OSError):
            os.write(fd, _holder().encode())
        os.close(fd)
        yield
    finally:
        held.unlink(missing_ok=True)
