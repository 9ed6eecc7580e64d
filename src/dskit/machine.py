"""The machine `dskit config` resolves a run for: the ranks a launch here would start, or a planned machine.

    dskit config [TRAINING FLAGS]                                   # this machine, as the launchers count it
    dskit config --nodes 2 --instance_type p5.48xlarge [FLAGS]      # 2 x 8 H100s
    dskit config --gpus_per_node 8 --gpu_memory_gib 80 [FLAGS]      # any GPU node

The launchers start a rank per GPU, or CPU_RANKS gloo ranks on a node without one (dskit/launcher/node.py); the
nodes are --nodes, else the SLURM allocation's, else 1. With the ranks and their GPU memory known, the resolver
shows what the ranks derive from them: the world size, the DeepSpeed config the memory estimate picks, the CUDA
batch default, the accumulation and the steps per epoch. Only a GPU probe settles micro batch `auto`: on GPUs
it stays open, and what follows from it says so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from model_utils.errors import ConfigError
from model_utils.resolve.batch_layout import Ranks

GiB = 2**30
FLAGS = ("--nodes", "--gpus_per_node", "--gpu_memory_gib", "--instance_type")
USAGE = "[--nodes N] [--gpus_per_node N] [--gpu_memory_gib G | --instance_type TYPE]"


@dataclass(frozen=True)
class Machine:
    nodes: int
    ranks_per_node: int
    gpu_bytes: int | None  # each rank's GPU; None: CPU ranks
    source: str  # what it was read from

    @property
    def ranks(self) -> Ranks:
        return Ranks(self.nodes * self.ranks_per_node, self.gpu_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "world_size": self.nodes * self.ranks_per_node,
            "gpu_memory_gib": None if self.gpu_bytes is None else round(self.gpu_bytes / GiB, 1),
            "from": self.source,
        }


def split(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """The machine's flags (`--name value` or `--name=value`, anywhere) and the training flags."""
    given: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name in FLAGS:
            if not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise ConfigError(f"dskit config {name} needs a value: dskit config {USAGE} [FLAGS]")
                value, i = args[i + 1], i + 1
            given[name.removeprefix("--")] = value
        else:
            rest.append(args[i])
        i += 1
    return given, rest


def _count(given: dict[str, str], name: str, least: int) -> int | None:
    text = given.get(name)
    if text is None:
        return None
    if not text.isdigit() or int(text) < least:
        raise ConfigError(f"dskit config --{name} {text}: give a whole number, at least {least}")
    return int(text)


def _this_machine() -> tuple[int, int | None, str]:
    """This machine's GPUs as the ranks would train on them (none under DS_ACCELERATOR=cpu), the smallest's memory."""
    from model_utils.resolve import batch_layout

    if not batch_layout.trains_on_cuda():
        return 0, None, "this machine (no CUDA GPU)"
    import torch

    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    smallest = min(props, key=lambda p: p.total_memory)
    return len(props), int(smallest.total_memory), f"this machine ({len(props)} x {smallest.name})"


def machine(given: dict[str, str], environ: Mapping[str, str] = os.environ) -> Machine:
    """The machine the flags plan, each value not given taken from this machine and the launch environment."""
    from dskit.estimate import instance

    nodes = _count(given, "nodes", 1) or int(environ.get("SLURM_JOB_NUM_NODES") or 1)
    gpus = _count(given, "gpus_per_node", 0)
    memory: int | None = None
    planned = [f"--{name} {value}" for name, value in given.items()]
    if "gpu_memory_gib" in given:
        try:
            memory = int(float(given["gpu_memory_gib"]) * GiB)
        except ValueError:
            memory = 0
        if memory <= 0:
            raise ConfigError(f"dskit config --gpu_memory_gib {given['gpu_memory_gib']}: give GiB, e.g. 80")
    if "instance_type" in given:
        known = instance(given["instance_type"])
        if known is None:
            from dskit.estimate import INSTANCE_MEMORY

            raise ConfigError(
                f"dskit config --instance_type {given['instance_type']}: not in the kit's table: use one of "
                f"{', '.join(INSTANCE_MEMORY)}, or --gpus_per_node and --gpu_memory_gib"
            )
        gpus = known.gpus if gpus is None else gpus
        memory = known.gpu_bytes if memory is None else memory
    if gpus is None or (gpus > 0 and memory is None):
        here, here_memory, source = _this_machine()
        gpus = here if gpus is None else gpus
        memory = here_memory if memory is None else memory
        planned.append(source)
    if gpus > 0 and memory is None:
        raise ConfigError(
            f"dskit config --gpus_per_node {gpus} on a machine without a GPU: give --gpu_memory_gib (e.g. 80 for an "
            "H100) or --instance_type"
        )
    if gpus == 0:
        from dskit.render import LaunchValues

        ranks = int(environ.get("CPU_RANKS") or LaunchValues().cpu_ranks_per_node)
        return Machine(nodes, ranks, None, ", ".join([*planned, f"{ranks} CPU ranks a node (CPU_RANKS)"]))
    return Machine(nodes, gpus, memory, ", ".join(planned))
