"""Stand-in commands that record each call, for the launchers' steps (src/dskit/launcher/) where the real command
cannot run in a test: SLURM's (no cluster in a unit test: tests/slurm/ runs them for real), uv (a sync downloads
the lock's packages), an interpreter with torch on a GPU node."""

from __future__ import annotations

import os
from pathlib import Path

from support.fake_commands import executable

# Each call: a file of NUL-separated fields, the command's name then its arguments.
RECORD = """#!/usr/bin/env bash
printf '%s\\0' "$(basename "$0")" "$@" >"{calls}/$(date +%s%N)-$$"
"""


class Commands:
    """A dir of stand-ins (`add`) put first on PATH (`path`), and what each was called with (`calls`)."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.log = root / "calls"
        self.log.mkdir(parents=True)

    def add(self, name: str, then: str = "") -> Path:
        """A stand-in `name` that records its call, then runs the bash in `then` (its arguments in "$@")."""
        return executable(self.bin / name, RECORD.format(calls=self.log) + then + "\n")

    @property
    def path(self) -> str:
        return f"{self.bin}:{os.environ['PATH']}"

    def calls(self, name: str) -> list[list[str]]:
        out = []
        for path in sorted(self.log.iterdir(), key=lambda p: int(p.name.split("-")[0])):
            fields = path.read_bytes().decode().split("\0")[:-1]
            if fields[0] == name:
                out.append(fields[1:])
        return out
