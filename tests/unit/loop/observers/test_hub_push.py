"""The end-of-run push: started only when the run finished, waited for at the close, one line either way (the
push itself, dskit export --push_to_hub against a stand-in hub: tests/e2e/test_export.py and the launcher's run
in tests/e2e/test_training_runs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from model_utils.loop.observers.hub_push import HubPush
from model_utils.loop.state import TrainState


def observer(tmp_path: Path, script: str) -> HubPush:
    push = HubPush(tmp_path / "ck", tmp_path / "out", "me/tiny", ["--private"])
    push.command = lambda: [sys.executable, "-c", script]  # type: ignore[method-assign]
    return push


def test_a_finished_run_pushes_in_the_background_and_says_so_once_done(tmp_path: Path, capsys) -> None:
    push = observer(
        tmp_path, "import time; time.sleep(0.3); print('exported x'); print('pushed out to me/tiny: URL')"
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale").write_text("a previous push's")
    push.on_end(TrainState(step=12), "done")
    assert push.proc is not None and push.proc.poll() is None  # the loop's end did not wait for it
    assert not (tmp_path / "out").exists()  # the old export is gone: export refuses a non-empty dir
    push.on_close()
    push.on_close()  # idempotent
    out = capsys.readouterr().out
    assert "Pushing the step-12 model to the hub repo me/tiny in the background" in out
    assert "pushed out to me/tiny: URL (" in out and "WARNING" not in out


@pytest.mark.parametrize("reason", ["preempted", "walltime", "diverged"])
def test_a_run_that_did_not_finish_pushes_nothing(tmp_path: Path, capsys, reason: str) -> None:
    push = observer(tmp_path, "raise SystemExit(9)")
    push.on_end(TrainState(step=5), reason)
    push.on_close()
    assert push.proc is None and capsys.readouterr().out == ""


def test_a_failed_push_is_one_warning_with_the_command_to_push_by_hand(tmp_path: Path, capsys) -> None:
    push = observer(
        tmp_path, "import sys; print('error: pushing out to the hub repo me/tiny failed: 403'); sys.exit(2)"
    )
    push.on_end(TrainState(step=12), "done")
    push.on_close()  # never raises: the run finished
    lines = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(lines) == 1, lines
    assert (
        "the push to the hub repo me/tiny failed (pushing out to the hub repo me/tiny failed: 403)"
        in lines[0]
    )
    assert "push by hand with .venv/bin/dskit " in lines[0]


def test_the_push_gets_the_callers_offline_setting_back() -> None:
    from model_utils.loop.observers.hub_push import push_environment

    launched = {"HF_HUB_OFFLINE": "1", "DSKIT_CALLER_HF_HUB_OFFLINE": "", "X": "y"}
    assert push_environment(dict(launched)) == {"X": "y"}  # the caller had it unset: online again
    assert push_environment({**launched, "DSKIT_CALLER_HF_HUB_OFFLINE": "1"})["HF_HUB_OFFLINE"] == "1"
    assert push_environment({"HF_HUB_OFFLINE": "1"}) == {"HF_HUB_OFFLINE": "1"}  # no launcher: as it is


def test_a_push_that_never_ends_is_stopped_with_one_warning(tmp_path: Path, capsys) -> None:
    push = observer(tmp_path, "import time; time.sleep(60)")
    push.timeout_s = 0.5
    push.on_end(TrainState(step=12), "done")
    proc = push.proc
    push.on_close()
    assert proc is not None and proc.returncode is not None  # killed, not left behind
    warning = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(warning) == 1 and "did not end within 0.5 s: stopped it" in warning[0], warning
