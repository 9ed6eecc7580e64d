"""`dskit config --format yaml`: the resolved run as a run file that can be fed back (`--config`) unchanged.

Every flag of every section is written, with the values that train: the micro batch, accumulation, lr and
warm-up the DeepSpeed config and the flags resolved to, the sequence length the model allows, max_steps from
--epochs. The DeepSpeed config is embedded as given (its "auto" keys stay: the kit fills them at each launch),
except the kit's default, which is left out so that CUDA ranks still choose it or its GPU-only sibling.
A value is null where it is not given: the other member of a pair of which one decides (--epochs/--max_steps,
--warmup_steps/--warmup_ratio, --validation_split/--validation_fraction), the WSD flags of another schedule,
--fsdp_cpu_offload under deepspeed, the micro batch and accumulation when no batch flag is given (CUDA ranks
then pick their default), the spike guard flags its mode does not read (the mode that runs: off where DeepSpeed cannot
discard a step) and the sample flags of a run without --sample_prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model_utils.config import run_file as run_file_format
from model_utils.config.arguments import ONE_OF, SAMPLE_ONLY, SECTIONS, GuardArgs, engine_only_flags
from model_utils.observe import redact
from model_utils.resolve import train_settings
from model_utils.resolve.resolver import ResolvedRun

_WSD_ONLY = ("decay_fraction", "decay_type", "decay_from_step")


def run_file(run: ResolvedRun) -> dict[str, Any]:
    cfg, ts = run.config, run.settings.train
    sections: dict[str, dict[str, Any]] = {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}
    optim, loop, data = sections["optim"], sections["loop"], sections["data"]
    del optim["deepspeed_config"]  # the config itself is embedded below
    optim["micro_batch_size"] = run.micro_batch_size
    optim["gradient_accumulation_steps"] = ts.gradient_accumulation_steps
    optim["lr"] = ts.optim.lr
    optim["warmup_steps"] = ts.schedule.warmup_steps
    data["seq_length"] = run.seq_length
    if cfg.data.sources is not None:  # the run file's own form: a list of sources
        data["sources"] = [spec.to_dict() for spec in cfg.data.source_specs]
    if not ts.batch_given and ts.global_batch_tokens is None:  # not given: CUDA ranks' batch default stays
        optim["micro_batch_size"] = optim["gradient_accumulation_steps"] = None
    if cfg.loop.epochs is None and run.max_steps is not None:
        loop["max_steps"] = run.max_steps
    flat = {key: section for section in sections.values() for key in section}
    for pair in ONE_OF:
        for flag, other in (pair, pair[::-1]):
            if flag in cfg.explicit and other not in cfg.explicit:
                flat[other][other] = None
    if ts.schedule.kind != "wsd":
        for flag in _WSD_ONLY:
            flat[flag][flag] = None
    for flag in engine_only_flags(cfg.optim.backend):
        flat[flag][flag] = None  # another engine's flag (--fsdp_cpu_offload under deepspeed): given, an error
    if cfg.report.sample_prompts is None:
        for flag in SAMPLE_ONLY:
            flat[flag][flag] = None  # given without prompts: an error
    for flag in cfg.objective.unused():
        flat[flag][flag] = None  # another objective's: given, an error
    sections["guard"]["spike_guard"] = run.settings.spike_guard
    for flag in GuardArgs.unused_in(run.settings.spike_guard):
        flat[flag][flag] = None
    if train_settings.default_in_use(cfg):
        return sections  # no section: fed back, CUDA ranks still choose between the default and GPU-only
    return {**sections, run_file_format.DEEPSPEED: train_settings.given(cfg)[1]}


def dump(run: ResolvedRun) -> str:
    header = (
        "The resolved run (dskit config --format yaml): train it with --config THIS_FILE. Flags given after\n"
        "--config override it; null means not given."
    )
    if train_settings.default_in_use(run.config):
        header += (
            f"\nNo deepspeed section: the default {train_settings.given(run.config)[0]} (on CUDA ranks "
            f"{train_settings.gpu_only_config(run.config)} where the memory estimate fits the GPU)."
        )
    sections = redact.tree(run_file(run))  # printed: a tracking URI's password stays out of the terminal
    deepspeed = sections.pop(run_file_format.DEEPSPEED, None)
    return run_file_format.dumps(sections, header, deepspeed)
