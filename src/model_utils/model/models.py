"""Model and tokenizer loading: a preset (random init), a local HF directory, or a hub id (pretrained)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_utils.config.presets import PRESETS, Preset
from model_utils.errors import ConfigError, ModelUnavailable, first_line
from model_utils.observe.log import print0
from model_utils.observe.run_name import short_name

if TYPE_CHECKING:
    from model_utils.model.hub import Snapshot

MAX_DEFAULT_SEQ_LENGTH = 2048


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: exactly one of preset / local dir / hub id."""

    name: str
    preset: Preset | None = None
    local_dir: Path | None = None
    snapshot: Snapshot | None = None  # a hub id's pinned snapshot in the HF cache (hub.resolve)

    @property
    def is_hub(self) -> bool:
        return self.preset is None and self.local_dir is None

    @property
    def load_path(self) -> str:
        """What from_pretrained reads: the local dir, or the hub id's local snapshot (never the hub itself)."""
        if self.local_dir is not None:
            return str(self.local_dir)
        if self.snapshot is not None:
            return str(self.snapshot.path)
        return self.name

    @property
    def short_name(self) -> str:
        return short_name(self.name)


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def is_hub_id(name: str) -> bool:
    """org/name that is not a local directory (a tokenizer given by hub id, as a model's is_hub)."""
    return not _looks_like_path(name) and name.count("/") == 1 and not Path(name).expanduser().exists()


def resolve_model_source(name: str) -> ModelSource:
    if name in PRESETS:
        return ModelSource(name=name, preset=PRESETS[name])
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model directory {name} has no config.json: point --model at a Hugging Face model dir"
            )
        return ModelSource(name=name, local_dir=path)
    if _looks_like_path(name) or path.exists():
        raise ConfigError(f"model path {name} does not exist (or is not a directory): check --model")
    if name.count("/") != 1:
        raise ConfigError(
            f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}), not a local directory, "
            "and not a hub id of the form org/name"
        )
    return ModelSource(name=name)


def _hub_error(what: str, name: str, err: Exception) -> ConfigError:
    reason = first_line(err)
    return ModelUnavailable(
        f"could not load {what} {name!r} ({reason}): check the name and network access, or pass a local directory"
    )


def load_model_config(source: ModelSource) -> Any:
    if source.preset is not None:
        return source.preset.build_config()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.load_path)
    except (OSError, ValueError) as e:
        raise _hub_error("model config", source.name, e) from None


def max_positions(model_config: Any) -> int:
    return int(getattr(model_config, "max_position_embeddings", MAX_DEFAULT_SEQ_LENGTH))


def resolve_seq_length(requested: int | None, model_config: Any) -> int:
    limit = max_positions(model_config)
    if requested is None:
        return min(limit, MAX_DEFAULT_SEQ_LENGTH)
    if requested > limit:
        raise ConfigError(
            f"--seq_length {requested} is above the model's maximum positions ({limit}): use --seq_length {limit} or less"
        )
    return requested


def tokenizer_name(source: ModelSource, tokenizer: str | None) -> str:
    """--tokenizer, else the preset's tokenizer, else the model's own (its dir, or its hub id)."""
    return tokenizer or (source.preset.tokenizer if source.preset else str(source.local_dir or source.name))


def load_tokenizer(source: ModelSource, tokenizer: str | None, snapshot: Snapshot | None = None) -> Any:
    """`snapshot`: the tokenizer's pinned hub snapshot (preflight.RunSettings.tokenizer), read instead of the hub."""
    from transformers import AutoTokenizer

    name = tokenizer_name(source, tokenizer)
    local = Path(name).expanduser()
    if _looks_like_path(name) and not local.is_dir():
        raise ConfigError(f"tokenizer path {name} does not exist: check --tokenizer")
    if snapshot is not None:
        local = snapshot.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else name)
    except (OSError, ValueError) as e:
        raise _hub_error("tokenizer", name, e) from None
    if not tokenizer.is_fast:
        raise ConfigError(
            f"tokenizer {name} has no fast (Rust) implementation: pass --tokenizer with a fast one"
        )
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"tokenizer {name} has no EOS token: documents could not be separated; pick another"
        )
    return tokenizer


def check_vocab(tokenizer: Any, model_config: Any) -> None:
    if len(tokenizer) > model_config.vocab_size:
        raise ConfigError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {model_config.vocab_size}: "
            "use the model's own tokenizer"
        )


def build_model(source: ModelSource, model_config: Any, seed: int, dtype: Any) -> Any:
    """Random init for presets (same weights on every rank for a seed); pretrained weights otherwise.

    Pretrained weights load directly in the training dtype so a rank never holds an fp32 copy it does not need.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if source.preset is not None:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa")
    try:
        return AutoModelForCausalLM.from_pretrained(source.load_path, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as e:
        raise _hub_error("model", source.name, e) from None


def weights_fingerprint(model: Any) -> str:
    """A fingerprint of the model's weights (every tensor of its state dict, by name, bytes and shape): what names
    the weights a preference objective's reference log-probabilities were computed under."""
    import torch
    import xxhash

    digest = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


# The attention that reads position ids restarting inside a row as separate sequences with no mask at all
# (variable-length flash attention); transformers uses it for a one-row batch (step_batches.gather's `flatten`).
VARLEN_ATTENTION = "flash_attention_2"


def attend_within_documents(model: Any, device: Any) -> bool:
    """Set the attention for rows of several documents (position ids restarting at each one); returns whether the
    batches must be flattened into one row for it.

    On CUDA with flash-attn installed: flash_attention_2, whose variable-length kernels take the documents from
    the position ids (no mask is built, no work spent across documents). Elsewhere the SDPA the model was built
    with, for which transformers builds a block-diagonal causal mask from the position ids."""
    import importlib.util

    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        model.set_attn_implementation(VARLEN_ATTENTION)
    except (ImportError, ValueError) as e:  # transformers' own check of the installed package and the model
        print0(
            f"Attention: SDPA with a block-diagonal mask per document ({VARLEN_ATTENTION} unusable: {first_line(e)})"
        )
        return False
    print0(f"Attention: {VARLEN_ATTENTION} (variable-length: documents kept apart without a mask)")
    return True


def flattens_documents(model: Any) -> bool:
    """Whether `model` (attend_within_documents' choice) reads document positions from one flattened row."""
    from model_utils.compat import transformers_internals

    return transformers_internals.attn_implementation(model.config) == VARLEN_ATTENTION


def decoder_layer_classes(model_config: Any) -> tuple[str, ...]:
    """The class names of the model's decoder layers: what FSDP shards one by one."""
    from model_utils.compat import transformers_internals

    return transformers_internals.no_split_modules(model_config)


def matmul_parameters(model: Any) -> int:
    """Parameters that multiply activations: all of them, less an untied input embedding (a table lookup)."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding.weight
    return total if tied else total - embedding.weight.numel()


def flops_per_token(model_config: Any, seq_length: int, lora_args: Any = None) -> float:
    """Training FLOPs per token (forward + backward), counted on the meta device from the architecture: the same
    whatever an engine has done to the live parameters (ZeRO-3 leaves each rank empty placeholders of them).
    Every weight costs 2 per token forward and 2 for its input's gradient; one that trains 2 more for its own
    gradient: 6N in full training, 4 per frozen weight and 6 per adapter weight under LoRA (`lora_args`, when
    enabled). Plus the attention scores' 6 x layers x heads x head_dim x seq."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
        weights = matmul_parameters(model)
        trained = weights
        if lora_args is not None and lora_args.enabled:
            from model_utils.model import lora

            model = lora.wrap(model, lora_args)
            trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
            weights += trained
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    attention = 6 * model_config.num_hidden_layers * heads * head_dim * seq_length
    return 4.0 * weights + 2.0 * trained + attention
