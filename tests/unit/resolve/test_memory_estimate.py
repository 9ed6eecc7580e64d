"""A resolved run's memory estimate (resolve/memory_estimate.py): the model's shape counted on the meta device and
kept per config, the layout read from the DeepSpeed config (its bucket sizes), and the estimate a resolved training
config gives. The memory model itself: tests/unit/engines/test_memory.py and each engine's test file; `dskit
estimate`'s verdict, recommendation and command: tests/unit/dskit/test_estimate.py.
"""

from __future__ import annotations

import dataclasses

from model_utils.config.presets import PRESETS
from model_utils.resolve import memory_estimate


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


def test_a_preference_objectives_micro_batch_is_two_sequences_a_pair() -> None:
    """--objective dpo: a micro batch of 2 pairs is 4 sequences in one forward, as 4 sequences of the next-token
    loss are (the activations the doctor and the CUDA config choice count)."""
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import resolver

    def layout(*flags: str, on_gpus: bool = False):
        cfg = parse_args(["--model", "tiny-qwen3", "--seq_length", "128", *flags])
        settings = resolver.resolve_settings(cfg)
        return memory_estimate.estimate_for_config(settings, nodes=1, ranks_per_node=2, on_gpus=on_gpus)

    pairs, rows = layout("--micro_batch_size", "2", "--objective", "dpo"), layout("--micro_batch_size", "4")
    assert pairs.layout.micro_batch_size == 2 and pairs.layout.pairs
    assert pairs.device_bytes_per_rank == rows.device_bytes_per_rank  # CPU ranks: no Liger either way
    assert any("2 pairs x 2 x 128 tokens" in line.how for line in pairs.device_lines), pairs.device_lines
    # On GPUs Liger's fused loss spares the logits of the next-token loss, never a preference objective's.
    gpu_pairs = layout("--micro_batch_size", "2", "--objective", "dpo", on_gpus=True)
    gpu_rows = layout("--micro_batch_size", "4", on_gpus=True)
    assert gpu_pairs.device_bytes_per_rank > gpu_rows.device_bytes_per_rank


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
