"""`dskit export`: a DeepSpeed ZeRO or FSDP (DCP) checkpoint tag -> a Hugging Face model dir (safetensors, config,
tokenizer).

The weights come from ZeRO's fp32 master copy (the optimizer shards), not from the 16-bit module weights: for
ZeRO-3 those are partitioned, and the masters are what training would continue from. The model's architecture
and tokenizer come from the tag's `hf_config/`, written by save_pretrained at checkpoint time, so an export
needs neither the original --model nor network access.

Memory (P = parameter count; "copies" are of the full weights):
  * ZeRO-2: DeepSpeed concatenates the ranks' fp32 partitions into one flat fp32 vector (4 B/P) and hands out
    views into it. fp32 export assigns those views as they are: one copy at peak. bf16 export casts each view
    (2 B/P) while the flat vector is still referenced by the other views: 1.5 fp32-copies (6 B/P) at peak.
    Before that, DeepSpeed briefly loads mp_rank_00_model_states.pt whole (the bf16 module, 2 B/P), freed
    before the optimizer shards are read.
  * ZeRO-3: lazy mode gathers one parameter at a time from the memory-mapped shards, so the peak is the output
    (bf16 2 B/P, fp32 4 B/P) plus one fp32 parameter.
  * The model is built on the meta device and the state dict is assigned into it (no second copy), and
    safetensors writes straight from the tensors' memory. The mapped shard pages count in RSS while mapped,
    but they are page cache the kernel can drop, not allocations.
  * LoRA (--lora_r; launch.json's `lora` section): the merge W + B A alpha/r is peft's, in fp32, rounded to the
    output dtype once. W is the base the run started from, in its own dtype, where it is at hand (a local --model
    at launch.json's `model_dir`, a hub model's pinned commit in the HF cache) and is the base the run trained
    on (the checkpoint's copy is it, rounded to the run's precision); else the checkpoint's copy of the frozen
    base (the shards' frozen parameters, saved in the training dtype: an fp32 base rounded to bf16). The line it
    prints says which. 4 B/P at peak plus the output, and the base's own weights while its copy is replaced.

  * FSDP (--backend fsdp): the tag's dcp/ shards hold the fp32 masters; they are read in this one process
    (torch.distributed.checkpoint with no_dist) into full fp32 tensors (4 B/P), then cast: 4 B/P plus the
    output at peak.

The engine that wrote the tag reads it (its read_full_state_dict, engines/): this module knows no engine.

Every tensor is checked to hold its full shape's elements before anything is written: a ZeRO-3 parameter
saved while partitioned (what a plain save_pretrained of a live ZeRO-3 PeftModel writes: 0-element adapters)
is refused, not exported.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_utils import engines
from model_utils.checkpoint import launch_record
from model_utils.config.arguments import LoraArgs, check_hub_repo
from model_utils.errors import CommandParser, ConfigError, ModelUnavailable, first_line
from model_utils.model import lora
from model_utils.storage import file_manifest

if TYPE_CHECKING:
    from model_utils.engines.base import CheckpointFormat

DTYPES = ("bf16", "fp32")


def resolve_tag(checkpoint: Path) -> tuple[Path, str]:
    """(checkpoint dir, tag) for a tag dir, or for a checkpoint dir the tag a resume would pick: the newest
    whose manifest verifies (checkpoint.newest_verified), not whatever `latest` names."""
    # The protocol imports torch: here, not at module level, so `dskit export --help` stays instant.
    from model_utils.checkpoint.protocol import is_tag_dir, newest_verified

    if not checkpoint.is_dir():
        what = "does not exist" if not checkpoint.exists() else "is not a directory"
        raise ConfigError(
            f"checkpoint {checkpoint} {what}: pass a checkpoint dir (the run's --checkpoint_dir) or one of its tag dirs"
        )
    if is_tag_dir(checkpoint):
        return checkpoint.parent, checkpoint.name
    target = newest_verified(checkpoint)
    if target is None:
        raise ConfigError(
            f"{checkpoint} holds no verified checkpoint and is not a checkpoint tag dir (no *model_states.pt): "
            "pass the --checkpoint_dir of a run or a tag dir inside it"
        )
    return target.load_dir, target.tag


def _check_tag(tag_dir: Path) -> tuple[type[CheckpointFormat], Path]:
    """The engine that wrote the tag and the tag's hf_config dir, after checking the tag is complete (its
    manifest verifies) and exportable."""
    from model_utils.checkpoint.protocol import HF_CONFIG_DIR

    problem = file_manifest.verify(tag_dir)
    if problem is not None:
        raise ConfigError(
            f"checkpoint {tag_dir} is incomplete or damaged ({problem}): export an older tag of that run"
        )
    name = engines.engine_of_tag(tag_dir)
    if name is None:
        raise ConfigError(
            f"checkpoint {tag_dir} holds no training engine's files ({', '.join(engines.NAMES)} wrote none of "
            "them): export a tag of a dskit run"
        )
    engine = engines.checkpoint_format(name)
    engine.check_exportable(tag_dir)
    hf_config = tag_dir / HF_CONFIG_DIR
    if not (hf_config / "config.json").is_file():
        raise ConfigError(
            f"checkpoint {tag_dir} has no {HF_CONFIG_DIR}/config.json (saved by an older dskit?): copy the "
            f"model's config.json and tokenizer files into {hf_config}"
        )
    return engine, hf_config


def _check_out_dir(out_dir: Path) -> None:
    # Refuse rather than merge or overwrite: the directory may hold the user's files (or an earlier export).
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"output {out_dir} already exists and is not empty: pass a new directory")


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


def _check_complete(model: Any, state: dict[str, Any], tag_dir: Path) -> None:
    """Every tensor holds as many elements as its full shape (the model on the meta device knows it)."""
    for name, expected in model.state_dict().items():
        got = state.get(name)
        if got is not None and got.numel() != expected.numel():
            raise ConfigError(
                f"checkpoint {tag_dir} holds {name} with {got.numel()} of its {expected.numel()} elements (a "
                "partitioned ZeRO-3 parameter, not the whole tensor): nothing was written; export another tag"
            )


def _build_model(hf_config: Path, state: dict[str, Any], lora_args: LoraArgs | None, tag_dir: Path) -> Any:
    """The model (a PeftModel for a LoRA run) with the checkpoint's weights assigned."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_config)
    # Meta device: no memory for weights that are about to be replaced by `assign`.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if lora_args is not None:
            # The run's adapters around the same module tree: its parameter names are the checkpoint's.
            model = lora.wrap(model, lora_args)
    _check_complete(model, state, tag_dir)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"the checkpoint's weights do not fit the model in {hf_config / 'config.json'} ({detail}): "
            "export with the config the run trained"
        ) from None
    # assign=True gives each name its own Parameter; tie them again so save_pretrained stores one tensor.
    lora.hf_model(model).tie_weights()
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    # Non-persistent buffers (RoPE inv_freq) stay on meta: save_pretrained does not write them and
    # from_pretrained recomputes them.
    assert not meta, f"parameters left on the meta device: {meta[:5]}"
    if (hf_config / "generation_config.json").is_file():
        from transformers import GenerationConfig

        lora.hf_model(model).generation_config = GenerationConfig.from_pretrained(hf_config)
    return model


# The dtype a run holds its model in (launch.json's resolved precision): its checkpoint's copy of a frozen base.
_PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _base_dir(launch: dict[str, Any]) -> tuple[Path | None, str]:
    """Where the base weights the run started from are on this machine (None: not at hand), and what it is or
    why not."""
    local = launch.get(launch_record.MODEL_DIR)
    if local is not None:
        there = (Path(local) / "config.json").is_file()
        return (Path(local), local) if there else (None, f"{local} is not there")
    resolved = launch.get("resolved") or {}
    repo, commit = resolved.get("model"), resolved.get("model_commit")
    if repo is None or commit is None:
        return None, "the run's launch.json does not say where its base came from (a kit before model_dir)"
    from model_utils.model import hub

    try:  # the pinned commit, from the HF cache alone: an export fetches nothing
        snap = hub.resolve(repo, commit, "model", weights=True, local_only=True)
    except ModelUnavailable:
        return None, f"{repo}@{commit[:12]} is not in the HF cache"
    return snap.path, f"{repo}@{commit[:12]}"


def _onto_base(state: dict[str, Any], launch: dict[str, Any], lora_args: LoraArgs) -> str:
    """Replace the checkpoint's copy of the frozen base in `state` with the base weights the run started from,
    upcast exactly to fp32, where they are at hand and are what the run trained on: the checkpoint's copy equals
    them, or them rounded to the run's precision. Returns what the merge is onto, for the line that says it."""
    import torch
    from transformers import AutoModelForCausalLM

    precision = (launch.get("resolved") or {}).get("precision")
    held = getattr(torch, _PRECISIONS.get(precision, "float32"))
    copy = f"the checkpoint's {precision or 'training-dtype'} copy of the base"
    path, what = _base_dir(launch)
    if path is None:
        return f"{copy} ({what})"
    try:
        base = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    except (OSError, ValueError) as e:
        return f"{copy} (the base at {what} does not load: {first_line(e)})"
    # The run's adapters around it name its parameters as the checkpoint does; the frozen ones are the base.
    wrapped = lora.wrap(base, lora_args)
    frozen = {
        n: p.detach() for n, p in wrapped.named_parameters(remove_duplicate=False) if not p.requires_grad
    }
    for name, weight in frozen.items():
        saved = state.get(name)
        if (
            saved is None
            or saved.shape != weight.shape
            or not (torch.equal(saved, weight.float()) or torch.equal(saved, weight.to(held).float()))
        ):
            return f"{copy} (the base at {what} is not the one the run trained on: its {name} differs)"
    own = {weight.dtype for weight in frozen.values()}
    for name, weight in frozen.items():
        state[name] = weight.float()
    return f"the base the run started from, {what} ({', '.join(str(d).removeprefix('torch.') for d in own)})"


def export(
    checkpoint: Path,
    out_dir: Path,
    dtype: str = "bf16",
    adapter_only: bool = False,
    staging_dir: Path | None = None,
    replace: bool = False,
    on_line: Callable[[str], Any] = print,
) -> Path:
    """Write the checkpoint (a run's checkpoint dir: its newest verified tag; or a tag dir) as a Hugging Face
    model dir, a LoRA run's adapters merged (onto which base weights: one line through on_line); with
    adapter_only, a LoRA run's adapter dir (PeftModel loads it on the base model). The tokenizer carries the chat
    template the run trained with (the tag's hf_config/ holds it). out_dir may exist (empty, or with replace its
    contents are replaced; the dir itself is kept: it may be a mount point). The export is staged in staging_dir
    (default out_dir's parent) and moved in (move_into). Returns out_dir."""
    torch_dtype = _torch_dtype(dtype)
    load_dir, tag = resolve_tag(Path(checkpoint))
    if not replace:
        _check_out_dir(Path(out_dir))
    engine, hf_config = _check_tag(load_dir / tag)
    launch = launch_record.read(load_dir / tag)
    lora_args = lora.saved_args(launch)
    if adapter_only and lora_args is None:
        raise ConfigError(
            f"checkpoint {load_dir / tag} was trained without LoRA (--lora_r): it has no adapter to write; "
            "drop --adapter_only to export the whole model"
        )

    from model_utils.launch import startup

    # DeepSpeed through the kit's import (accelerate's save_pretrained imports it: on a machine without a GPU its
    # own import warns "Setting accelerator to CPU"), and no progress bars.
    startup.import_deepspeed()
    startup.transformers_bars_off()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_config)
    except (OSError, ValueError) as e:
        reason = first_line(e)
        raise ConfigError(
            f"no usable tokenizer in {hf_config} ({reason}): copy the run's tokenizer files there"
        ) from None
    import torch

    # LoRA: fp32 until the merge (or the adapter's cast), so the merged weights are rounded once.
    load_dtype = torch.float32 if lora_args is not None else torch_dtype
    # The consolidated fp32 weights, each materialised and cast one tensor at a time (see the module doc).
    state = engine.read_full_state_dict(load_dir / tag, load_dtype)
    if lora_args is not None and not adapter_only:
        on_line(f"LoRA: merging the adapter onto {_onto_base(state, launch or {}, lora_args)}")
    model = _build_model(hf_config, state, lora_args, load_dir / tag)
    if lora_args is not None:
        if adapter_only:
            base = ((launch or {}).get("config") or {}).get("model", {})
            model.peft_config["default"].base_model_name_or_path = base.get("model")
        else:
            model = model.merge_and_unload()
            model.tie_weights()
        model = model.to(torch_dtype)

    # Staged whole first (next to out_dir, or on the volume staging_dir names), then moved in: a failed export
    # leaves out_dir as it was.
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage_parent = Path(staging_dir) if staging_dir is not None else out_dir.parent
    stage_parent.mkdir(parents=True, exist_ok=True)
    tmp = stage_parent / f".{out_dir.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a restarted job's pid can be the killed one's (PID 1)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # transformers writes model.safetensors through a 0600 temp file; give every file the umask's mode,
        # as a shared model dir on a cluster must be readable by whoever the umask allows.
        umask = os.umask(0)
        os.umask(umask)
        for path in tmp.iterdir():
            path.chmod(0o666 & ~umask)
        move_into(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


# Moved in last and removed first: from_pretrained needs it, so a dir without it never passes for a model.
LAST_FILE = "config.json"


def move_into(staged: Path, out_dir: Path) -> None:
    """Make out_dir hold exactly staged's files, never removing or renaming out_dir itself (SageMaker's
    /opt/ml/model is a mount point: EBUSY). LAST_FILE goes first when old contents are cleared and comes last
    when the new ones move in, so an interrupted move leaves a dir without config.json, never a partial model
    that loads. Each file is copied to a hidden `.part` name in out_dir, then renamed (atomic on its
    filesystem); a same-filesystem move is a rename."""
    out_dir.mkdir(parents=True, exist_ok=True)
    old = sorted(out_dir.iterdir(), key=lambda p: p.name != LAST_FILE)
    for path in old:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for path in sorted(staged.iterdir(), key=lambda p: p.name == LAST_FILE):
        part = out_dir / f".{path.name}.part"
        if path.is_dir():
            shutil.copytree(path, part)
        else:
            shutil.copy2(path, part)
        os.replace(part, out_dir / path.name)
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="dskit export",
        description="Write a checkpoint as a Hugging Face model dir (safetensors, config.json, tokenizer).",
    )
    parser.add_argument(
        "checkpoint",
        help="a checkpoint dir (its newest verified tag is exported, whatever 'latest' says) or a tag dir",
    )
    parser.add_argument("out_dir", help="new (or empty) directory for the model")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="weight dtype (default: bf16)")
    parser.add_argument(
        "--adapter_only",
        action="store_true",
        help="a LoRA run: write the adapter (PeftModel.from_pretrained on the base model) instead of the merged model",
    )
    hub = parser.add_argument_group("the hub (HF_TOKEN, HF_ENDPOINT as for huggingface_hub)")
    hub.add_argument(
        "--push_to_hub", metavar="REPO", help="then push the model dir to this hub repo (user/name)"
    )
    hub.add_argument("--private", action="store_true", help="create the repo private (a new repo only)")
    hub.add_argument("--revision", help="the branch to push to, made if missing (default: main)")
    return parser


def main(argv: list[str]) -> int:
    """`dskit export CHECKPOINT[/TAG] OUT_DIR [--dtype bf16|fp32] [--adapter_only]`."""
    ns = build_parser().parse_args(argv)
    if (ns.private or ns.revision is not None) and ns.push_to_hub is None:
        raise ConfigError(
            "the hub flags (--revision, --private) need --push_to_hub REPO: add it or drop them"
        )
    check_hub_repo(ns.push_to_hub)
    out = export(Path(ns.checkpoint), Path(ns.out_dir), ns.dtype, ns.adapter_only)
    load_dir, tag = resolve_tag(Path(ns.checkpoint))
    what = ", the LoRA adapter only" if ns.adapter_only else ""
    print(f"exported {load_dir / tag} to {out} ({ns.dtype}{what})")
    if ns.push_to_hub is not None:
        from dskit import hub_push

        card = hub_push.card_for_checkpoint(load_dir / tag, ns.push_to_hub)
        url = hub_push.push(out, ns.push_to_hub, card=card, private=ns.private, revision=ns.revision)
        print(f"pushed {out} to {ns.push_to_hub}{f' ({ns.revision})' if ns.revision else ''}: {url}")
    return 0
