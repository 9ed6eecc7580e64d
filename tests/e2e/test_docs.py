"""The docs guard, run: the commands README.md and docs/*.md show, in the order a new user meets them, in a copy of
the checkout as git has it (no checkpoints, logs or caches), each as written with `bash -c`. Run commands run for
real; a dry run's stand-in runs in its place (tests/support/doc_commands.py says which, and why). Any failing
command fails the test, named by page, line and command. What a page shows a Run command printing is held to what
it prints now, line by line. The classification of every command, and the checks that need no run:
tests/unit/test_docs.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from support import doc_commands
from support.doc_commands import COMMANDS, FLAGS, DryRun, OutputSample, Run

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]
REPO = doc_commands.REPO


def fresh_checkout(dest: Path) -> Path:
    """The files git tracks or would track, as in the working tree, and this checkout's environment as .venv/bin
    (what the two set-up commands make)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is not there for a user either
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    # .venv/bin as the commands name it; the directory itself is the copy's, so `dskit doctor` sees an interpreter
    # from elsewhere (its uv row: SKIP) rather than this checkout's environment, whose editable install is not
    # the copy's (a FAIL no user would see)
    (dest / ".venv").mkdir()
    (dest / ".venv" / "bin").symlink_to(REPO / ".venv" / "bin")
    return dest


def user_env(checkout: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSKIT_", "AWS_", "PYTEST_"))}
    env.update(
        # .venv's editable install points at this checkout's src/: the copy's own code runs instead
        PYTHONPATH=str(checkout / "src"),
        # the DeepSpeed ops this checkout built (a fresh one would build them once, minutes)
        TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"),
        # no network, no AWS configuration, no developer's HF cache
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        AWS_CONFIG_FILE=str(home / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(home / "no-aws-credentials"),
    )
    return env


def test_the_documented_commands_run_as_written(tmp_path: Path) -> None:
    checkout = fresh_checkout(tmp_path / "checkout")
    env = user_env(checkout, tmp_path)
    shell = ["bash", "-euo", "pipefail", "-c"]

    def run(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*shell, command], cwd=checkout, env=env, capture_output=True, text=True, timeout=300
        )

    # The copy's code, not this checkout's: `dskit render` writes the launchers beside the code it runs from.
    version = run(".venv/bin/dskit --version")
    assert version.stdout.strip().endswith(f"from {checkout}"), version.stdout + version.stderr

    failures, ran, timings = [], 0, []
    for page in doc_commands.doc_files():
        for shown in doc_commands.shown_files(page):  # the values files a page shows, saved as a user would
            (checkout / shown.name).write_text(shown.body)
        for command in doc_commands.commands(page):
            how = COMMANDS[command.text]  # the unit test holds every command to a classification
            if isinstance(how, Run):
                line = command.text
            elif isinstance(how, DryRun) and how.check != FLAGS:
                line = how.check
            else:
                continue
            started = time.monotonic()
            done = run(line)
            timings.append((time.monotonic() - started, line))
            ran += 1
            said = done.stdout + done.stderr
            # a command that says error: failed, whatever its exit status (a launcher's child may not)
            if (
                done.returncode != 0
                or any(x.startswith("error:") for x in said.splitlines())
                or "Traceback" in said
            ):
                failures.append(
                    f"{command.file}:{command.line}: {line}\n  exit {done.returncode}: {said[-1500:]}"
                )
    print("\n".join(f"{seconds:5.1f} s  {line}" for seconds, line in sorted(timings, reverse=True)))
    assert not failures, f"{len(failures)} of {ran} documented commands failed:\n" + "\n".join(failures)
    assert ran >= len([h for h in COMMANDS.values() if isinstance(h, Run)])

    # What the Run commands made: the launchers rendered last (docs/launchers.md: launcher accelerate).
    assert "accelerate launch" in (checkout / "train.sbatch").read_text()


@pytest.mark.parametrize(
    "sample",
    [s for s in doc_commands.all_output_samples() if isinstance(COMMANDS[s.command.text], Run)],
    ids=lambda s: f"{s.command.file}:{s.line}",
)
def test_the_output_a_page_shows_is_what_its_command_prints(sample: OutputSample, tmp_path: Path) -> None:
    """Where the docs' own samples were made: this checkout's environment (synced, its DeepSpeed ops built by
    `make warm`), on a machine without a GPU, from a directory with no checkpoints yet (a fresh checkout's); every
    line shown is a line printed, numbers, paths and the host name aside."""
    if "dskit doctor" in sample.command.text and shutil.which("nvidia-smi"):
        pytest.skip("the page shows the doctor of a machine without a GPU")
    # Short paths without hyphens: the doctor's table wraps a long path inside it, and at a hyphen.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="docs") as short:
        cwd = Path(short)
        (cwd / ".venv").symlink_to(REPO / ".venv")
        (cwd / "ext").symlink_to(REPO / ".cache" / "torch_extensions")
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", sample.command.text],
            cwd=cwd, env={**user_env(REPO, tmp_path), "TORCH_EXTENSIONS_DIR": str(cwd / "ext")},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    printed = done.stdout + done.stderr
    missing = doc_commands.unprinted(sample.lines, printed, socket.gethostname())
    assert not missing, (
        f"{sample.command.file}:{sample.line} shows lines `{sample.command.text}` does not print (any more?): "
        "update the sample to what it prints now\n"
        + "\n".join(f"  shown: {line}" for line in missing)
        + f"\nprinted (exit {done.returncode}):\n{printed}"
    )
