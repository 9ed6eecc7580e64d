"""ZeRO layouts for the memory estimate's tests (the runtime's model in engines/memory.py and each engine's module,
a run's estimate in resolve/memory_estimate.py, the `dskit estimate` command that renders it): the `shapes` fixture
is in tests/unit/conftest.py."""

from __future__ import annotations

from model_utils.engines.memory import ZeroLayout


def layout(stage: int, offload: str, **kw) -> ZeroLayout:
    """2 nodes x 8 GPUs, micro batch 1 x 2048 tokens, overlap_comm: the cases DeepSpeed's estimators cover."""
    values = dict(micro_batch_size=1, seq_length=2048, nodes=2, ranks_per_node=8, overlap_comm=True)
    values.update(kw)
    return ZeroLayout(
        stage=stage,
        offload_optimizer=offload != "none",
        offload_params=offload == "optimizer+params",
        **values,
    )


def checkpointing_layout(micro_batch_size: int = 1, seq_length: int = 2048, **kw) -> ZeroLayout:
    """1 node x 8 GPUs, ZeRO-2 without offload: what the activation checkpointing levels are compared on."""
    values = dict(
        stage=2,
        offload_optimizer=False,
        offload_params=False,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        nodes=1,
        ranks_per_node=8,
    )
    return ZeroLayout(**{**values, **kw})
