"""`dskit export`'s last step without a checkpoint: the staged model moved into an existing dir, which may be a
mount point (SageMaker's /opt/ml/model), so the dir itself is never removed or renamed (tests/e2e/test_export.py
exports real checkpoints; tests/e2e/test_sagemaker_job.py runs the entry's export into a mounted model/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dskit.export import LAST_FILE, move_into


def staged(root: Path, weights: str) -> Path:
    root.mkdir(parents=True)
    (root / "model.safetensors").write_text(weights)
    (root / "tokenizer.json").write_text("{}")
    (root / LAST_FILE).write_text(json.dumps({"model_type": "qwen3"}))
    return root


def test_the_contents_are_replaced_and_the_dir_kept(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    (out / "sub").mkdir()
    inode = out.stat().st_ino
    move_into(staged(tmp_path / "stage", "w1"), out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").read_text() == "w1" and out.stat().st_ino == inode


def test_config_json_comes_last_so_a_cut_short_move_is_no_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "model"
    move_into(staged(tmp_path / "a", "w1"), out)
    copied: list[str] = []

    def copy_then_fail(src: str, dst: str) -> None:
        copied.append(Path(src).name)
        if Path(src).name == LAST_FILE:
            raise OSError(28, "No space left on device")
        shutil.copyfile(src, dst)

    monkeypatch.setattr(shutil, "copy2", copy_then_fail)
    with pytest.raises(OSError, match="No space left"):
        move_into(staged(tmp_path / "b", "w2"), out)
    assert copied[-1] == LAST_FILE and len(copied) == 3
    # The old model is gone (its config first) and the new one has no config: nothing here loads as a model.
    assert not (out / LAST_FILE).exists() and (out / "model.safetensors").read_text() == "w2"


MOUNTED = """
import json, os, subprocess, sys
from pathlib import Path
from dskit.export import move_into
out, volume = Path(sys.argv[1]), Path(sys.argv[2])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out)], check=True)
results = []
for run in ("1", "2"):  # the export, then a restarted job's export into the same mount
    stage = volume / f"stage{run}"
    stage.mkdir()
    (stage / "model.safetensors").write_text("weights" + run)
    (stage / "config.json").write_text("{}")
    move_into(stage, out)
    results.append({"mount": os.path.ismount(out), "files": sorted(os.listdir(out)),
                    "weights": (out / "model.safetensors").read_text()})
print(json.dumps(results))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="mounting needs root and unshare"
)
def test_export_into_a_mount_point_keeps_the_mount(tmp_path: Path) -> None:
    out, volume = tmp_path / "opt-ml" / "model", tmp_path / "ml-volume"
    out.mkdir(parents=True)
    volume.mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", textwrap.dedent(MOUNTED),
         str(out), str(volume)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second = json.loads(done.stdout)
    assert first == {"mount": True, "files": ["config.json", "model.safetensors"], "weights": "weights1"}
    assert second == {"mount": True, "files": ["config.json", "model.safetensors"], "weights": "weights2"}
    assert not list(out.iterdir())  # it all went to the mount (gone with its namespace), none under it
