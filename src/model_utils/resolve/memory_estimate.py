"""GPU memory and host RAM of a DeepSpeed ZeRO (or FSDP2) run: the memory model of `dskit estimate`.

The byte counts follow what DeepSpeed 0.19 allocates (runtime/zero/stage_1_and_2.py, stage3.py) for the way the
kit trains: a Hugging Face causal LM in bf16, built in full in every process (no zero.Init), AdamW, and the loss
of transformers' ForCausalLMLoss (or Liger's kernels). The model states (parameters, gradients, optimizer
states) follow DeepSpeed's own estimators, estimate_zero2_model_states_mem_needs and
estimate_zero3_model_states_mem_needs, within 10% for the configurations tests/unit/resolve/test_memory_estimate.py
compares; each place that counts differently says why. Activations are counted per saved tensor and checked
against a traced forward and backward.

A model_utils module because a training rank needs it too: on CUDA the kit's default DeepSpeed config is the
GPU-only one where this estimate says it fits (preflight); `dskit estimate` (dskit/estimate.py) renders it and
recommends a layout that fits.

Which model applies is the engine's to say (its estimate_memory and describe_layout, engines/): a layout names
its engine (`backend`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils import engines
from model_utils.config.arguments import every_n_layers
from model_utils.errors import ConfigError, first_line
from model_utils.launch import startup
from model_utils.model.activation_checkpointing import checkpointed_layers

GiB = 2**30
OFFLOADS = ("none", "optimizer", "optimizer+params")
# DeepSpeed's additional_buffer_factor for host RAM. Building Qwen3-0.6B with from_config on the CPU peaks at
# 1.36x its fp32 size (initialisation temporaries, then the per-parameter cast to bf16 in deepspeed.initialize).
BUILD_BUFFER_FACTOR = 1.5
# Resident memory of one training process besides the model: Python, PyTorch, the CUDA libraries, DeepSpeed,
# the tokenizer and the packed data. Approximate; it does not depend on the model.
PROCESS_BASELINE_BYTES = 2 * GiB
# GPU memory outside PyTorch's allocator: the CUDA context and NCCL's communication buffers. Approximate.
CUDA_RUNTIME_BYTES = 1 * GiB
# A configuration "fits" with this much of the memory used; the rest is headroom for allocator fragmentation.
FIT_FRACTION = 0.9
MAX_MICRO_BATCH = 64
# fp32 log-softmax saved for backward, its incoming gradient and the gradient it produces, all alive at the
# start of backward (bytes per token per vocab entry). The forward peak is lower: the bf16 logits (2), their
# fp32 upcast in ForCausalLMLoss (4) and the log-softmax (4). Measured in
# tests/unit/resolve/test_memory_estimate.py.
LOGITS_PEAK_BYTES = 12


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model, counted on the meta device (no weights are loaded)."""

    name: str
    total_params: int  # tied parameters once, as DeepSpeed's model_to_params counts them
    largest_layer_params: int  # the largest module's own parameters: what ZeRO-3 gathers at once
    largest_param: int  # the largest single tensor: DeepSpeed's offload staging buffers are this size
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    qk_norm: bool
    # Bytes per parameter of the model each process builds on the CPU before deepspeed.initialize: presets are
    # built with from_config (fp32); pretrained models load directly in the training dtype (models.build_model).
    build_bytes_per_param: int
    # LoRA (--lora_r): the parameters that train (adapters and --lora_modules_to_save), and the largest of them.
    # Only these have gradients and optimizer states; the frozen base is parameters alone. None: all train.
    trainable_params: int | None = None
    largest_trainable_param: int | None = None


def model_shape(
    model_config: Any,
    name: str,
    built_from_config: bool,
    dtype_bytes: int = 2,
    cache_dir: Path | None = None,
) -> ModelShape:
    """The model's shape, its parameters counted on the meta device. With `cache_dir` (a run's --data_cache_dir),
    the counts an earlier process made for the same config and transformers version are read from there: the count
    itself is quick, but importing transformers' modeling code for it made the preflight 4.5 s instead of 2.9 s on
    2 cores, at every launch and requeue (docs/speed.md)."""
    counted = _cached_counts(model_config, cache_dir)
    hidden = int(model_config.hidden_size)
    heads = int(model_config.num_attention_heads)
    return ModelShape(
        name=name,
        total_params=counted["total_params"],
        largest_layer_params=counted["largest_layer_params"],
        largest_param=counted["largest_param"],
        num_layers=int(model_config.num_hidden_layers),
        hidden_size=hidden,
        intermediate_size=int(getattr(model_config, "intermediate_size", None) or 4 * hidden),
        num_heads=heads,
        num_kv_heads=int(getattr(model_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(model_config, "head_dim", None) or hidden // heads),
        vocab_size=int(model_config.vocab_size),
        qk_norm=counted["qk_norm"],
        build_bytes_per_param=4 if built_from_config else dtype_bytes,
    )


SHAPE_CACHE = "model-shapes"  # <data_cache_dir>/model-shapes/<key>.json
_COUNTS = ("total_params", "largest_layer_params", "largest_param", "qk_norm")


def _count_on_meta(model_config: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    params = list(model.parameters())  # yields a tied (shared) parameter once
    return {
        "total_params": sum(p.numel() for p in params),
        "largest_layer_params": max(
            sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
        ),
        "largest_param": max(p.numel() for p in params),
        "qk_norm": any(n.endswith(("q_norm", "k_norm")) for n, _ in model.named_modules()),
    }


def _cached_counts(model_config: Any, cache_dir: Path | None) -> dict[str, Any]:
    """The meta-device counts, kept per config and transformers version. A model with its own code (auto_map) is
    always counted: its code can change under the same config. A cache that cannot be read or written costs the
    count, never the launch."""
    if cache_dir is None or getattr(model_config, "auto_map", None):
        return _count_on_meta(model_config)
    import transformers

    key_text = json.dumps([transformers.__version__, model_config.to_dict()], sort_keys=True, default=str)
    path = cache_dir / SHAPE_CACHE / f"{hashlib.sha256(key_text.encode()).hexdigest()[:24]}.json"
    from model_utils.storage.file_manifest import kept_json

    return kept_json(
        path,
        lambda: _count_on_meta(model_config),
        lambda kept: isinstance(kept, dict) and set(kept) == set(_COUNTS),
    )


def check_zero(stage: int, offload_optimizer: bool, offload_params: bool) -> None:
    """A ZeRO stage and offload DeepSpeed can run."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero_stage {stage} is not a ZeRO stage: use 0, 1, 2 or 3")
    if offload_optimizer and stage == 0:
        raise ConfigError("optimizer offload needs ZeRO: use --zero_stage 1, 2 or 3, or --offload none")
    if offload_params and stage != 3:
        raise ConfigError(
            f"parameter offload (--offload optimizer+params, or offload_param in the DeepSpeed config) needs "
            f"ZeRO stage 3, not {stage}: use --zero_stage 3 or --offload optimizer"
        )


@dataclass(frozen=True)
class ZeroLayout:
    """How a run is laid out: ZeRO stage, offload, batch shape, DeepSpeed buffer sizes and the cluster."""

    stage: int
    offload_optimizer: bool
    offload_params: bool
    micro_batch_size: int
    seq_length: int
    nodes: int
    ranks_per_node: int
    gradient_accumulation_steps: int = 1
    dtype_bytes: int = 2  # bf16 / fp16; 4 for fp32 training
    pin_memory: bool = True
    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    sub_group_size: int = 1_000_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    liger: bool = False  # Liger's Triton kernels (--liger), which keep fewer activations
    compile: bool = False  # torch.compile (--compile)
    activation_checkpointing: str = "none"  # --activation_checkpointing: none, full or every_N
    # The engine (--backend). One without ZeRO stages (FSDP2) has stage 0 here, and offload_optimizer is its one
    # offload switch (--fsdp_cpu_offload, which moves all sharded state).
    backend: str = engines.DEFAULT

    def __post_init__(self) -> None:
        if engines.engine_class(self.backend).zero_stages:
            check_zero(self.stage, self.offload_optimizer, self.offload_params)
        every_n_layers(self.activation_checkpointing)  # a ConfigError naming the accepted forms
        for name in ("nodes", "ranks_per_node", "micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                flag = "gpus_per_node" if name == "ranks_per_node" else name
                raise ConfigError(f"--{flag} {getattr(self, name)} must be at least 1")
        if self.seq_length < 2:
            raise ConfigError(f"--seq_length {self.seq_length} is too small: use at least 2 (e.g. 2048)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def offload(self) -> str:
        if self.offload_params and self.offload_optimizer:
            return "optimizer+params"
        return "params" if self.offload_params else "optimizer" if self.offload_optimizer else "none"

    def describe(self) -> str:
        return engines.engine_class(self.backend).describe_layout(self)

    def describe_recommended(self) -> str:
        """describe(), with the activation checkpointing the recommendation needs (the header shows it apart)."""
        if every_n_layers(self.activation_checkpointing) is None:
            return self.describe()
        return f"{self.describe()}, --activation_checkpointing {self.activation_checkpointing}"


@dataclass(frozen=True)
class Line:
    label: str
    bytes: int
    how: str


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU (per-rank) memory and per-node host RAM of one layout. All figures in bytes."""

    model: ModelShape
    layout: ZeroLayout
    # per GPU
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int  # the decoder layers' saved tensors
    logits: int  # logits and loss at their peak
    buffers: int  # DeepSpeed's reduce / prefetch buckets and staging buffers
    cuda_runtime: int
    device_bytes_per_rank: int
    # per node
    host_model_build: int  # transient: every process builds the whole model on the CPU
    host_offload: int  # steady: offloaded optimizer states / parameters of this node's ranks
    host_processes: int
    host_bytes_per_node: int
    device_lines: tuple[Line, ...]
    host_lines: tuple[Line, ...]

    @property
    def model_states_device_bytes(self) -> int:
        """Parameters + gradients + optimizer states per GPU: what DeepSpeed's estimators call 'per GPU'."""
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def model_states_host_bytes_per_node(self) -> int:
        """Host RAM for model states per node: what DeepSpeed's estimators call 'per CPU'."""
        return max(self.host_model_build, self.host_offload)


def _elements(n: int) -> str:
    """An element count as DeepSpeed configs write it: 500000000 -> '5e8'."""
    mantissa, exponent = f"{n:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pinned(nbytes: int, pin: bool) -> int:
    # PyTorch's CachingHostAllocator rounds every pinned allocation up to a power of two (its default
    # pinned_max_round_threshold), so a 149 MB fp32 partition locks 256 MiB.
    return 1 << (nbytes - 1).bit_length() if pin and nbytes > 1 else nbytes


def _pinned_subgroups(numel: int, bytes_per: int, sub_group_size: int, pin: bool) -> int:
    """ZeRO-3 allocates its per-partition CPU buffers per sub-group of at most sub_group_size elements."""
    full, rest = divmod(numel, max(sub_group_size, 1))
    return full * _pinned(sub_group_size * bytes_per, pin) + _pinned(rest * bytes_per, pin)


def layer_bytes_per_token(m: ModelShape, b: int, liger: bool = False) -> int:
    """Bytes one decoder layer saves for backward per token (bf16: b = 2), without activation checkpointing.

    Counted from what autograd keeps in transformers' Llama-family layers (Qwen2/3, Llama, Mistral) with SDPA;
    tests/unit/resolve/test_memory_estimate.py checks the eager count against a traced forward and backward. The
    Liger count is read from liger-kernel 0.8.5's save_for_backward calls (its Triton kernels cannot run without
    a GPU).
    """
    h, i = m.hidden_size, m.intermediate_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    if liger:
        # LigerRMSNorm keeps its input and a fp32 1/rms per row; LigerSiLUMul keeps the gate and up outputs
        # and recomputes the SiLU; Liger's RoPE keeps only cos and sin.
        saved = 2 * (b * h + 4) + b * h  # both norms; the q/k/v projections' shared input
        if m.qk_norm:
            saved += b * (q + kv) + 4 * (m.num_heads + m.num_kv_heads)
        mlp = b * h + 3 * b * i
    else:
        # RMSNorm keeps the fp32 upcast of its input and the normalised bf16 tensor the weight multiplies.
        rms_norm = (4 + b) * h
        saved = 2 * rms_norm + b * h  # both norms; the q/k/v projections' shared input
        if m.qk_norm:
            saved += (4 + b) * (q + kv)  # Qwen3's per-head RMSNorm on q and k
        mlp = b * h + 4 * b * i  # shared input, gate output, SiLU output, up output, their product
    # SDPA keeps q, k, v (grouped-query: k and v at kv-head size), its output (which is also o_proj's input:
    # flash attention lays it out as (batch, seq, heads, dim)) and a fp32 log-sum-exp per head.
    saved += b * (q + 2 * kv) + b * q + 4 * m.num_heads
    return saved + mlp


def flce_chunk_rows(tokens: int, m: ModelShape) -> int:
    """Rows of logits Liger's fused linear cross-entropy materialises at once (its chunk_size, chunk_mem_const 1)."""
    per_chunk = _ceil_div(tokens, _ceil_div(m.vocab_size, m.hidden_size))
    return min(1 << (per_chunk - 1).bit_length(), tokens)


def _activations(m: ModelShape, lay: ZeroLayout) -> tuple[int, int, str, str]:
    """(layers' bytes, logits' bytes, how each is counted); their sum is the peak: the start of backward, or with
    activation checkpointing possibly the top layer's backward (and its recompute)."""
    tokens = lay.micro_batch_size * lay.seq_length
    b, h = lay.dtype_bytes, m.hidden_size
    # Under torch.compile inductor keeps no more than eager does, so the eager count is the bound there.
    liger_layers = lay.liger and not lay.compile
    # The kit turns Liger's fused loss off under ZeRO-3 (it would read lm_head.weight as an empty shard).
    fused_loss = lay.liger and lay.stage != 3
    per_layer = layer_bytes_per_token(m, b, liger_layers)
    final_norm = b * h + 4 if liger_layers else (4 + b) * h
    kernels = (
        "Liger kernels" if liger_layers else "eager" + (", compiled: at most this" if lay.compile else "")
    )
    batch = f"{lay.micro_batch_size} x {lay.seq_length} tokens"
    if fused_loss:
        # The gradient of the last hidden state and a fp32 loss per token, computed in the forward; the
        # logits exist one chunk at a time. Its lm_head weight gradient is the largest gradient in buffers.
        rows = flce_chunk_rows(tokens, m)
        logits = tokens * (b * h + 4) + rows * m.vocab_size * b
        logits_how = f"Liger fused linear cross-entropy: hidden-state gradient, {rows}-row logits chunk"
    else:
        logits = tokens * (b * h + LOGITS_PEAK_BYTES * m.vocab_size)  # lm_head's input, then the loss
        logits_how = (
            f"{batch} x {m.vocab_size} vocab x {LOGITS_PEAK_BYTES} B (fp32 log-softmax and its gradients)"
        )
    L, value = m.num_layers, lay.activation_checkpointing
    every, recomputed = every_n_layers(value), checkpointed_layers(L, value)
    if every is None:
        layers = tokens * (L * per_layer + final_norm)
        layers_how = f"{L} layers x {batch} x {per_layer / 1024:.1f} KiB ({kernels}), no checkpointing"
    else:
        # A checkpointed layer keeps only its input, the bf16 hidden states (the checkpoint holds them for the
        # recompute). The backward pass recomputes one checkpointed layer at a time; below the top layer that fits
        # in what the layers above it have freed by then. The top layer's backward comes after the loss's has
        # freed the logits and the final norm, and holds the layer's own temporaries (the gradients of the MLP's
        # intermediate tensors and of a few hidden states, measured) -- and, when the top layer itself is
        # checkpointed (full, or L-1 a multiple of N), its recomputed activations: the peak is the larger of
        # the two moments. Within 5% of a traced forward and backward (tests/unit/resolve/test_memory_estimate.py).
        kept = tokens * ((L - recomputed) * per_layer + recomputed * b * h)
        top_recomputed = (L - 1) % every == 0
        at_start = tokens * final_norm  # with the logits, at the start of backward
        backward = 4 * b * m.intermediate_size + 3 * b * h + (per_layer if top_recomputed else 0)
        at_top_backward = tokens * backward - logits  # the logits freed by then
        layers = kept + max(at_start, at_top_backward)
        layers_how = (
            f"{batch} x ({L - recomputed} layers x {per_layer / 1024:.1f} KiB + {recomputed} checkpointed x "
            f"{b * h / 1024:.1f} KiB input) ({kernels}), checkpointing {value}"
            + (", the top layer's backward at the peak" if at_top_backward > at_start else "")
        )
    return layers, logits, layers_how, logits_how


def _host_lines(ranks: int, build: int, build_how: str, offload: int, offload_how: str) -> tuple[Line, ...]:
    """Host RAM per node, either engine: the transient model build, what stays offloaded, the processes."""
    return (
        Line("model build (transient)", build, f"{ranks} x {build_how} x {BUILD_BUFFER_FACTOR}"),
        Line("offload (steady)", offload, f"{ranks} x ({offload_how})" if offload else "nothing offloaded"),
        Line(
            "processes",
            ranks * PROCESS_BASELINE_BYTES,
            f"{ranks} x {PROCESS_BASELINE_BYTES / GiB:g} GiB (approximate)",
        ),
    )


def estimate_fsdp(m: ModelShape, lay: ZeroLayout) -> MemoryEstimate:
    """FSDP2 (--backend fsdp), kept simple: every rank holds 1/N of the fp32 master parameters, their fp32
    gradients and Adam's m and v (16 bytes per trainable parameter / N; LoRA: the frozen base's 4 bytes / N only),
    plus, during compute, the running decoder layer and the prefetched next one gathered in the compute dtype,
    and the running layer's unsharded fp32 gradient before its reduce-scatter. With accumulation the unsharded
    gradients of the whole model stay between micro-batches (no reduce until the last). --fsdp_cpu_offload moves
    the shards (parameters, gradients, optimizer) to host RAM; the gathered layers stay on the GPU."""
    P, N, b = m.total_params, lay.world_size, lay.dtype_bytes
    T = m.trainable_params if m.trainable_params is not None else P
    L = m.largest_layer_params
    off = lay.offload_optimizer
    shard_p, shard_t = _ceil_div(P, N), _ceil_div(T, N)
    params = (0 if off else 4 * shard_p) + 2 * b * L
    params_how = ("" if off else f"fp32 1/{N} shard + ") + "2 layers gathered (running, prefetched)"
    grads = (0 if off else 4 * shard_t) + 4 * min(L, T)
    grads_how = ("" if off else f"fp32 1/{N} shard + ") + "the running layer's unsharded fp32 gradient"
    if lay.gradient_accumulation_steps > 1:
        grads += b * T
        grads_how += "; unsharded gradients kept between micro-batches"
    optim = 0 if off else 8 * shard_t
    optim_how = "on the CPU" if off else f"Adam m, v of a 1/{N} shard (the shard is the fp32 master)"
    layers, logits, layers_how, logits_how = _activations(m, lay)
    device_total = params + grads + optim + layers + logits + CUDA_RUNTIME_BYTES
    device_lines = (
        Line("parameters", params, params_how),
        Line("gradients", grads, grads_how),
        Line("optimizer states", optim, optim_how),
        Line("activations", layers, layers_how),
        Line("logits + loss", logits, logits_how),
        Line("buffers", 0, "FSDP2's all-gather and reduce-scatter buffers are the layers counted above"),
        Line("CUDA context + NCCL", CUDA_RUNTIME_BYTES, "approximate"),
    )
    ranks = lay.ranks_per_node
    build = int(ranks * 4 * P * BUILD_BUFFER_FACTOR)  # built in fp32 on every rank before sharding
    offload = ranks * (4 * shard_p + 12 * shard_t) if off else 0
    processes = ranks * PROCESS_BASELINE_BYTES
    host_lines = _host_lines(
        ranks, build, f"{P / 1e6:.2f}M params x 4 B", offload, "fp32 shard, its gradients, Adam m and v"
    )
    return MemoryEstimate(
        model=m,
        layout=lay,
        parameters=params,
        gradients=grads,
        optimizer_states=optim,
        activations=layers,
        logits=logits,
        buffers=0,
        cuda_runtime=CUDA_RUNTIME_BYTES,
        device_bytes_per_rank=device_total,
        host_model_build=build,
        host_offload=offload,
        host_processes=processes,
        host_bytes_per_node=max(build, offload) + processes,
        device_lines=device_lines,
        host_lines=host_lines,
    )


def estimate(m: ModelShape, lay: ZeroLayout) -> MemoryEstimate:
    """The memory model of the layout's engine (estimate_zero, estimate_fsdp)."""
    return engines.engine_class(lay.backend).estimate_memory(m, lay)


def estimate_zero(m: ModelShape, lay: ZeroLayout) -> MemoryEstimate:
    """DeepSpeed ZeRO (--backend deepspeed) at any stage and offload."""
    P, N, b = m.total_params, lay.world_size, lay.dtype_bytes
    part = _ceil_div(P, N)  # each rank's partition of the flat parameter buffer
    L, big = m.largest_layer_params, m.largest_param
    off_opt = lay.offload_optimizer
    # The parameters that hold gradients and optimizer states: all, or under LoRA the adapters alone (the frozen
    # base reaches no optimizer group). Parameters themselves (the bf16 base) count in full either way.
    lora = m.trainable_params is not None
    full_params, full_part = P, part
    if lora:
        assert m.trainable_params is not None and m.largest_trainable_param is not None
        P, part = m.trainable_params, _ceil_div(m.trainable_params, N)
        L, big = min(L, P), m.largest_trainable_param  # a layer's gradient: at most the trainable ones

    # --- parameters, gradients, optimizer states on the GPU ---
    # Optimizer states are the fp32 master weights and Adam's m and v: 12 bytes per parameter of the partition.
    # Gradients include the fp32 copy DeepSpeed makes of the partition's gradients for the step (4 bytes), as
    # DeepSpeed's estimators count it (their "18 = 2 + 4 + 4 + 8").
    if lay.stage == 3:
        # Parameters under stage3_param_persistence_threshold (norms) stay whole on every rank: well under 1%
        # of a real model, and left out as DeepSpeed's estimator leaves them out.
        params = (0 if lay.offload_params else b * full_part) + b * m.largest_layer_params
        params_how = f"{'' if lay.offload_params else '1/' + str(N) + ' partition + '}largest layer gathered"
        # The fp32 copy of the partition's gradients exists only during the step, when no layer is gathered,
        # so the larger of the two counts. DeepSpeed's estimator counts 18 bytes per partitioned parameter and
        # leaves out the bf16 parameter partition itself (it does count it when the optimizer is offloaded).
        grads = (0 if off_opt else b * part) + max(b * L, 0 if off_opt else 4 * part)
        grads_how = "largest layer's" + ("" if off_opt else f" or the fp32 step copy, + 1/{N} partition")
    else:
        params, params_how = b * full_params, "whole model on every GPU"
        if lay.stage == 0:
            grads, grads_how = (b + 4) * P, "whole model, bf16 and fp32"
        elif lay.stage == 1:
            grads = b * P + (0 if off_opt else 4 * part)
            grads_how = "whole model (ZeRO-1 does not partition them)" + (
                "" if off_opt else " + fp32 partition"
            )
        else:
            grads = 0 if off_opt else (b + 4) * part
            grads_how = "reduced into the CPU partition" if off_opt else f"1/{N} partition, bf16 and fp32"
    if lay.stage == 0:
        optim, optim_how = 12 * P, "fp32 master + Adam m, v, whole model"
    elif off_opt:
        optim, optim_how = 0, "on the CPU"
    else:
        optim, optim_how = 12 * part, f"fp32 master + Adam m, v of a 1/{N} partition"

    layers, logits, layers_how, logits_how = _activations(m, lay)

    # --- DeepSpeed's buffers ---
    if lay.stage == 3:
        # One reduce bucket per dtype (stage3.py), and the parameters prefetched ahead of the running layer.
        buffers = (
            b * lay.reduce_bucket_size if lay.contiguous_gradients else 0
        ) + b * lay.prefetch_bucket_size
        buffers_how = f"reduce bucket {_elements(lay.reduce_bucket_size)}, prefetch {_elements(lay.prefetch_bucket_size)}"
    else:
        contiguous = lay.contiguous_gradients or off_opt  # DeepSpeed forces contiguous gradients with offload
        if lay.stage == 0 or not contiguous:
            n_buckets, bucket_numel = 1, min(P, lay.reduce_bucket_size)
        else:
            n_buckets, bucket_numel = (2 if lay.overlap_comm else 1), lay.reduce_bucket_size
        # The largest gradient exists once outside the bucket before it is copied in; with offload it is staged
        # through a GPU buffer of the same size. The all-gather after the step works in place in the flat
        # parameter buffer (all_gather_into_tensor over NCCL), so allgather_bucket_size costs nothing extra.
        buffers = n_buckets * b * bucket_numel + b * big + (b * big if off_opt else 0)
        buffers_how = f"reduce buckets {n_buckets} x {_elements(bucket_numel)}, largest gradient" + (
            ", offload staging" if off_opt else ""
        )
        buffers_how += "; all-gather in place"

    device_total = params + grads + optim + layers + logits + buffers + CUDA_RUNTIME_BYTES
    device_lines = (
        Line("parameters", params, params_how),
        Line("gradients", grads, grads_how),
        Line("optimizer states", optim, optim_how),
        Line("activations", layers, layers_how),
        Line("logits + loss", logits, logits_how),
        Line("buffers", buffers, buffers_how),
        Line("CUDA context + NCCL", CUDA_RUNTIME_BYTES, "approximate"),
    )

    # --- host RAM per node ---
    P = full_params  # the build holds the whole model
    ranks = lay.ranks_per_node
    pin = lay.pin_memory
    # DeepSpeed's estimators assume the fp32 model built on the CPU in every process (their "4 * n_gpus"),
    # true for presets; a pretrained model is loaded directly in bf16, so it takes half that.
    build = int(ranks * m.build_bytes_per_param * P * BUILD_BUFFER_FACTOR)
    per_rank, offload_how = 0, ""
    if lay.stage in (1, 2) and off_opt:
        # stage_1_and_2.py: pinned fp32 master partition, a pinned bf16 copy of it, pinned fp32 gradients and a
        # pinned staging buffer of the largest parameter; CPU Adam's m and v are ordinary memory. DeepSpeed's
        # estimator counts 16 bytes per parameter and leaves out the bf16 copy and the staging buffer.
        per_rank = (
            _pinned(4 * part, pin) + _pinned(b * part, pin) + _pinned(4 * part, pin) + _pinned(b * big, pin)
        ) + 8 * part
        if lay.gradient_accumulation_steps > 1:
            per_rank += _pinned(b * part, pin)  # gradients accumulated on the CPU between boundaries
        offload_how = "fp32 master, its bf16 copy, fp32 grads, staging buffer, Adam m and v"
    elif lay.stage == 3 and (off_opt or lay.offload_params):
        sub = lay.sub_group_size
        if off_opt:
            # stage3.py: fp32 master and Adam m, v in ordinary memory; pinned fp32 gradients per sub-group and
            # the pinned bf16 gradient partition. DeepSpeed's estimator counts 16 bytes (18 with parameters).
            per_rank += 12 * part + _pinned_subgroups(part, 4, sub, pin) + _pinned(b * part, pin)
            offload_how = "fp32 master, Adam m and v, fp32 and bf16 grads"
        if lay.offload_params:
            per_rank += _pinned(b * full_part, pin)
            offload_how += (", " if offload_how else "") + "bf16 parameters"
    offload = ranks * per_rank
    processes = ranks * PROCESS_BASELINE_BYTES
    host_total = max(build, offload) + processes
    pinned_note = "; pinned ones rounded up to 2^n bytes" if pin and offload else ""
    host_lines = _host_lines(
        ranks,
        build,
        f"{m.total_params / 1e6:.2f}M params x {m.build_bytes_per_param} B",
        offload,
        f"{offload_how}{pinned_note}",
    )
    return MemoryEstimate(
        model=m,
        layout=lay,
        parameters=params,
        gradients=grads,
        optimizer_states=optim,
        activations=layers,
        logits=logits,
        buffers=buffers,
        cuda_runtime=CUDA_RUNTIME_BYTES,
        device_bytes_per_rank=device_total,
        host_model_build=build,
        host_offload=offload,
        host_processes=processes,
        host_bytes_per_node=host_total,
        device_lines=device_lines,
        host_lines=host_lines,
    )


# --- the DeepSpeed config ---------------------------------------------------------------------------------


def layout_from_deepspeed(
    ds: dict[str, Any],
    path: str,
    *,
    micro_batch_size: int,
    seq_length: int,
    gradient_accumulation_steps: int,
    nodes: int,
    ranks_per_node: int,
    zero_stage: int | None = None,
    offload: str | None = None,
) -> ZeroLayout:
    """The layout a resolved DeepSpeed config describes; zero_stage / offload (flags) replace the file's."""
    startup.import_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = dict(ds.get("zero_optimization") or {})
    if zero_stage is not None:
        check_zero(zero_stage, False, False)  # before DeepSpeed's own, less readable, validation
        zero["stage"] = zero_stage
    if offload is not None:
        for key, wanted in (
            ("offload_optimizer", offload != "none"),
            ("offload_param", offload == "optimizer+params"),
        ):
            section = dict(zero.get(key) or {})
            section["device"] = "cpu" if wanted else "none"
            zero[key] = section
    try:
        z = DeepSpeedZeroConfig(**zero)
    except Exception as e:  # pydantic's ValidationError and DeepSpeed's own asserts
        raise ConfigError(f"DeepSpeed rejects zero_optimization in {path}: {first_line(e)}") from None
    sections = {"offload_optimizer": z.offload_optimizer, "offload_param": z.offload_param}
    devices = {k: (str(getattr(s.device, "value", s.device)) if s else "none") for k, s in sections.items()}
    for key, device in devices.items():
        if device not in ("none", "cpu"):
            raise ConfigError(
                f"zero_optimization.{key}.device {device!r} in {path} is not modelled by dskit estimate: "
                "estimate with --offload optimizer (CPU) instead"
            )
    pins = [s.pin_memory for k, s in sections.items() if s is not None and devices[k] == "cpu"]
    precision = 4 if not (ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled")) else 2
    return ZeroLayout(
        stage=int(z.stage),
        offload_optimizer=devices["offload_optimizer"] == "cpu",
        offload_params=devices["offload_param"] == "cpu",
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dtype_bytes=precision,
        pin_memory=all(pins) if pins else True,
        reduce_bucket_size=int(z.reduce_bucket_size),
        prefetch_bucket_size=int(z.prefetch_bucket_size),
        sub_group_size=int(z.sub_group_size),
        overlap_comm=bool(z.overlap_comm),
        contiguous_gradients=bool(z.contiguous_gradients),
    )


def resolve_liger(choice: str, model_type: str) -> bool:
    """--liger auto|on|off for a GPU run, decided as kernels.plan decides it on a CUDA device."""
    if choice == "off":
        return False
    from model_utils.model.kernels import liger_model_types

    types = liger_model_types()
    if types is not None and model_type in types:
        return True
    if choice == "on":
        reason = (
            "liger-kernel is not installed" if types is None else f"Liger has no kernels for {model_type!r}"
        )
        raise ConfigError(f"--liger on: {reason}: use --liger auto or --liger off")
    return False


def resolve_layout(
    settings: Any,
    nodes: int,
    ranks_per_node: int,
    zero_stage: int | None = None,
    offload: str | None = None,
    on_gpus: bool = True,
) -> tuple[ModelShape, ZeroLayout]:
    """The shape and layout of a resolved run's settings (preflight.RunSettings)."""
    from model_utils.config.arguments import AUTO

    cfg, ts, model_config = settings.config, settings.train, settings.model_config
    # A micro batch of "auto" (probed on the GPU at launch) is estimated at 1, the smallest the probe picks.
    micro_batch = 1 if ts.micro_batch_size == AUTO else int(ts.micro_batch_size)
    layout = layout_from_deepspeed(
        ts.deepspeed_json(micro_batch, total_steps=cfg.loop.max_steps),
        ts.path,
        micro_batch_size=micro_batch,
        seq_length=settings.seq_length,
        gradient_accumulation_steps=ts.gradient_accumulation_steps,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        zero_stage=zero_stage,
        offload=offload,
    )
    layout = dataclasses.replace(
        layout,
        # CPU ranks never use Liger (kernels.plan): no need to import it to find out which models it covers.
        liger=on_gpus and resolve_liger(cfg.model.liger, str(getattr(model_config, "model_type", ""))),
        compile=bool(cfg.model.compile),
        activation_checkpointing=cfg.model.activation_checkpointing,
        backend=ts.backend,
        offload_optimizer=layout.offload_optimizer or ts.fsdp_cpu_offload,
    )
    source = settings.source
    shape = model_shape(
        model_config,
        source.name,
        source.preset is not None,
        layout.dtype_bytes,
        cache_dir=Path(cfg.data.data_cache_dir),
    )
    if cfg.lora.enabled:
        shape = with_lora(shape, model_config, cfg.lora)
    return shape, layout


def with_lora(shape: ModelShape, model_config: Any, lora_args: Any) -> ModelShape:
    """The shape of the model with --lora_r's adapters: counted on the meta device with peft, as training
    builds it (lora.apply); its total includes the adapters, and only they (and --lora_modules_to_save) train."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.model import lora

    with torch.device("meta"):
        model = lora.wrap(AutoModelForCausalLM.from_config(model_config), lora_args)
    trainable, total = lora.parameter_counts(model)
    largest = max(p.numel() for p in model.parameters() if p.requires_grad)
    return dataclasses.replace(
        shape, total_params=total, trainable_params=trainable, largest_trainable_param=largest
    )


def estimate_for_config(
    settings: Any, nodes: int, ranks_per_node: int, on_gpus: bool = True
) -> MemoryEstimate:
    """The estimate for a resolved run's settings as it would run on nodes x ranks_per_node ranks.

    The figures are for GPU ranks: with CPU ranks (no GPU) the per-GPU figure lives in host RAM too.
    """
    shape, layout = resolve_layout(settings, nodes, ranks_per_node, on_gpus=on_gpus)
    return estimate(shape, layout)


def fits_gpu(est: MemoryEstimate, gpu_bytes: int) -> bool:
    """The per-GPU estimate within FIT_FRACTION of the GPU's memory (the rest: allocator fragmentation)."""
    return est.device_bytes_per_rank <= FIT_FRACTION * gpu_bytes
