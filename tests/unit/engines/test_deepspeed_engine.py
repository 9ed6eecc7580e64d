"""DeepSpeed behind the seam, what can be checked without building an engine: the timers its wall-clock breakdown
reads are DeepSpeed 0.19's per-optimizer-step totals. The engine training, discarding steps, saving, resuming and
converting to a universal checkpoint: tests/e2e (test_training_runs.py, test_guarded_runs.py, test_checkpoints.py)."""

from __future__ import annotations

from model_utils.engines import deepspeed_engine
from model_utils.launch import startup


def test_the_wall_clock_breakdown_reads_deepspeeds_global_timers() -> None:
    startup.import_deepspeed()
    from deepspeed.runtime import engine

    timers = {name: value for name, value in vars(engine).items() if name.endswith("_TIMER")}
    global_timers = {value for name, value in timers.items() if name.endswith("_GLOBAL_TIMER")}
    # Summed over the micro-batches of one optimizer step; the *_microstep ones hold the last micro-batch only.
    assert set(deepspeed_engine.WALL_CLOCK_TIMERS) == global_timers
    assert not any(name.endswith("_microstep") for name in deepspeed_engine.WALL_CLOCK_TIMERS)


ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}


def test_cpu_ranks_take_torchs_adam_where_deepspeed_would_build_fused_adam(capsys) -> None:
    plain = {"optimizer": ADAMW, "zero_optimization": {"stage": 3}}
    cpu = deepspeed_engine.torch_adam_on_cpu(plain)
    assert cpu["optimizer"]["params"] == {**ADAMW["params"], "torch_adam": True}
    assert plain["optimizer"]["params"] == ADAMW["params"]  # the resolved config is not changed
    assert "Optimizer: torch.optim.AdamW on CPU ranks" in capsys.readouterr().out
    adam = deepspeed_engine.torch_adam_on_cpu(
        {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
    )
    assert adam["optimizer"]["params"]["torch_adam"] is True
    assert "torch.optim.Adam on CPU" in capsys.readouterr().out


def test_an_offloaded_optimizer_another_type_or_the_users_choice_is_left_alone(capsys) -> None:
    for ds in (
        {"optimizer": ADAMW, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        {"optimizer": ADAMW, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
        {"optimizer": {"type": "Lamb", "params": {}}},
        {"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}},
        {},
    ):
        assert deepspeed_engine.torch_adam_on_cpu(ds) is ds
    assert capsys.readouterr().out == ""
