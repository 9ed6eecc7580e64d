"""The memory model's shared part, whichever engine trains: its types (ModelShape, counted by
resolve/memory_estimate.py; ZeroLayout, naming its engine; MemoryEstimate, line by line) and what every engine
keeps alike: the decoder layers' activations and the loss (per saved tensor, for a Hugging Face causal LM with
transformers' ForCausalLMLoss or Liger's kernels; checked against a traced forward and backward) and host RAM
beside the offload. Each engine counts its own model states and buffers (deepspeed_engine.estimate_zero,
fsdp_engine.estimate_fsdp); `estimate` asks the layout's.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_utils import engines
from model_utils.config.arguments import every_n_layers
from model_utils.errors import ConfigError
from model_utils.model.activation_checkpointing import checkpointed_layers

GiB = 2**30
# DeepSpeed's additional_buffer_factor for host RAM. Building Qwen3-0.6B with from_config on the CPU peaks at
# 1.36x its fp32 size (initialisation temporaries, then the per-parameter cast to bf16 in deepspeed.initialize).
BUILD_BUFFER_FACTOR = 1.5
# Resident memory of one training process besides the model: Python, PyTorch, the CUDA libraries, DeepSpeed,
# the tokenizer and the packed data. Approximate; it does not depend on the model.
PROCESS_BASELINE_BYTES = 2 * GiB
# GPU memory outside PyTorch's allocator: the CUDA context and NCCL's communication buffers. Approximate.
CUDA_RUNTIME_BYTES = 1 * GiB
# fp32 log-softmax saved for backward, its incoming gradient and the gradient it produces, all alive at the
# start of backward (bytes per token per vocab entry). The forward peak is lower: the bf16 logits (2), their
# fp32 upcast in ForCausalLMLoss (4) and the log-softmax (4). Measured in tests/unit/engines/test_memory.py.
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
    sequence_parallel: int = (
        1  # --sequence_parallel: ranks sharing each sequence, each holding 1/N of its tokens
    )
    # A preference objective (--objective dpo, simpo): a micro batch of pairs, each two sequences in one forward,
    # whose log-probabilities come from the logits (never Liger's fused loss).
    pairs: bool = False
    # The engine (--backend). One without ZeRO stages (FSDP2) has stage 0 here, and offload_optimizer is its one
    # offload switch (--fsdp_cpu_offload, which moves all sharded state).
    backend: str = engines.DEFAULT

    def __post_init__(self) -> None:
        if engines.memory_model(self.backend).zero_stages:
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
        return engines.memory_model(self.backend).describe_layout(self)

    def describe_recommended(self) -> str:
        """describe(), with the activation checkpointing and sequence parallelism the recommendation needs (the
        header shows them apart)."""
        described = self.describe()
        if every_n_layers(self.activation_checkpointing) is not None:
            described += f", --activation_checkpointing {self.activation_checkpointing}"
        if self.sequence_parallel > 1:
            described += f", --sequence_parallel {self.sequence_parallel}"
        return described


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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def layer_bytes_per_token(m: ModelShape, b: int, liger: bool = False) -> int:
    """Bytes one decoder layer saves for backward per token (bf16: b = 2), without activation checkpointing.

    Counted from what autograd keeps in transformers' Llama-family layers (Qwen2/3, Llama, Mistral) with SDPA;
    tests/unit/engines/test_memory.py checks the eager count against a traced forward and backward. The
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
    per_chunk = ceil_div(tokens, ceil_div(m.vocab_size, m.hidden_size))
    return min(1 << (per_chunk - 1).bit_length(), tokens)


def activations(m: ModelShape, lay: ZeroLayout) -> tuple[int, int, str, str]:
    """(layers' bytes, logits' bytes, how each is counted); their sum is the peak: the start of backward, or with
    activation checkpointing possibly the top layer's backward (and its recompute)."""
    # Under sequence parallelism a rank holds 1/N of each sequence's tokens; its attention, 1/N of the heads over
    # the whole sequence after the all-to-all, keeps as much as the slice with every head.
    sequences = lay.micro_batch_size * (2 if lay.pairs else 1)
    tokens = sequences * ceil_div(lay.seq_length, lay.sequence_parallel)
    b, h = lay.dtype_bytes, m.hidden_size
    # Under torch.compile inductor keeps no more than eager does, so the eager count is the bound there.
    liger_layers = lay.liger and not lay.compile
    # The kit turns Liger's fused loss off under ZeRO-3 (it would read lm_head.weight as an empty shard).
    fused_loss = lay.liger and lay.stage != 3 and not lay.pairs
    per_layer = layer_bytes_per_token(m, b, liger_layers)
    final_norm = b * h + 4 if liger_layers else (4 + b) * h
    kernels = (
        "Liger kernels" if liger_layers else "eager" + (", compiled: at most this" if lay.compile else "")
    )
    batch = f"{lay.micro_batch_size} x {lay.seq_length} tokens"
    if lay.pairs:
        batch = f"{lay.micro_batch_size} pairs x 2 x {lay.seq_length} tokens"
    elif lay.sequence_parallel > 1:
        batch = f"{lay.micro_batch_size} x {lay.seq_length} / {lay.sequence_parallel} tokens"
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
        # the two moments. Within 5% of a traced forward and backward (tests/unit/engines/test_memory.py).
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


def estimate_of(
    m: ModelShape, lay: ZeroLayout, states: tuple[Line, ...], build: tuple[int, str], offload: tuple[int, str]
) -> MemoryEstimate:
    """An engine's estimate from what it counts itself: per GPU its parameters, gradients, optimizer states and
    buffers (`states`, in that order); per node the transient model build and what stays offloaded ((bytes, how)
    of all its ranks). The activations and the loss, the CUDA runtime and the processes are every engine's alike."""
    params, grads, optim, buffers = states
    layers, logits, layers_how, logits_how = activations(m, lay)
    device = (
        *(params, grads, optim),
        Line("activations", layers, layers_how),
        Line("logits + loss", logits, logits_how),
        buffers,
        Line("CUDA context + NCCL", CUDA_RUNTIME_BYTES, "approximate"),
    )
    ranks, processes = lay.ranks_per_node, lay.ranks_per_node * PROCESS_BASELINE_BYTES
    host = (
        Line("model build (transient)", build[0], f"{ranks} x {build[1]} x {BUILD_BUFFER_FACTOR}"),
        Line(
            "offload (steady)", offload[0], f"{ranks} x ({offload[1]})" if offload[0] else "nothing offloaded"
        ),
        Line("processes", processes, f"{ranks} x {PROCESS_BASELINE_BYTES / GiB:g} GiB (approximate)"),
    )
    return MemoryEstimate(
        model=m,
        layout=lay,
        parameters=params.bytes,
        gradients=grads.bytes,
        optimizer_states=optim.bytes,
        activations=layers,
        logits=logits,
        buffers=buffers.bytes,
        device_bytes_per_rank=sum(line.bytes for line in device),
        host_model_build=build[0],
        host_offload=offload[0],
        host_processes=processes,
        host_bytes_per_node=max(build[0], offload[0]) + processes,
        device_lines=device,
        host_lines=host,
    )


def estimate(m: ModelShape, lay: ZeroLayout) -> MemoryEstimate:
    """The memory model of the layout's engine (estimate_zero, estimate_fsdp)."""
    return engines.memory_model(lay.backend).estimate_memory(m, lay)
