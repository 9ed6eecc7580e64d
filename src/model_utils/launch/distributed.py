"""Process-group setup from torchrun's environment, and the few collectives the loop needs."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch

from model_utils.launch import startup

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    # Ranks sharing each sequence (--sequence_parallel): consecutive ranks form a group, as DeepSpeed's Ulysses
    # groups them; the groups are data parallel.
    sequence_parallel: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's group: which of the data-parallel shares of each step it reads."""
        return self.rank // self.sequence_parallel

    @property
    def data_ranks(self) -> int:
        return self.world_size // self.sequence_parallel

    @property
    def readers(self) -> str:
        """Who reads a share of each step, as a line names them: "4 ranks", or "2 groups of 2 ranks"."""
        n, groups = self.sequence_parallel, self.data_ranks
        return f"{groups} ranks" if n == 1 else f"{groups} group{'s' * (groups > 1)} of {n} ranks"

    @property
    def shard(self) -> tuple[int, int]:
        """This rank's slice of each sequence: (its index in its group, the group's size)."""
        return self.rank % self.sequence_parallel, self.sequence_parallel


def _require_launcher_env() -> None:
    missing = [
        k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        from model_utils.errors import ConfigError

        raise ConfigError(
            f"{', '.join(missing)} not set: launch with torchrun (or ./train-singlenode.sh / sbatch train.sbatch), "
            "e.g. torchrun --nproc_per_node=2 src/train_deepspeed.py"
        )


# The NCCL flight recorder: the last collectives of each rank, kept to be dumped when the watchdog (or NCCL's own
# timeout) sees a hang. Set unless the user chose otherwise, before the process group exists. torch 2.11 renamed
# the buffer's variable and warns on every rank when the old one is set (seen on an H200); older torch reads only
# the old one.
FLIGHT_RECORDER_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch >= 2.11, before


def flight_recorder_env(environ: Mapping[str, str], torch_version: str) -> dict[str, str]:
    """The flight recorder's variables to set, under the name this torch reads; none the user set already."""
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    wanted = {
        FLIGHT_RECORDER_BUFFER[0 if release >= (2, 11) else 1]: "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    if any(name in environ for name in FLIGHT_RECORDER_BUFFER):
        wanted = {k: v for k, v in wanted.items() if k not in FLIGHT_RECORDER_BUFFER}
    return {name: value for name, value in wanted.items() if name not in environ}


def init_distributed(collective_timeout_s: float | None = None, sequence_parallel: int = 1) -> DistInfo:
    """gloo with DeepSpeed's CPU accelerator when there is no GPU, nccl on GPUs. `collective_timeout_s`: the
    process group's timeout (gloo's, NCCL's and DeepSpeed's), above the hang watchdog's allowance
    (observe/watchdog.collective_timeout_s) so the watchdog, not a 10-30 minute default, ends a hung run; None
    keeps the defaults (the watchdog is off). `sequence_parallel`: DistInfo's."""
    _require_launcher_env()
    deepspeed = startup.import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    local_rank = int(os.environ["LOCAL_RANK"])
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":
        os.environ.update(flight_recorder_env(os.environ, torch.__version__))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    from model_utils.launch import ops

    # Before the first op build (CPU ranks build DeepSpeed's shm comm op here): the checkout's ops dir, also for
    # a rank that no launcher of the kit started (accelerate launch, a bare torchrun).
    ops.prepare_jit_env()
    ops.build_ops(ops.comm_ops(device.type), device.type)  # a first build announced, with its time
    with startup.op_built_lines_dropped():  # each CPU rank's "... built successfully"
        timeout = {} if collective_timeout_s is None else {"timeout": timedelta(seconds=collective_timeout_s)}
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), **timeout)
    return DistInfo(
        rank=int(os.environ["RANK"]),
        local_rank=local_rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        device=device,
        sequence_parallel=sequence_parallel,
    )


def dump_collective_trace(info: DistInfo) -> str | None:
    """On a hang (the watchdog's verdict): this rank's NCCL flight recorder into a file next to the run's log,
    and where; None without NCCL (gloo keeps no such record)."""
    if info.device.type != "cuda":
        return None
    from model_utils import launch_env
    from model_utils.compat import torch_internals

    log = os.environ.get(launch_env.LOG_FILE)
    base = Path(log).with_suffix("") if log else Path(f"dskit-{os.getpid()}")
    path = base.parent / f"{base.name}.nccl-trace-rank{info.rank}.pkl"
    path.write_bytes(torch_internals.nccl_flight_record())
    return f"NCCL flight recorder written to {path} (read it with torch's fr_trace tool)"


def free_port() -> int:
    """A loopback port nothing listens on now: for a rendezvous started right after (bench, tools/)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Each of `values` summed over the ranks, in float64, in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()


def mean_and_max(
    means: list[float], maxima: list[float], device: torch.device
) -> tuple[list[float], list[float]]:
    """Across ranks, the mean of each of `means` and the largest of each of `maxima`, in one collective."""
    t = torch.tensor(means + maxima, dtype=torch.float64, device=device)
    world = torch.distributed.get_world_size()
    stacked = torch.empty(world * len(t), dtype=torch.float64, device=device)
    torch.distributed.all_gather_into_tensor(stacked, t)
    stacked = stacked.view(world, len(t))
    return stacked[:, : len(means)].mean(0).tolist(), stacked[:, len(means) :].amax(0).tolist()


def barrier() -> None:
    torch.distributed.barrier()


def main_first(fn: Callable[[], T], info: DistInfo) -> T:
    """Run `fn` on global rank 0 first, then on each other node's local rank 0, then everywhere else.

    `fn` builds a cache the later callers read. An error on rank 0 (bad data, say) stops every rank instead of
    leaving the others waiting in a barrier.
    """
    from model_utils.errors import ConfigError

    error: ConfigError | None = None
    result = None
    if info.rank == 0:
        try:
            result = fn()
        except ConfigError as e:
            error = e
    if any_rank([error is not None], info.device)[0]:
        raise error or ConfigError("preparing the data failed on rank 0 (its error is above)")
    if info.rank != 0 and info.local_rank == 0:
        result = fn()  # node-local caches: one build per node
    barrier()
    if info.local_rank != 0:
        result = fn()
    return result  # type: ignore[return-value]


def decide_on_main(fn: Callable[[], T], info: DistInfo) -> T:
    """Run `fn` on rank 0 only and give every rank its result (or its ConfigError): one decision, read once."""
    from model_utils.errors import ConfigError

    payload: list[object] = [None]
    if info.rank == 0:
        try:
            payload = [("ok", fn())]
        except ConfigError as e:
            payload = [("error", str(e))]
    torch.distributed.broadcast_object_list(payload, src=0)
    kind, value = payload[0]  # type: ignore[misc]
    if kind == "error":
        raise ConfigError(value)
    return value


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Element-wise OR of boolean flags across ranks (one collective for several decisions)."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [bool(v > 0) for v in t.tolist()]
