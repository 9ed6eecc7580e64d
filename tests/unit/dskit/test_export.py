"""`dskit export` without a training run: the staged model moved into an existing dir, which may be a mount point
(SageMaker's /opt/ml/model), so the dir itself is never removed or renamed; and the base a LoRA merge is onto, a
hub model's pinned commit in the HF cache (tests/e2e/test_export.py exports real checkpoints, tests/e2e/test_sft.py
a LoRA run's onto its local base; tests/e2e/test_sagemaker_job.py runs the entry's export into a mounted model/)."""

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


def test_a_lora_merge_is_onto_the_hub_base_the_run_pinned_where_the_cache_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 run on an fp32 hub model: its checkpoint holds the frozen base rounded to bf16. Where the HF cache
    holds the pinned commit, the merge is onto those fp32 weights; where it does not, onto the copy, said."""
    import torch
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    from dskit import export
    from model_utils.config.arguments import LoraArgs
    from model_utils.model import lora
    from support.pretrained import save_tiny_qwen3

    commit = "c" * 40
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    snapshot = save_tiny_qwen3(tmp_path / "hf-cache" / "models--org--tiny" / "snapshots" / commit)
    args = LoraArgs(lora_r=4)
    run = lora.wrap(AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.bfloat16), args)
    checkpoint = {name: t.float() for name, t in run.state_dict().items()}  # as export reads a tag: fp32
    launch = {"resolved": {"model": "org/tiny", "model_commit": commit, "precision": "bf16"}}
    state = dict(checkpoint)
    said = export._onto_base(state, launch, args)
    assert said == f"the base the run started from, org/tiny@{commit[:12]} (float32)"
    fp32 = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).state_dict()
    name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(state[name], fp32["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(checkpoint[name], state[name])  # the copy was the bf16 rounding of it
    adapter = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert state[adapter] is checkpoint[adapter]  # the trained adapters are the checkpoint's
    # Another commit than the one in the cache: the copy, and why.
    launch["resolved"]["model_commit"] = "d" * 40
    state = dict(checkpoint)
    said = export._onto_base(state, launch, args)
    assert said == f"the checkpoint's bf16 copy of the base (org/tiny@{'d' * 12} is not in the HF cache)"
    assert all(state[name] is checkpoint[name] for name in checkpoint)
