"""`--push_to_hub REPO`: when the run finishes, rank 0 exports its final checkpoint and pushes it to the hub
(`dskit export ... --push_to_hub`, dskit/hub_push.py) in a process of its own, started at the loop's end so it
runs while the rank closes its trackers and engine. The rank waits for it at its close (a job that ended first
would take it down with it: SLURM ends every process of the job) and reports it in one line; a failed push is a
warning, never the run's failure, and says how to push by hand.

Only a run that finished ("done") pushes: a preempted or stopped run has not trained what it was asked to.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from model_utils import launch_env
from model_utils.loop.hooks import Observer
from model_utils.loop.state import TrainState
from model_utils.observe.log import print0, warn0
from model_utils.repo import REPO_ROOT

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext


PUSH_TIMEOUT_S = 3600.0  # the export and upload of a large model take minutes; a hung hub, forever


class HubPush(Observer):
    def __init__(self, checkpoint_dir: Path, export_dir: Path, repo: str, options: list[str]) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.export_dir = export_dir
        self.repo = repo
        self.options = options  # --private, --revision BRANCH
        self.proc: subprocess.Popen[str] | None = None
        self.started = 0.0
        self.timeout_s = PUSH_TIMEOUT_S

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> HubPush | None:
        ckpt = ctx.run.config.checkpoint
        if ckpt.push_to_hub is None or not ctx.dist.is_main:
            return None
        options = ["--private"] if ckpt.hub_visibility == "private" else []
        options += ["--revision", ckpt.hub_revision] if ckpt.hub_revision else []
        out = Path(ctx.run.config.report.report_dir) / f"{ckpt.push_to_hub.replace('/', '--')}.hub-export"
        return cls(Path(ckpt.checkpoint_dir), out, ckpt.push_to_hub, options)

    def export_args(self) -> list[str]:
        return [
            "export",
            str(self.checkpoint_dir),
            str(self.export_dir),
            "--push_to_hub",
            self.repo,
            *self.options,
        ]

    def command(self) -> list[str]:
        return [sys.executable, "-m", "dskit.cli", *self.export_args()]

    def on_end(self, state: TrainState, reason: str) -> None:
        if reason != "done":
            return
        # A previous push's export dir is replaced: export refuses a non-empty dir.
        shutil.rmtree(self.export_dir, ignore_errors=True)
        self.started = time.monotonic()
        print0(f"Pushing the step-{state.step} model to the hub repo {self.repo} in the background")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=REPO_ROOT,
                env=push_environment(dict(os.environ)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        except OSError as e:  # the run finished: a push that cannot start is a warning, not its failure
            warn0(
                f"the push to the hub repo {self.repo} could not start ({e}): push by hand with {self.by_hand()}"
            )

    def on_close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            output, _ = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:  # a hub that never answers must not hold the allocation
            proc.kill()
            proc.communicate()
            warn0(
                f"the push to the hub repo {self.repo} did not end within {self.timeout_s:g} s: stopped it; the run "
                f"finished: push by hand with {self.by_hand()}"
            )
            return
        lines = output.strip().splitlines()
        pushed = [line for line in lines if line.startswith("pushed ")]
        if proc.returncode == 0 and pushed:
            print0(f"{pushed[-1]} ({time.monotonic() - self.started:.0f} s)")
            return
        why = next((line.removeprefix("error: ") for line in lines if line.startswith("error: ")), None)
        why = why or (lines[-1] if lines else f"exit status {proc.returncode}")
        warn0(
            f"the push to the hub repo {self.repo} failed ({why}); the run finished: push by hand with {self.by_hand()}"
        )

    def by_hand(self) -> str:
        return shlex.join([".venv/bin/dskit", *self.export_args()])


def push_environment(env: dict[str, str]) -> dict[str, str]:
    """The ranks' environment with the caller's HF_HUB_OFFLINE back (the launchers made the ranks offline)."""
    if launch_env.CALLER_HF_HUB_OFFLINE in env:
        caller = env.pop(launch_env.CALLER_HF_HUB_OFFLINE)
        env.pop("HF_HUB_OFFLINE", None)
        if caller:
            env["HF_HUB_OFFLINE"] = caller
    return env
