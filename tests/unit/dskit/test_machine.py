"""`dskit config` resolves for a machine: this one as the launchers count its ranks, or a plan (--nodes,
--gpus_per_node, --gpu_memory_gib, --instance_type); what the ranks derive from their hardware shows, what only a
GPU probe settles says so (dskit/machine.py, resolver.prepare's plan)."""

from __future__ import annotations

import json

import pytest

from dskit import cli, machine
from model_utils.errors import ConfigError

GiB = 2**30


def test_the_flags_are_read_anywhere_in_either_spelling() -> None:
    given, rest = machine.split(["--lr", "1e-3", "--nodes=2", "--max_steps", "5", "--gpus_per_node", "8"])
    assert given == {"nodes": "2", "gpus_per_node": "8"} and rest == ["--lr", "1e-3", "--max_steps", "5"]
    with pytest.raises(ConfigError, match="--nodes needs a value"):
        machine.split(["--nodes", "--lr", "1"])


def test_this_machine_is_counted_as_the_launchers_count_it(monkeypatch: pytest.MonkeyPatch) -> None:
    here = machine.machine({}, {})  # the tests run without a CUDA GPU (DS_ACCELERATOR=cpu)
    assert (here.nodes, here.ranks_per_node, here.gpu_bytes) == (
        1,
        2,
        None,
    )  # the launchers' CPU_RANKS default
    assert here.source == "this machine (no CUDA GPU), 2 CPU ranks a node (CPU_RANKS)"
    slurm = machine.machine({}, {"CPU_RANKS": "3", "SLURM_JOB_NUM_NODES": "2"})
    assert (slurm.ranks.world_size, slurm.ranks.on_cuda) == (6, False)


def test_a_plan_names_its_gpus_by_size_or_instance_type() -> None:
    p5 = machine.machine({"instance_type": "p5.48xlarge", "nodes": "2"}, {})
    assert (p5.ranks.world_size, p5.ranks.gpu_bytes) == (16, 81559 * 2**20)
    assert p5.to_dict() == {
        "nodes": 2, "ranks_per_node": 8, "world_size": 16, "gpu_memory_gib": 79.6,
        "from": "--instance_type p5.48xlarge, --nodes 2",
    }  # fmt: skip
    sized = machine.machine({"gpus_per_node": "4", "gpu_memory_gib": "24"}, {})
    assert (sized.ranks.world_size, sized.gpu_bytes) == (4, 24 * GiB)
    assert machine.machine({"gpus_per_node": "0"}, {"CPU_RANKS": "4"}).ranks_per_node == 4


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"gpus_per_node": "4"}, "--gpus_per_node 4 on a machine without a GPU: give --gpu_memory_gib"),
        ({"nodes": "0"}, "--nodes 0: give a whole number, at least 1"),
        ({"gpus_per_node": "x"}, "--gpus_per_node x: give a whole number, at least 0"),
        ({"gpus_per_node": "8", "gpu_memory_gib": "-1"}, "--gpu_memory_gib -1: give GiB, e.g. 80"),
        (
            {"instance_type": "p9.huge"},
            "--instance_type p9.huge: not in the kit's table: use one of p4d.24xlarge",
        ),
    ],
)
def test_a_plan_that_cannot_be_is_one_line(given: dict[str, str], said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace(".", r"\.").replace("(", r"\(")):
        machine.machine(given, {})


def test_config_shows_what_the_ranks_derive_on_this_machine_and_on_a_planned_one(tmp_path, capsys) -> None:
    common = ["--checkpoint_dir", str(tmp_path / "ck")]
    assert cli.main(["config", *common]) == 0  # this machine: 2 CPU ranks, all of it settled
    here = json.loads(capsys.readouterr().out)["resolved"]
    assert here["machine"]["world_size"] == here["world_size"] == 2
    assert (here["micro_batch_size"], here["gradient_accumulation_steps"]) == (1, 1)
    assert here["deepspeed_config"] == "deepspeed/ds_config.json" and isinstance(here["steps_per_epoch"], int)
    assert here["batch_layout"].endswith("1 x 1 x 2 x 256 = 512")

    assert cli.main(["config", "--nodes", "2", "--instance_type", "p5.48xlarge", *common]) == 0
    out = capsys.readouterr()
    printed = json.loads(out.out)
    p5 = printed["resolved"]
    # On CUDA ranks with the default config: the GPU-only sibling where the estimate fits, the CUDA batch default.
    assert p5["world_size"] == 16 and p5["deepspeed_config"] == "deepspeed/ds_config_gpu.json"
    assert (p5["micro_batch_size"], p5["global_batch_tokens"]) == ("auto", 262144)
    settled = "set at launch, from the micro batch rank 0 probes on its GPU"
    assert p5["gradient_accumulation_steps"] == p5["steps_per_epoch"] == printed["deepspeed"] == settled
    assert "deepspeed config: deepspeed/ds_config_gpu.json (GPU-only: estimated" in out.err

    # A given micro batch: the accumulation nearest the global batch follows for those ranks.
    flags = ["--micro_batch_size", "2", "--global_batch_tokens", "16384", *common]
    assert cli.main(["config", "--gpus_per_node", "8", "--gpu_memory_gib", "80", *flags]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["resolved"]["gradient_accumulation_steps"] == 4  # 2 x 4 x 8 x 256 = 16,384
    assert planned["deepspeed"]["gradient_accumulation_steps"] == 4


def test_a_planned_run_file_keeps_the_default_config_for_its_ranks_to_choose(tmp_path, capsys) -> None:
    """--format yaml of a GPU plan: no deepspeed section (the ranks choose between the default and its GPU-only
    sibling), and its header names the default as the default."""
    planned = ["--gpus_per_node", "8", "--gpu_memory_gib", "80", "--checkpoint_dir", str(tmp_path / "ck")]
    assert cli.main(["config", "--format", "yaml", *planned]) == 0
    dumped = capsys.readouterr().out
    assert (
        "No deepspeed section: the default deepspeed/ds_config.json (on CUDA ranks deepspeed/ds_config_gpu.json"
        in " ".join(dumped.replace("#", " ").split())
    ), dumped[:600]
    assert "\ndeepspeed:" not in dumped
