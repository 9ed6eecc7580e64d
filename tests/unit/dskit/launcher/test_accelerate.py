"""launcher/accelerate.py: `accelerate launch`'s options as the launchers pass them (the launches themselves:
tests/unit/dskit/test_render.py, tests/slurm/test_slurm.py, tests/e2e/test_accelerate_launch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dskit.launcher import accelerate
from model_utils.errors import ConfigError


def test_across_nodes_one_world_at_the_first_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert accelerate.options(2, 2, "", ("n1", "12345")) == [
        "--num_machines=2", "--num_processes=4", "--multi_gpu", "--mixed_precision=no", "--dynamo_backend=no",
        "--main_process_ip=n1", "--main_process_port=12345", "--rdzv_backend=c10d",
        "--deepspeed_multinode_launcher=standard",
    ]  # fmt: skip
    assert capsys.readouterr().err == "accelerate launch: 2 machine(s) x 2 process(es)\n"


def test_a_config_file_picks_the_type_and_one_machine_a_free_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # relative to the repo, where the launchers run
    Path("acc.yaml").write_text("distributed_type: FSDP\n")
    # no type flag beside the file: it would override the file's distributed type; one process is fine
    assert accelerate.options(1, 1, "acc.yaml") == [
        "--num_machines=1", "--num_processes=1", "--config_file=acc.yaml", "--main_process_port=0"
    ]  # fmt: skip
    assert capsys.readouterr().err == "accelerate launch: 1 machine(s) x 1 process(es), config acc.yaml\n"


def test_a_missing_config_or_a_lone_rank_without_one_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        accelerate.options(2, 2, str(tmp_path / "nope.yaml"))
    assert str(e.value) == (
        f"ACCELERATE_CONFIG={tmp_path / 'nope.yaml'}: no such file (an accelerate config YAML, relative to the repo)"
    )
    with pytest.raises(ConfigError) as e:
        accelerate.options(1, 1, "")
    assert str(e.value) == (
        "accelerate without a config file launches --multi_gpu, which needs at least 2 ranks in all (1 here): set "
        "ACCELERATE_CONFIG to an accelerate config, or use launcher torchrun"
    )
