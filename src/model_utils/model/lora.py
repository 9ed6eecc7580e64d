"""--lora_r: LoRA (peft) on a frozen pretrained model: only the adapters (and --lora_modules_to_save) train.

Where it sits in the build (trainer.create_engine): build_model -> activation_checkpointing.apply -> apply (here)
-> kernels.optimize_model on the inner Hugging Face model -> param_groups -> DeepSpeed.

- After activation checkpointing: transformers' switch is set on the plain PreTrainedModel, whose
  decoder layers peft leaves in place (it swaps only the targeted nn.Linear children for LoRA layers), so the
  checkpointed layers recompute their adapters too. That switch also registers `enable_input_require_grads()`
  (the embedding output requires grad): a reentrant checkpoint of a frozen base otherwise sees no input that
  requires grad and drops the adapters' gradients (peft#1142); the kit's checkpoint is non-reentrant, which
  needs no such input, so both forms train the adapters.
- Before Liger and torch.compile: Liger patches the Hugging Face model's own modules and loss (it does not
  know a PeftModel), and compile must trace the module tree with the adapters in it. So the kernels are applied
  to `get_base_model()`, the same model object with the adapters injected, and DeepSpeed wraps the PeftModel.
- Before the optimizer's groups: peft freezes every base parameter (requires_grad False), and
  param_groups.split_for_weight_decay takes trainable parameters only, so the frozen base never reaches the
  optimizer: ZeRO keeps fp32 masters, gradients and Adam states for the adapters alone.

Only pretrained weights make sense under adapters: a preset's random init is refused in preflight
(`check`), as are target modules the model lacks and --lora_modules_to_save naming no module. Checkpoints are the
kit's usual ones (the PeftModel's parameter names, base and adapters); `dskit export` rebuilds the PeftModel from
launch.json's `lora` section (`peft_config`) and writes the merged model, or the adapter with --adapter_only.
"""

from __future__ import annotations

from typing import Any

from model_utils.config.arguments import LoraArgs, names_list
from model_utils.errors import ConfigError
from model_utils.observe.log import print0


def peft_config(args: LoraArgs, base_model: str | None = None) -> Any:
    """The peft LoraConfig of these flags (training and export build the same one)."""
    from peft import LoraConfig

    to_save = list(names_list(args.lora_modules_to_save)) or None
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=list(names_list(args.lora_target_modules)),
        modules_to_save=to_save,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def linear_names(model: Any) -> list[str]:
    """The model's nn.Linear layer names (the last part of the module path), sorted: what LoRA can target."""
    import torch

    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check(args: LoraArgs, source: Any, model_config: Any) -> None:
    """Refuse (one line) what cannot train under LoRA, before anything is built or written: a preset (random
    init), target modules the model lacks, --lora_modules_to_save naming no module or one of tied embeddings."""
    if not args.enabled:
        return
    if source.preset is not None:
        raise ConfigError(
            f"--lora_r with --model {source.name}: a preset is randomly initialised and LoRA needs pretrained "
            "weights: pass a hub id or a local model dir, or drop --lora_r"
        )
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the module tree only: no memory for weights
        model = AutoModelForCausalLM.from_config(model_config)
    linear = linear_names(model)
    missing = [n for n in names_list(args.lora_target_modules) if n not in linear]
    if missing:
        raise ConfigError(
            f"--lora_target_modules {','.join(missing)}: not a linear layer of {model_config.model_type}; "
            f"its linear layers are {','.join(linear)}"
        )
    modules = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n}
    for name in names_list(args.lora_modules_to_save):
        if name not in modules:
            raise ConfigError(
                f"--lora_modules_to_save {name}: {model_config.model_type} has no module of that name "
                f"(e.g. {','.join(linear)})"
            )
        if getattr(model_config, "tie_word_embeddings", False) and name in ("lm_head", "embed_tokens"):
            # A trained copy of one of two tied matrices unties them: the merged export would lose one.
            raise ConfigError(
                f"--lora_modules_to_save {name}: {model_config.model_type} ties lm_head and embed_tokens; "
                "training one copy would untie them: drop it from --lora_modules_to_save"
            )


def saved_args(launch: dict[str, Any] | None) -> LoraArgs | None:
    """A checkpoint's LoRA flags, from its launch record (launch.json); None: trained without LoRA (or by a kit
    before it)."""
    section = ((launch or {}).get("config") or {}).get("lora")
    if not section or section.get("lora_r") is None:
        return None
    return LoraArgs(**section)


def _shaping(args: LoraArgs | None) -> tuple[Any, ...] | None:
    """What decides the adapters' parameter names and shapes: a checkpoint only loads into the same."""
    if args is None or not args.enabled:
        return None
    return (args.lora_r, names_list(args.lora_target_modules), names_list(args.lora_modules_to_save))


def check_resume(tag_dir: Any, launch: dict[str, Any] | None, args: LoraArgs) -> None:
    """Refuse to resume a checkpoint (tag_dir, its launch record) whose parameters are not this run's: with or
    without LoRA, or another rank or module set (the names and shapes differ, so DeepSpeed could load none)."""
    if launch is None:
        return
    saved = _shaping(saved_args(launch))
    now = _shaping(args)
    if saved == now:
        return

    def flags(shaping: tuple[Any, ...] | None) -> str:
        if shaping is None:
            return "without LoRA"
        r, targets, to_save = shaping
        return f"with --lora_r {r} --lora_target_modules {','.join(targets)}" + (
            f" --lora_modules_to_save {','.join(to_save)}" if to_save else ""
        )

    raise ConfigError(
        f"checkpoint {tag_dir} was trained {flags(saved)}, not {flags(now)}: resume with its LoRA flags, or use "
        "a new --checkpoint_dir"
    )


def parameter_counts(model: Any) -> tuple[int, int]:
    """(trainable, total) parameters, a tied parameter once."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def describe(args: LoraArgs, trainable: int, total: int) -> str:
    """E.g. 'LoRA r=16 alpha=32 on q_proj,k_proj,v_proj,o_proj: 1.15M of 596M parameters train (0.2%)'."""
    targets = ",".join(names_list(args.lora_target_modules))
    saved = names_list(args.lora_modules_to_save)
    also = f" (+ {','.join(saved)} in full)" if saved else ""
    return (
        f"LoRA r={args.lora_r} alpha={args.lora_alpha:g} on {targets}{also}: {_count(trainable)} of "
        f"{_count(total)} parameters train ({100 * trainable / total:.1f}%)"
    )


def wrap(model: Any, args: LoraArgs) -> Any:
    """peft's PeftModel around `model` with these flags' adapters: the one place training, export and estimate
    build it."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing` (transformers 5.23 warns once per
        # rank); the kit sets checkpointing through the new API itself, so the warning asks nothing of a user.
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return get_peft_model(model, peft_config(args))


def apply(model: Any, args: LoraArgs, seed: int, announce: bool = True) -> Any:
    """The PeftModel with adapters on a freshly built (and checkpointing-switched) model; the model itself when
    LoRA is off. Logs one line of what trains (announce=False: silent)."""
    if not args.enabled:
        return model
    import torch

    # The adapters' random init (lora_A) from the run's seed: the same on every rank, whatever consumed the RNG
    # before (ZeRO-3 partitions each rank's own copy, it broadcasts nothing), and the same under every ZeRO stage.
    torch.manual_seed(seed)
    peft_model = wrap(model, args)
    if announce:
        print0(describe(args, *parameter_counts(peft_model)))
    return peft_model


def hf_model(model: Any) -> Any:
    """The Hugging Face model inside a PeftModel (adapters injected), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def adapters_off(model: Any) -> Any:
    """A context in which a PeftModel computes as its base model (the adapters disabled: a preference objective's
    reference); nothing changes for a model without adapters."""
    import contextlib

    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
