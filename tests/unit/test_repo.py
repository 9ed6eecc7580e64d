"""REPO_ROOT is the checkout: the launchers, DeepSpeed configs, templates and uv.lock beside src/ (after the move
into subpackages six modules' own parents[2] pointed into src/; one definition now)."""

from __future__ import annotations

from pathlib import Path

from model_utils.repo import REPO_ROOT


def test_repo_root_is_the_checkout_this_code_runs_from() -> None:
    assert Path(__file__).resolve().parents[2] == REPO_ROOT
    for name in ("train.sbatch", "train-singlenode.sh", "uv.lock", "pyproject.toml"):
        assert (REPO_ROOT / name).is_file(), name
    assert (REPO_ROOT / "deepspeed" / "ds_config.json").is_file()
    assert (REPO_ROOT / "src" / "model_utils" / "repo.py").is_file()
