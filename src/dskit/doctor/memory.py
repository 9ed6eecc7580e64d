"""Memory: `dskit estimate`'s host RAM per node and device memory per rank for this config, against this node's RAM
and its smallest GPU.
"""

from __future__ import annotations

from typing import Any

from .context import GpuProbe, LaunchContext, _size, ranks_per_node
from .report import Result, Status


def check_memory(settings: Any, ctx: LaunchContext, gpus: GpuProbe) -> tuple[Result, Result]:
    """(host RAM, GPU memory): the estimate for this config against this node."""
    import psutil

    from dskit.estimate import estimate_for_config

    ranks, on_gpus = ranks_per_node(ctx, gpus)
    estimate = estimate_for_config(settings, nodes=ctx.nodes, ranks_per_node=ranks, on_gpus=on_gpus)
    vm = psutil.virtual_memory()
    need = estimate.host_bytes_per_node
    found = (
        f"needs ~{_size(need)} per node ({ctx.nodes} node{'s' if ctx.nodes > 1 else ''} x {ranks} ranks), "
        f"{_size(vm.total)} total, {_size(vm.available)} available"
    )
    fix = (
        "more nodes (ZeRO shards the offloaded optimizer), a smaller --micro_batch_size or fewer CPU_RANKS, "
        "or nodes with more RAM; `dskit estimate` suggests a config that fits"
    )
    if need > vm.total:
        host = Result("host RAM", Status.FAIL, found, fix)
    elif need > vm.available:
        host = Result(
            "host RAM", Status.WARN, found + ": other processes hold the rest", "stop them, or " + fix
        )
    else:
        host = Result("host RAM", Status.PASS, found)
    if not on_gpus:
        return host, Result("GPU memory", Status.SKIP, "CPU ranks")
    per_rank = estimate.device_bytes_per_rank
    if gpus.memory_bytes is None:
        return host, Result("GPU memory", Status.WARN, f"needs ~{_size(per_rank)} per GPU; size unknown", "")
    found = f"needs ~{_size(per_rank)} per GPU, {_size(gpus.memory_bytes)} each"
    fix = (
        "ZeRO-3 (--deepspeed_config deepspeed/ds_config_zero3.json), a smaller --micro_batch_size or "
        "--seq_length; `dskit estimate` suggests a config that fits"
    )
    if per_rank > gpus.memory_bytes:
        return host, Result("GPU memory", Status.FAIL, found, fix)
    if per_rank > 0.9 * gpus.memory_bytes:
        return host, Result("GPU memory", Status.WARN, found + ": under 10% headroom", fix)
    return host, Result("GPU memory", Status.PASS, found)
