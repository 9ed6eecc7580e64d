"""Ulysses sequence parallelism (--sequence_parallel N) through DeepSpeed's own components: each rank of a group of
N holds a slice of every sequence (step_batches.Batch.shard); in each attention layer DeepSpeed's
UlyssesSPAttentionHF trades the slices for heads with an all-to-all, so a rank attends over the whole sequence for
1/N of the heads, then trades back. Everything else in the model is per token and runs on the slice alone.

DeepSpeed's wrapper drops the attention mask (a mask of the whole sequence is quadratic in it) and hands the core
attention the gathered position ids. The kit's core attention, registered with transformers by name, is SDPA
that reads them: causal over rows of one sequence, and a block-diagonal causal mask where the positions restart
(rows of several documents, as the kit's SDPA path keeps them apart without sequence parallelism). On CUDA with
flash-attn the model's flash_attention_2 (models.attend_within_documents) is the core: it reads the positions
itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model_utils.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from model_utils.config.arguments import TrainConfig

# The kit's core attention under sequence parallelism, as transformers' attention registry names it.
ATTENTION = "dskit_sequence_parallel_sdpa"


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA over the whole sequence (after DeepSpeed's all-to-all), documents kept apart by the position ids."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    positions = kwargs.pop("position_ids", None)
    if positions is not None and bool((positions[..., 1:] == 0).any()):  # a row of several documents
        attention_mask = _document_mask(positions)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# The last mask made and the positions it is of: every layer of a forward gathers the same positions, so one mask
# serves them all (each layer's SDPA keeps it for the backward: one tensor, not one per layer).
_LAST_MASK: list[tuple[torch.Tensor, torch.Tensor]] = []


def _document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The causal mask that keeps each document (positions restarting at 0) to itself, (rows, 1, length, length)."""
    import torch

    if _LAST_MASK and _LAST_MASK[0][0].shape == positions.shape and torch.equal(_LAST_MASK[0][0], positions):
        return _LAST_MASK[0][1]
    document = (positions == 0).cumsum(-1)
    length = positions.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    mask = ((document[:, :, None] == document[:, None, :]) & causal)[:, None]
    _LAST_MASK[:] = [(positions, mask)]
    return mask


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The model builds no mask of its slice: the wrapper would drop it, and the core attention makes its own."""
    return None


def register(model: Any, sequence_parallel: int, micro_batch_size: int) -> Any:
    """Route `model`'s attention through DeepSpeed's Ulysses wrapper (groups of `sequence_parallel` consecutive
    ranks); returns the `mpu` (the groups) deepspeed.initialize takes."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface, AttentionMaskInterface

    from model_utils.model import lora, models

    hf_model = lora.hf_model(model)
    core = ATTENTION
    if models.flattens_documents(hf_model):
        core = models.VARLEN_ATTENTION  # reads the gathered positions itself; one flattened row a micro-batch
        micro_batch_size = 1
    else:
        AttentionInterface.register(ATTENTION, _attention)
        AttentionMaskInterface.register(ATTENTION, _no_mask)
        hf_model.set_attn_implementation(ATTENTION)
    groups = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=hf_model,
        core_attn_implementation=core,
        sequence_parallel_size=sequence_parallel,
        micro_batch_size=micro_batch_size,
        seq_length_is_variable=True,
    )
    return NoTensorParallel(groups)


class NoTensorParallel:
    """DeepSpeed's Ulysses groups as deepspeed.initialize's `mpu`, saying there is no tensor parallelism. Without
    that, DeepSpeed takes the sequence-parallel groups for tensor-parallel ones where it asks an mpu for those
    (their model-parallel names are aliases): a checkpoint records the group size as its tensor-parallel degree, so
    that its universal conversion (a resume on another world size) looks for model-state files that were never
    written, and the universal load cannot ask for the tensor-parallel size at all
    (tests/e2e/test_sequence_parallel.py resumes on another world size)."""

    def __init__(self, groups: Any) -> None:
        self._groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._groups, name)

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return 1

    @staticmethod
    def get_tensor_model_parallel_rank() -> int:
        return 0


def check(cfg: TrainConfig, model_config: Any, seq_length: int, world_size: int | None) -> None:
    """What DeepSpeed's Ulysses cannot split, refused in one line before any rank trains."""
    n = cfg.optim.sequence_parallel
    why = cannot_split(n, model_config, seq_length, world_size, f"{cfg.setting('sequence_parallel')} {n}")
    if why is not None:
        raise ConfigError(why)


def cannot_split(n: int, model_config: Any, seq_length: int, world_size: int | None, sp: str) -> str | None:
    """Why groups of `n` ranks cannot share the sequences (None: they can): ranks, sequence or attention heads that
    do not divide n ways (fewer key/value heads than n are replicated: n a multiple of them). `sp`: the setting as
    a message names it."""
    if n == 1:
        return None
    if world_size is not None and world_size % n:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        return f"{sp} does not divide the {world_size} ranks into groups: use one of {divisors}"
    if seq_length % n:
        return (
            f"sequence length {seq_length} does not split into {n} equal slices ({sp}): set --seq_length to a "
            f"multiple of {n}, e.g. {seq_length - seq_length % n}"
        )
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", text.num_attention_heads)
    if heads % n:
        return f"{sp}: the model's {heads} attention heads do not split {n} ways: use a divisor of {heads}"
    if kv_heads % n and n % kv_heads:
        return (
            f"{sp}: the model's {kv_heads} key/value heads neither split {n} ways nor replicate to {n}: use a "
            f"divisor or a multiple of {kv_heads}"
        )
    return None
