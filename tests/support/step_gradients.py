"""One optimizer step of an engine on fixed rows with targets of very different lengths: its reported loss and the
gradients its optimizer is given, for the loss-over-the-step's-tokens checks (tests/e2e/test_step_loss.py).

    python tests/support/step_gradients.py ENGINE MICRO_BATCH ACCUMULATION OUT.pt [ZERO_STAGE [SEQUENCE_PARALLEL
    [OBJECTIVE]]] (under torchrun or run_ranks)

The ROWS rows are dealt to the ranks in order (rank r: rows r*mb*acc ... ), each rank's cut into ACCUMULATION
micro-batches of MICRO_BATCH rows; every layout of 8 rows covers the same step. fp32 throughout: DeepSpeed at
ZERO_STAGE (default 0; at 1-3 the gradients the optimizer steps with are partitioned, and gathered whole with
deepspeed.utils.safe_get_full_grad), FSDP2 with fp32 parameters. With SEQUENCE_PARALLEL N, groups of N ranks
share each row (DeepSpeed's Ulysses): the rows are dealt to the groups, each rank trains its slice of them. With
OBJECTIVE dpo, the step is of ROWS preference pairs (FixedPairs) under DPO, dealt as the rows are. Rank 0 saves {"loss": the mean of the ranks'
reported shares, "grads": {name: full gradient}} to OUT.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_utils.config.presets import PRESETS
from model_utils.data.rows import Rows
from model_utils.data.step_batches import Batch, gather
from model_utils.launch import distributed
from model_utils.optim.settings import OptimSettings

ROWS, SEQ = 8, 16


def step_rows() -> Rows:
    """8 rows of random tokens; each row's targets are its last k tokens, k from 15 (all but the first) to 1, so the
    micro-batches' target counts differ by an order of magnitude; rows 2 and 5 hold two documents each."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 2048, (ROWS, SEQ), dtype=np.int64)
    targets = np.zeros((ROWS, SEQ), dtype=bool)
    for row, k in enumerate((15, 1, 3, 12, 2, 15, 1, 7)):
        targets[row, SEQ - k :] = True
    positions = np.tile(np.arange(SEQ), (ROWS, 1))
    for row in (2, 5):
        positions[row, 6:] = np.arange(SEQ - 6)
        targets[row, 6] = False
    return Rows(tokens, targets, positions)


class FixedRows:
    seq_length = SEQ

    def __init__(self) -> None:
        self.all = step_rows()

    def __len__(self) -> int:
        return ROWS

    def rows(self, indices: np.ndarray) -> Rows:
        assert self.all.targets is not None and self.all.positions is not None
        return Rows(self.all.tokens[indices], self.all.targets[indices], self.all.positions[indices])


class FixedPairs:
    """ROWS preference pairs (--objective dpo): a prompt of 2 to 9 tokens, answers of 1 to 6 (so the pairs' target
    counts differ), a reference log-probability per sequence apart from the model's."""

    seq_length = SEQ

    def __init__(self) -> None:
        rng = np.random.default_rng(11)
        self.tokens = rng.integers(0, 2048, (2 * ROWS, SEQ), dtype=np.int64)
        self.targets = np.zeros((2 * ROWS, SEQ), dtype=bool)
        for pair in range(ROWS):
            prompt = int(rng.integers(2, 10))
            for row in (pair, ROWS + pair):
                self.targets[row, prompt : prompt + int(rng.integers(1, 7))] = True
        self.reference = rng.normal(-60.0, 5.0, 2 * ROWS).astype(np.float32)

    def __len__(self) -> int:
        return ROWS

    def rows(self, indices: np.ndarray) -> Rows:
        both = np.concatenate([indices, ROWS + np.asarray(indices)])
        return Rows(self.tokens[both], self.targets[both], paired=True, reference=self.reference[both])


def micro_batches(
    rank: int, micro: int, accumulation: int, shard: tuple[int, int] | None = None, source: Any = None
) -> list[Batch]:
    per_rank = micro * accumulation
    mine = np.arange(rank * per_rank, (rank + 1) * per_rank).reshape(accumulation, micro)
    return [gather(source or FixedRows(), indices, pin=False, shard=shard) for indices in mine]


def tiny_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(PRESETS["tiny-qwen3"].build_config(), attn_implementation="sdpa")


class NoSchedule:
    def torch_scheduler(self, optimizer: Any, total_steps: int) -> None:
        return None


def capture(
    optimizer: Any, module: torch.nn.Module, into: dict[str, torch.Tensor], zero_stage: int = 0
) -> None:
    """Record the gradients the optimizer steps with (full tensors: FSDP's or ZeRO's partitions gathered, every
    rank: the gathering is a collective)."""
    step = optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        for name, param in module.named_parameters():
            if zero_stage:
                from deepspeed.utils import safe_get_full_grad

                grad = safe_get_full_grad(param)
            else:
                grad = param.grad
            if grad is not None:
                full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                into[name.removeprefix("module.")] = full.detach().clone().float()
        return step(*args, **kwargs)

    optimizer.step = recording_step


def main() -> None:
    engine_name, micro, accumulation, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    zero_stage = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    group = int(sys.argv[6]) if len(sys.argv) > 6 else 1  # SEQUENCE_PARALLEL
    dpo = len(sys.argv) > 7 and sys.argv[7] == "dpo"  # OBJECTIVE: pairs (FixedPairs) under DPO
    dist = distributed.init_distributed(sequence_parallel=group)
    assert micro * accumulation * dist.data_ranks == ROWS, "a layout of the step's 8 rows"
    model = tiny_model()
    grads: dict[str, torch.Tensor] = {}
    if engine_name == "fsdp":
        from model_utils.engines import fsdp_engine, sequence_parallel

        if group > 1:  # as FsdpEngine.prepare_model does
            sequence_parallel.register(model, group, micro)
        model = fsdp_engine.shard(model, dist.device, bf16=False, cpu_offload=False)
        optim = OptimSettings("AdamW", 1e-3, None, None, 0.0, 0.0)
        engine: Any = fsdp_engine.FsdpEngine(
            model, optim, NoSchedule(), 1, [{"params": list(model.parameters())}], dist.device
        )  # type: ignore[arg-type]
        capture(engine._optimizer, engine.module, grads)
    else:
        from model_utils.engines.deepspeed_engine import DeepSpeedEngine

        ds = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": zero_stage},
            "gradient_clipping": 0.0,
        }
        engine = DeepSpeedEngine(model, ds, sequence_parallel=group)
        capture(engine._engine.optimizer, engine.module, grads, zero_stage)
    source = None
    if dpo:
        from model_utils.engines import preference

        engine.objective, source = preference.Preference(preference.Settings("dpo")), FixedPairs()
    engine.train()
    share, applied = engine.train_step(micro_batches(dist.data_rank, micro, accumulation, dist.shard, source))
    assert applied
    loss = torch.tensor([float(share)], dtype=torch.float64)
    torch.distributed.all_reduce(loss)
    if dist.is_main:
        torch.save({"loss": float(loss) / dist.world_size, "grads": grads}, out)
    torch.distributed.barrier()
    engine.close()


if __name__ == "__main__":
    main()
