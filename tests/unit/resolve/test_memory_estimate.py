"""The memory model (resolve/memory_estimate.py): model states against DeepSpeed's own estimators and printed
tables, host RAM per node and per rank, activations against a traced forward and backward (with each activation
checkpointing level), Liger's smaller activations and loss, bucket sizes from the DeepSpeed config, FSDP2's
shards, and the estimate a resolved training config gives. `dskit estimate`'s verdict, recommendation and
command: tests/unit/dskit/test_estimate.py.

Models are counted on the meta device or traced with fake tensors: nothing is downloaded, nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import io
import re
from contextlib import redirect_stdout

import pytest

from model_utils.config.presets import PRESETS
from model_utils.model import activation_checkpointing as ac
from model_utils.resolve import memory_estimate
from model_utils.resolve.memory_estimate import GiB
from support.estimates import checkpointing_layout, layout
from support.traced_memory import traced_activation_peak

LEVELS = ("none", "full", "every_2")  # activation checkpointing

# (ZeRO stage, offload) pairs DeepSpeed's estimators cover.
DS_CASES = [(2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")]


def deepspeed_estimate(
    shape: memory_estimate.ModelShape, stage: int, offload: str, nodes: int, gpus: int
) -> tuple[int, int]:
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


def test_model_shapes(shapes) -> None:
    qwen = shapes["qwen3-0.6b"]
    assert 590e6 < qwen.total_params < 600e6  # tied embeddings counted once
    assert qwen.largest_layer_params == qwen.largest_param == 151936 * 1024  # the embedding / lm_head
    assert qwen.qk_norm and (qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (16, 8, 128)
    assert 100_000 < shapes["tiny-qwen3"].total_params < 1_000_000


def test_a_shape_counted_once_is_read_from_the_cache_for_that_config_alone(
    shapes, tmp_path, monkeypatch
) -> None:
    """The preflight's counts kept in <data_cache_dir>/model-shapes: a later launch of the same config reads them
    instead of importing transformers' modeling code; another config, a damaged file or a model with its own code
    (auto_map) is counted again."""
    config = PRESETS["tiny-qwen3"].build_config()
    first = memory_estimate.model_shape(config, "tiny-qwen3", True, cache_dir=tmp_path)
    assert first == shapes["tiny-qwen3"]
    (kept,) = (tmp_path / memory_estimate.SHAPE_CACHE).iterdir()
    counted: list[object] = []
    count = memory_estimate._count_on_meta
    monkeypatch.setattr(memory_estimate, "_count_on_meta", lambda c: counted.append(c) or count(c))
    again = memory_estimate.model_shape(config, "tiny-qwen3", False, dtype_bytes=2, cache_dir=tmp_path)
    assert again == dataclasses.replace(first, build_bytes_per_param=2) and counted == []
    wider = PRESETS["tiny-qwen3"].build_config()
    wider.intermediate_size *= 2
    assert memory_estimate.model_shape(wider, "w", True, cache_dir=tmp_path).total_params > first.total_params
    assert len(counted) == 1 and len(list(kept.parent.iterdir())) == 2
    kept.write_text("{not json")
    assert memory_estimate.model_shape(config, "tiny-qwen3", True, cache_dir=tmp_path) == first
    assert len(counted) == 2 and '"total_params"' in kept.read_text()  # counted and kept again
    config.auto_map = {"AutoModelForCausalLM": "modeling_mine.Mine"}
    memory_estimate._cached_counts(config, tmp_path)
    assert len(counted) == 3 and len(list(kept.parent.iterdir())) == 2


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "tiny-qwen3"])
@pytest.mark.parametrize(("stage", "offload"), DS_CASES)
def test_model_states_agree_with_deepspeeds_estimators(shapes, preset: str, stage: int, offload: str) -> None:
    shape = shapes[preset]
    mine = memory_estimate.estimate(shape, layout(stage, offload))
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
        mine = memory_estimate.estimate(shape, layout(stage, offload))
        assert mine.model_states_device_bytes / GiB == pytest.approx(ds_gpu, rel=0.10), key
        if (stage, offload) != (2, "optimizer"):  # per node, not per cluster: see deepspeed_estimate
            assert mine.model_states_host_bytes_per_node / GiB == pytest.approx(ds_cpu, rel=0.10), key


def test_host_ram_per_node_does_not_grow_with_nodes(shapes) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = shapes["qwen3-0.6b"]
    one, two = (memory_estimate.estimate(shape, layout(2, "optimizer", nodes=n)) for n in (1, 2))
    assert one.model_states_host_bytes_per_node == two.model_states_host_bytes_per_node  # the model build
    assert two.host_offload < one.host_offload  # each rank's optimizer partition halves
    ds_one, ds_two = (
        estimate_zero2_model_states_mem_needs(shape.total_params, 8, n, cpu_offload=True)[0] for n in (1, 2)
    )
    assert ds_two == 2 * ds_one  # DeepSpeed's code grows with the cluster; its documentation does not


def test_offloaded_optimizer_fills_host_ram_per_rank(shapes) -> None:
    """Pinned buffers per rank x ranks per node: what runs hosts out of memory with ZeRO CPU offload."""
    shape = shapes["qwen3-0.6b"]
    single = memory_estimate.estimate(shape, layout(2, "optimizer", nodes=1, ranks_per_node=1))
    P = shape.total_params
    # fp32 master 2.4 GB and fp32 gradients 2.4 GB pinned (4 GiB each once rounded to a power of two), the bf16
    # copy 1.2 GB (2 GiB), the 311 MB staging buffer (512 MiB), and Adam's m and v in ordinary memory.
    assert single.host_offload == 4 * GiB + 4 * GiB + 2 * GiB + GiB // 2 + 8 * P
    unpinned = memory_estimate.estimate(shape, dataclasses.replace(single.layout, pin_memory=False))
    assert unpinned.host_offload == 18 * P + 2 * shape.largest_param
    eight = memory_estimate.estimate(shape, layout(2, "optimizer", nodes=1, ranks_per_node=8))
    assert eight.host_bytes_per_node == max(eight.host_model_build, eight.host_offload) + 8 * 2 * GiB
    accumulating = memory_estimate.estimate(
        shape, dataclasses.replace(single.layout, gradient_accumulation_steps=4)
    )
    assert accumulating.host_offload > single.host_offload  # gradients accumulate on the CPU too


def test_activations_match_a_traced_forward_and_backward(shapes) -> None:
    config = PRESETS["qwen3-0.6b"].build_config()
    config.num_hidden_layers = 2  # the real layer, fewer of them: the trace stays a few seconds
    shape = dataclasses.replace(shapes["qwen3-0.6b"], num_layers=2)
    lay = layout(2, "none", micro_batch_size=2, seq_length=256)
    mine = memory_estimate.estimate(shape, lay)
    traced = traced_activation_peak(config, batch=2, seq=256)
    assert mine.activations + mine.logits == pytest.approx(traced, rel=0.01)
    # The logits are most of it at this size: 12 bytes per token and vocabulary entry, not the bf16 2.
    assert mine.logits == 2 * 256 * (2 * 1024 + 12 * 151936)


def test_liger_kernels_keep_fewer_activations(shapes) -> None:
    """Liger's kernels are Triton GPU kernels: counted from their save_for_backward calls, not traced here."""
    shape = shapes["qwen3-0.6b"]
    eager = memory_estimate.estimate(shape, layout(2, "none"))
    liger = memory_estimate.estimate(shape, layout(2, "none", liger=True))
    # Per layer: norms keep their bf16 input and a fp32 1/rms, SwiGLU recomputes the SiLU.
    assert memory_estimate.layer_bytes_per_token(shape, 2, liger=True) == 45_224
    assert memory_estimate.layer_bytes_per_token(shape, 2, liger=False) == 71_744
    # The fused linear cross-entropy never materialises the 2048 x 151936 logits: one 16-row chunk.
    assert memory_estimate.flce_chunk_rows(2048, shape) == 16
    assert liger.logits == 2048 * (2 * 1024 + 4) + 16 * 151936 * 2
    assert liger.device_bytes_per_rank < eager.device_bytes_per_rank - 4 * GiB
    # Under ZeRO-3 the kit turns the fused loss off (lm_head.weight is a shard); torch.compile keeps at most
    # what eager keeps.
    zero3 = memory_estimate.estimate(shape, layout(3, "none", liger=True))
    assert zero3.logits == memory_estimate.estimate(shape, layout(3, "none")).logits
    assert zero3.activations == liger.activations
    compiled = memory_estimate.estimate(shape, layout(2, "none", liger=True, compile=True))
    assert compiled.activations == eager.activations and compiled.logits == liger.logits


def test_estimate_for_config_reads_the_training_config() -> None:
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import resolver

    cfg = parse_args(["--model", "tiny-qwen3", "--micro_batch_size", "4", "--seq_length", "128"])
    settings = resolver.resolve_settings(cfg)  # what doctor and estimate read, as the trainer does
    e = memory_estimate.estimate_for_config(settings, nodes=2, ranks_per_node=4)
    lay = e.layout
    assert (lay.stage, lay.offload, lay.micro_batch_size, lay.seq_length) == (2, "optimizer", 4, 128)
    assert (lay.nodes, lay.ranks_per_node, lay.overlap_comm, lay.pin_memory) == (2, 4, True, True)
    assert e.device_bytes_per_rank == sum(line.bytes for line in e.device_lines)
    assert e.host_bytes_per_node == max(e.host_model_build, e.host_offload) + e.host_processes
    # GPU ranks use Liger for a model it covers (--liger auto); CPU ranks never do, so their activations
    # include the full logits.
    on_cpu = memory_estimate.estimate_for_config(settings, nodes=2, ranks_per_node=4, on_gpus=False)
    assert (lay.liger, on_cpu.layout.liger) == (True, False)
    assert on_cpu.device_bytes_per_rank > e.device_bytes_per_rank


def test_bucket_sizes_come_from_the_deepspeed_config(shapes) -> None:
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": True}}
    base = dict(micro_batch_size=1, seq_length=256, gradient_accumulation_steps=1, nodes=1, ranks_per_node=8)
    default = memory_estimate.layout_from_deepspeed(ds, "ds.json", **base)
    ds["zero_optimization"]["reduce_bucket_size"] = 50_000_000
    smaller = memory_estimate.layout_from_deepspeed(ds, "ds.json", **base)
    assert (default.reduce_bucket_size, smaller.reduce_bucket_size) == (
        500_000_000,
        50_000_000,
    )  # DeepSpeed's
    shape = shapes["tiny-qwen3"]
    saved = (
        memory_estimate.estimate(shape, default).buffers - memory_estimate.estimate(shape, smaller).buffers
    )
    assert saved == 2 * 2 * 450_000_000  # two buckets (overlap_comm), bf16
    ds["zero_optimization"]["overlap_comm"] = False
    single = memory_estimate.layout_from_deepspeed(ds, "ds.json", **base)
    assert (
        memory_estimate.estimate(shape, smaller).buffers - memory_estimate.estimate(shape, single).buffers
        == 2 * 50_000_000
    )


def test_fsdp_shards_every_model_state_and_offload_moves_them_to_the_host(shapes) -> None:
    """--backend fsdp: 16 bytes per parameter / N (fp32 master, gradient, Adam m and v) plus two gathered layers
    and one unsharded fp32 layer gradient; --fsdp_cpu_offload leaves only the gathered layers on the GPU."""
    shape = shapes["qwen3-0.6b"]
    P, L = shape.total_params, shape.largest_layer_params
    for gpus in (8, 16):
        lay = layout(0, "none", nodes=1, ranks_per_node=gpus, backend="fsdp")
        e = memory_estimate.estimate(shape, lay)
        shard = -(-P // gpus)
        assert (e.parameters, e.gradients, e.optimizer_states) == (
            4 * shard + 4 * L,
            4 * shard + 4 * L,
            8 * shard,
        )
        assert e.buffers == 0 and lay.describe() == "FSDP2, no offload, micro batch 1"
    off = memory_estimate.estimate(shape, layout(0, "optimizer", nodes=1, ranks_per_node=8, backend="fsdp"))
    assert (off.parameters, off.gradients, off.optimizer_states) == (4 * L, 4 * L, 0)
    assert off.host_offload == 8 * 16 * -(-P // 8)
    accumulated = memory_estimate.estimate(
        shape, layout(0, "none", nodes=1, ranks_per_node=8, backend="fsdp", gradient_accumulation_steps=4)
    )
    assert (
        accumulated.gradients == 4 * -(-P // 8) + 4 * L + 2 * P
    )  # the unsharded bf16 gradients between micro-batches


def activations(shape: memory_estimate.ModelShape, value: str, **kw) -> int:
    return memory_estimate.estimate(
        shape, checkpointing_layout(activation_checkpointing=value, **kw)
    ).activations


@pytest.mark.parametrize("preset", ["tiny-qwen3", "qwen3-0.6b"])
@pytest.mark.parametrize("micro_batch", [1, 8])
def test_estimate_activation_memory_per_level(shapes, preset: str, micro_batch: int) -> None:
    shape = shapes[preset]
    got = {v: activations(shape, v, micro_batch_size=micro_batch) for v in LEVELS}
    assert got["full"] < got["every_2"] < got["none"]
    tokens, b, h = micro_batch * 2048, 2, shape.hidden_size
    per_layer, final_norm = memory_estimate.layer_bytes_per_token(shape, b), (4 + b) * h
    assert got["none"] == tokens * (shape.num_layers * per_layer + final_norm)
    # full: each layer's input is kept; with the eager loss the logits are the peak, not the top recompute.
    assert got["full"] == tokens * (shape.num_layers * b * h + final_norm)
    # every_2: half the layers keep everything, the other half their input.
    half = shape.num_layers // 2
    assert got["every_2"] == tokens * (half * per_layer + half * b * h + final_norm)


def test_estimate_figures_for_qwen3(shapes) -> None:
    """The figures docs/estimate-and-doctor.md quotes: seq 2048, bf16, eager and Liger."""
    shape = shapes["qwen3-0.6b"]
    gib = {
        (v, mb, liger): round(activations(shape, v, micro_batch_size=mb, liger=liger) / GiB, 2)
        for v in LEVELS
        for mb in (1, 8)
        for liger in (False, True)
    }
    assert gib == {
        ("none", 1, False): 3.84, ("none", 8, False): 30.75,
        ("every_2", 1, False): 1.98, ("every_2", 8, False): 15.86,
        ("full", 1, False): 0.12, ("full", 8, False): 0.97,
        # Liger's small fused loss: the top layer's backward (its recompute with full) is the peak.
        ("none", 1, True): 2.42, ("none", 8, True): 19.35,
        ("every_2", 1, True): 1.31, ("every_2", 8, True): 10.50,
        ("full", 1, True): 0.25, ("full", 8, True): 1.97,
    }  # fmt: skip


def traced_peak(config, value: str, batch: int, seq: int) -> int:
    """The traced peak with checkpointing `value`, and the parameters' gradients dropped as they are produced
    (DeepSpeed moves them into its buckets, which the estimate counts apart)."""

    def prepare(model) -> None:
        ac.apply(model.train(), value, announce=False)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))

    return traced_activation_peak(config, batch, seq, prepare)


# MemTracker notes the parameters' gradients the hooks set to None.
@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass:UserWarning")
@pytest.mark.parametrize("vocab", [151936, 1024])
@pytest.mark.parametrize("value", ["full", "every_2", "every_3"])
def test_estimate_matches_a_traced_forward_and_backward(shapes, vocab: int, value: str) -> None:
    """Qwen3-0.6B's layers, 4 of them: every_2 leaves the top layer alone, every_3 and full recompute it. With
    its real vocabulary the logits are the peak; with a small one the top layer's backward is."""
    config = PRESETS["qwen3-0.6b"].build_config()
    config.num_hidden_layers, config.vocab_size = 4, vocab
    shape = dataclasses.replace(shapes["qwen3-0.6b"], num_layers=4, vocab_size=vocab)
    mine = memory_estimate.estimate(
        shape, checkpointing_layout(micro_batch_size=2, seq_length=256, activation_checkpointing=value)
    )
    assert mine.activations + mine.logits == pytest.approx(traced_peak(config, value, 2, 256), rel=0.05)
