"""DeepSpeed behind the seam, what can be checked without building an engine: the timers its wall-clock breakdown
reads are DeepSpeed 0.19's per-optimizer-step totals; its memory model (estimate_zero) agrees with DeepSpeed's own
estimators within 10% and counts the host RAM its offload pins per rank. The engine training, discarding steps, saving, resuming and
converting to a universal checkpoint: tests/e2e (test_training_runs.py, test_guarded_runs.py, test_checkpoints.py)."""

from __future__ import annotations

import dataclasses
import io
import re
from contextlib import redirect_stdout

import pytest

from model_utils.engines import deepspeed_engine
from model_utils.engines.memory import GiB, ModelShape
from model_utils.launch import startup
from support.estimates import layout


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


# --- the memory model: ZeRO's model states against DeepSpeed's own estimators ---

# (ZeRO stage, offload) pairs DeepSpeed's estimators cover.
DS_CASES = [(2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")]


def deepspeed_estimate(shape: ModelShape, stage: int, offload: str, nodes: int, gpus: int) -> tuple[int, int]:
    """(host bytes per node, GPU bytes) from DeepSpeed's own estimator functions."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if stage == 2:
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            shape.total_params, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=offload != "none"
        )
        if offload != "none":
            # DeepSpeed's code multiplies by 4 * total_gpus here, its documentation (memory.rst) by n_gpus, the
            # GPUs of one node: every process of the node builds the model on the CPU. Nothing in
            # stage_1_and_2.py allocates host RAM per GPU of other nodes, so the per-node figure is the one to
            # compare with; test_host_ram_per_node_does_not_grow_with_nodes pins that behaviour.
            cpu, _ = estimate_zero2_model_states_mem_needs(
                shape.total_params, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=True
            )
        return cpu, gpu
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        shape.total_params,
        shape.largest_layer_params,
        num_gpus_per_node=gpus,
        num_nodes=nodes,
        cpu_offload=offload != "none",
        cpu_offload_params=offload == "optimizer+params",
        zero_init=False,  # the kit builds the whole model in every process (models.build_model)
    )
    return cpu, gpu


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "tiny-qwen3"])
@pytest.mark.parametrize(("stage", "offload"), DS_CASES)
def test_model_states_agree_with_deepspeeds_estimators(shapes, preset: str, stage: int, offload: str) -> None:
    shape = shapes[preset]
    mine = deepspeed_engine.estimate_zero(shape, layout(stage, offload))
    ds_cpu, ds_gpu = deepspeed_estimate(shape, stage, offload, nodes=2, gpus=8)
    assert mine.model_states_device_bytes == pytest.approx(ds_gpu, rel=0.10)
    assert mine.model_states_host_bytes_per_node == pytest.approx(ds_cpu, rel=0.10)


def test_model_states_agree_with_deepspeeds_printed_tables(shapes) -> None:
    """The `_all_cold` functions print a table per ZeRO stage: the same figures, in GiB with 2 decimals."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    shape = shapes["qwen3-0.6b"]
    out = io.StringIO()
    with redirect_stdout(out):
        estimate_zero2_model_states_mem_needs_all_cold(shape.total_params, num_gpus_per_node=8, num_nodes=2)
        estimate_zero3_model_states_mem_needs_all_cold(
            shape.total_params, shape.largest_layer_params, num_gpus_per_node=8, num_nodes=2
        )
    rows = re.findall(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.+)$", out.getvalue(), re.M)
    # Options read "offload_optimizer=cpu" or, on Python 3.11, "offload_optimizer=OffloadDeviceEnum.cpu".
    table = {
        options.replace(" ", "").replace("OffloadDeviceEnum.", ""): (float(cpu), float(gpu))
        for cpu, gpu, options in rows
    }
    keys = {
        (2, "none"): "offload_optimizer=none",
        (2, "optimizer"): "offload_optimizer=cpu",
        (3, "none"): "offload_param=none,offload_optimizer=none,zero_init=0",
        (3, "optimizer"): "offload_param=none,offload_optimizer=cpu,zero_init=0",
        (3, "optimizer+params"): "offload_param=cpu,offload_optimizer=cpu,zero_init=0",
    }
    for (stage, offload), key in keys.items():
        ds_cpu, ds_gpu = table[key]
        mine = deepspeed_engine.estimate_zero(shape, layout(stage, offload))
        assert mine.model_states_device_bytes / GiB == pytest.approx(ds_gpu, rel=0.10), key
        if (stage, offload) != (2, "optimizer"):  # per node, not per cluster: see deepspeed_estimate
            assert mine.model_states_host_bytes_per_node / GiB == pytest.approx(ds_cpu, rel=0.10), key


def test_host_ram_per_node_does_not_grow_with_nodes(shapes) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = shapes["qwen3-0.6b"]
    one, two = (deepspeed_engine.estimate_zero(shape, layout(2, "optimizer", nodes=n)) for n in (1, 2))
    assert one.model_states_host_bytes_per_node == two.model_states_host_bytes_per_node  # the model build
    assert two.host_offload < one.host_offload  # each rank's optimizer partition halves
    ds_one, ds_two = (
        estimate_zero2_model_states_mem_needs(shape.total_params, 8, n, cpu_offload=True)[0] for n in (1, 2)
    )
    assert ds_two == 2 * ds_one  # DeepSpeed's code grows with the cluster; its documentation does not


def test_offloaded_optimizer_fills_host_ram_per_rank(shapes) -> None:
    """Pinned buffers per rank x ranks per node: what runs hosts out of memory with ZeRO CPU offload."""
    shape = shapes["qwen3-0.6b"]
    single = deepspeed_engine.estimate_zero(shape, layout(2, "optimizer", nodes=1, ranks_per_node=1))
    P = shape.total_params
    # fp32 master 2.4 GB and fp32 gradients 2.4 GB pinned (4 GiB each once rounded to a power of two), the bf16
    # copy 1.2 GB (2 GiB), the 311 MB staging buffer (512 MiB), and Adam's m and v in ordinary memory.
    assert single.host_offload == 4 * GiB + 4 * GiB + 2 * GiB + GiB // 2 + 8 * P
    unpinned = deepspeed_engine.estimate_zero(shape, dataclasses.replace(single.layout, pin_memory=False))
    assert unpinned.host_offload == 18 * P + 2 * shape.largest_param
    eight = deepspeed_engine.estimate_zero(shape, layout(2, "optimizer", nodes=1, ranks_per_node=8))
    assert eight.host_bytes_per_node == max(eight.host_model_build, eight.host_offload) + 8 * 2 * GiB
    accumulating = deepspeed_engine.estimate_zero(
        shape, dataclasses.replace(single.layout, gradient_accumulation_steps=4)
    )
    assert accumulating.host_offload > single.host_offload  # gradients accumulate on the CPU too
