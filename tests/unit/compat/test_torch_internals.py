"""torch's private parts the kit uses (compat/torch_internals.py): an upgrade that removes one fails here, by name."""

from __future__ import annotations

import torch

from model_utils.compat import torch_internals


def test_the_nccl_flight_recorder_is_there() -> None:
    from torch._C import _distributed_c10d

    assert callable(getattr(_distributed_c10d, "_dump_nccl_trace", None)), (
        f"torch {torch.__version__} has no torch._C._distributed_c10d._dump_nccl_trace: update "
        "src/model_utils/compat/torch_internals.py (the hang watchdog's NCCL trace)"
    )


def test_a_scheduler_positioned_by_hand_reports_its_lr() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert hasattr(scheduler, "_last_lr"), (
        f"torch {torch.__version__}'s LR schedulers keep no _last_lr: update src/model_utils/compat/torch_internals.py"
    )
    torch_internals.set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]
