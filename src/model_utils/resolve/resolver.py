"""The resolved run: everything a run needs before the first step, resolved once and frozen.

`resolve_settings` derives what depends on the config, the launch environment and the model alone (the training
settings: batch, precision, optimizer and schedule; the sequence length); `prepare` adds what depends on the data, the checkpoints and the ranks (packed blocks, the checkpoint
to resume, the probed micro batch, max_steps from --epochs). The trainer, `dskit doctor`, `dskit estimate`,
`dskit bench` and `dskit config` all read these objects; nothing else re-derives them, and the user's config is
never changed. Checks run in order, so bad input fails early with one line.

Used by the training ranks and by `dskit prepare` (one process, no GPUs), which the launchers run first: it
leaves the packed data in the cache, so the ranks start straight from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_utils import engines
from model_utils.checkpoint import launch_record, protocol
from model_utils.config import accelerate_env
from model_utils.config.arguments import AUTO, CUDA_GLOBAL_BATCH_TOKENS, PACKING_DOCUMENTS, TrainConfig
from model_utils.data import block_cache, chat, mixture, prompts, sampler, token_shards
from model_utils.data.documents import EMBEDDED
from model_utils.data.packing import PackedBlocks
from model_utils.data.pairs import PairBlocks
from model_utils.data.rows import BlockSource
from model_utils.engines import sequence_parallel
from model_utils.errors import ConfigError
from model_utils.launch import startup
from model_utils.model import hub, lora, models
from model_utils.observe.log import print0
from model_utils.resolve import batch_layout, train_settings
from model_utils.resolve.run_settings import RunSettings
from model_utils.resolve.train_settings import TrainSettings

if TYPE_CHECKING:
    from model_utils.launch.distributed import DistInfo


@dataclass(frozen=True)
class ResolvedRun:
    settings: RunSettings
    tokenizer: Any
    train_blocks: BlockSource  # a prepared dataset's TokenBlocks, or a mixture of sources (data/mixture.py)
    val_blocks: BlockSource | None
    resume: protocol.ResumeTarget | None
    # None outside the ranks (`dskit prepare`): per-rank values stay open; `dskit config` plans for a machine.
    world_size: int | None
    micro_batch_size: int | str  # AUTO only outside the ranks: rank 0 probes its GPU
    steps_per_epoch: int | None
    max_steps: int | None  # --max_steps, or --epochs x steps_per_epoch
    # What a resume changes in the schedule its checkpoint ran (ScheduleSpec.resume_line); None: nothing.
    schedule_change: str | None = None
    # False: a resume onto another --lr_schedule, whose scheduler state the engine must not load.
    loads_schedule_state: bool = True
    # The content of the training data (token_shards.content_fingerprint), recorded in every checkpoint and
    # compared on resume (the trainer resets the data position of a resume onto other data with --new_data).
    data_fingerprint: str | None = None
    # --sample_prompts, read and tokenized (data/prompts.py); () without samples.
    sample_prompts: tuple[prompts.Prompt, ...] = ()
    # The content of the validation split of that dataset (None: a mixture, or no validation split), which names
    # DPO's reference log-probabilities with the training data's (loop/observers/reference.py).
    validation_fingerprint: str | None = None

    @property
    def config(self) -> TrainConfig:
        return self.settings.config

    @property
    def source(self) -> models.ModelSource:
        return self.settings.source

    @property
    def model_config(self) -> Any:
        return self.settings.model_config

    @property
    def seq_length(self) -> int:
        return self.settings.seq_length

    @property
    def documents_apart(self) -> bool:
        """Whether the blocks keep documents apart (their rows answer document positions): --packing documents,
        or prompt/completion and conversation data (packed whole, always apart), alone or in a mixture."""
        sources = getattr(self.train_blocks, "sources", (self.train_blocks,))
        packed = any(isinstance(source, PackedBlocks) for source in sources)
        return self.config.data.packing == PACKING_DOCUMENTS or packed

    @property
    def complete(self) -> str | None:
        """The one line saying the run is complete: it resumes a checkpoint at or past max_steps, so nothing is
        left to train (the launchers start no rank: not an error, a requeue of a finished job included); else
        None."""
        step = None if self.resume is None else protocol.tag_step(self.resume.tag)
        if self.config.loop.validation_only:  # a finished run's checkpoint is measured, not trained
            return None
        if step is None or self.max_steps is None or step < self.max_steps:
            return None
        assert self.resume is not None
        return (
            f"run complete: {self.resume.path} is at step {step}, {'at' if step == self.max_steps else 'past'} "
            f"--max_steps {self.max_steps}: nothing to train (raise --max_steps to continue it, or pass a new "
            "--checkpoint_dir to start another run)"
        )

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.settings.train.gradient_accumulation_steps

    @property
    def sequence_parallel(self) -> int:
        return self.config.optim.sequence_parallel

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks (each counted once, however many ranks share it)."""
        assert isinstance(self.micro_batch_size, int) and self.world_size is not None
        return (
            self.micro_batch_size
            * self.gradient_accumulation_steps
            * self.world_size
            // self.sequence_parallel
        )

    @property
    def paired(self) -> bool:
        """Preference pairs: each of the global batch's blocks is a pair, two rows of seq_length tokens."""
        return isinstance(self.train_blocks, PairBlocks)

    @property
    def tokens_per_step(self) -> int:
        """The positions a step computes (padding included, as packed blocks' is): a pair's two rows each."""
        layout = self.layout
        assert layout is not None, "known on the ranks"
        return layout.tokens

    @property
    def layout(self) -> batch_layout.BatchLayout | None:
        """micro x accumulation x ranks x seq; None outside the ranks, where the per-rank values stay open."""
        if not isinstance(self.micro_batch_size, int) or self.world_size is None:
            return None
        ts = self.settings.train
        return batch_layout.BatchLayout(
            self.micro_batch_size,
            ts.gradient_accumulation_steps,
            self.world_size // self.sequence_parallel,
            self.seq_length,
            ts.global_batch_tokens,
            ts.global_batch_from,
            self.sequence_parallel,
            self.paired,
        )

    def deepspeed_config(self) -> dict[str, Any]:
        """A fresh DeepSpeed dict for deepspeed.initialize (DeepSpeed may change what it is given); under fsdp, what
        the FSDP engine's settings amount to in the same format (recorded with every checkpoint)."""
        assert isinstance(self.micro_batch_size, int) and self.max_steps is not None
        return self.settings.train.deepspeed_json(self.micro_batch_size, self.max_steps)

    def _schedule(self) -> dict[str, Any]:
        if self.max_steps is None:
            return {}
        ts, total = self.settings.train, self.max_steps
        steps = {1, 2, total // 4, total // 2, 3 * total // 4, total - 1, total}
        warmup = ts.schedule.warmup_for(total)  # what runs: --warmup_ratio of the run, at most the run
        if warmup:
            steps |= {warmup, warmup + 1}
        shown = sorted(s for s in steps if 1 <= s <= total)
        return {
            "warmup_steps": warmup,
            "lr_schedule": ts.schedule.describe(total, engines.engine_class(ts.backend).runs_schedule),
            "lr_schedule_kind": ts.schedule.kind,  # what a resume compares (launch_record.ran_schedule)
            "lr_at_step": dict(zip(shown, ts.lr_at(total, shown), strict=True)),
        }

    def to_dict(self) -> dict[str, Any]:
        """The resolved run as `dskit config` prints it."""
        per_rank_open = (
            "per rank: known when the ranks start"
            if self.world_size is None
            else "set at launch, from the micro batch rank 0 probes on its GPU"
        )
        mb_known = isinstance(self.micro_batch_size, int)
        ts, layout = self.settings.train, self.layout
        accumulation_known = ts.global_batch_tokens is None or layout is not None
        tokens: int | str | None = ts.global_batch_tokens
        if tokens is None and not ts.batch_given and self.world_size is None:
            tokens = f"{CUDA_GLOBAL_BATCH_TOKENS} on CUDA ranks (with micro batch auto), else none"
        return {
            "config": self.config.to_dict(),
            "resolved": {
                **self.settings.to_dict(),
                # The kit's default DeepSpeed config, as the ranks' GPUs choose it (unplanned: what they may choose).
                **(
                    {
                        "deepspeed_config": ts.path
                        if self.world_size is not None
                        else f"{ts.path}; on CUDA ranks {train_settings.gpu_only_config(self.config)} where the "
                        "memory estimate fits the GPU"
                    }
                    if train_settings.default_in_use(self.config)
                    else {}
                ),
                "global_batch_tokens": tokens,
                "batch_layout": per_rank_open if layout is None else layout.describe(),
                "micro_batch_size": self.micro_batch_size,
                "gradient_accumulation_steps": ts.gradient_accumulation_steps
                if accumulation_known
                else per_rank_open,
                "world_size": self.world_size if self.world_size is not None else per_rank_open,
                "max_steps": self.max_steps if self.max_steps is not None else per_rank_open,
                "steps_per_epoch": self.steps_per_epoch
                if self.steps_per_epoch is not None
                else per_rank_open,
                "train_blocks": len(self.train_blocks),
                "documents_apart": self.documents_apart,
                "validation_blocks": None if self.val_blocks is None else len(self.val_blocks),
                "resume_from": None if self.resume is None else str(self.resume.path),
                "data_fingerprint": self.data_fingerprint,
                **({} if self.schedule_change is None else {"schedule_change": self.schedule_change}),
                **self._schedule(),
            },
            "deepspeed": self.deepspeed_config()
            if self.max_steps is not None and mb_known and accumulation_known
            else per_rank_open,
        }


def resolve_settings(
    cfg: TrainConfig,
    gpu_bytes: int | None = None,
    world_size: int = 1,
    on_ranks: bool = False,
    env: Mapping[str, str] | None = None,
) -> RunSettings:
    """The training settings (checked by DeepSpeed) and the model's config and sequence length. `gpu_bytes`: the
    memory of the CUDA GPU each of `world_size` ranks trains on, where the ranks resolve (the default DeepSpeed
    config is then chosen by the memory estimate).

    First the launch environment (`env`, default the process's) joins the config: under `accelerate launch`, the
    accelerate config's settings (accelerate_env.join); RunSettings.config is the result.

    A hub model resolves to its pinned snapshot in the HF cache (hub.resolve): its small files fetched here,
    its weights by `prepare(fetch_hub=True)`; `on_ranks`: from the cache alone, weights included.
    """
    cfg = accelerate_env.join(cfg, os.environ if env is None else env)
    with cfg.origins_named():
        return _resolve_settings(cfg, gpu_bytes, world_size, on_ranks)


def may_render_chat_templates(cfg: TrainConfig) -> bool:
    """Whether this process may prepare conversation or prompt/completion data itself (then it renders chat
    templates): not for plain text, the embedded corpus or an already prepared dataset."""
    data = cfg.data
    if data.data_format == chat.TEXT:
        return False
    if data.data_format != "auto" or data.chat_template is not None or data.sources is not None:
        return True
    return not (data.dataset == EMBEDDED or token_shards.state(Path(data.dataset)) == "prepared")


def _resolve_settings(
    cfg: TrainConfig, gpu_bytes: int | None, world_size: int, on_ranks: bool
) -> RunSettings:
    # The first import of transformers in a rank: without what it does not use.
    startup.import_transformers(chat_templates=may_render_chat_templates(cfg))
    source = models.resolve_model_source(cfg.model.model)
    ts = _train_settings(cfg)
    source = _hub_model(cfg, source, on_ranks)
    model_config = models.load_model_config(source)
    seq_length = models.resolve_seq_length(cfg.data.seq_length, model_config)
    lora.check(
        cfg.lora, source, model_config
    )  # a preset, or modules the model lacks: before anything is built
    if cfg.accelerate is not None:
        print0(cfg.accelerate.describe())
        if (
            cfg.accelerate.fsdp_layer_classes
        ):  # an FSDP request (--backend fsdp): they must be what FSDP shards
            accelerate_env.check_wrapped_layers(cfg.accelerate, models.decoder_layer_classes(model_config))
    settings = RunSettings(cfg, source, model_config, seq_length, ts, _spike_guard_mode(cfg, ts))
    if gpu_bytes is not None and train_settings.default_in_use(cfg):
        settings = choose_default_config(settings, gpu_bytes, world_size)
    return settings


def _train_settings(cfg: TrainConfig, gpu_only: bool = False) -> TrainSettings:
    """train_settings.resolve, and the accelerate config the ranks were launched with must agree with it."""
    ts = train_settings.resolve(cfg, gpu_only)
    if cfg.accelerate is not None:
        if engines.memory_model(ts.backend).zero_stages:  # it reads the DeepSpeed config's ZeRO section
            accelerate_env.check_deepspeed(cfg.accelerate, json.loads(ts.given_config), ts.path)
        else:
            accelerate_env.check_precision(cfg.accelerate, ts.precision, ts.path)
    return ts


def choose_default_config(settings: RunSettings, gpu_bytes: int, world_size: int) -> RunSettings:
    """On CUDA ranks with the kit's default DeepSpeed config: the GPU-only config (no CPU offload, which costs
    ~0.22 s an optimizer step on a 0.6B model, docs/speed.md) where the memory estimate of it, at this run's
    micro batch (auto: 1, the least the probe picks), fits the GPU; else the offload default. One log line says
    which and why."""
    from model_utils.resolve import memory_estimate

    cfg = settings.config
    on_gpu = _train_settings(cfg, gpu_only=True)
    candidate = replace(settings, train=on_gpu, spike_guard=_spike_guard_mode(cfg, on_gpu))
    per_node = _ranks_per_node(world_size)
    est = memory_estimate.estimate_for_config(candidate, world_size // per_node, per_node)
    used, total = est.device_bytes_per_rank / memory_estimate.GiB, gpu_bytes / memory_estimate.GiB
    if memory_estimate.fits_gpu(est, gpu_bytes):
        print0(
            f"deepspeed config: {on_gpu.path} (GPU-only: estimated {used:.1f} GiB of {total:.0f} GiB per GPU)"
        )
        return candidate
    print0(
        f"deepspeed config: {settings.train.path} (CPU optimizer offload: GPU-only needs an estimated "
        f"{used:.1f} GiB of {total:.0f} GiB per GPU, over {memory_estimate.FIT_FRACTION:.0%})"
    )
    return settings


def _ranks_per_node(world_size: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE (the node's ranks: host RAM in the estimate), else all ranks on one node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return local if 1 <= local <= world_size and world_size % local == 0 else world_size


def _rank_gpu_bytes() -> int | None:
    """The memory of this rank's CUDA GPU; None without one (CPU ranks)."""
    if not batch_layout.trains_on_cuda():
        return None
    import torch

    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _hub_model(cfg: TrainConfig, source: models.ModelSource, on_ranks: bool) -> models.ModelSource:
    """The model, with its pinned snapshot when a hub id."""
    revision = cfg.model.model_revision
    if revision is not None and not source.is_hub:
        raise ConfigError(
            f"--model_revision {revision} applies to a hub --model, not {source.name}: drop --model_revision"
        )
    if not source.is_hub:
        return source
    pinned = hub.read_pins(cfg.checkpoint.checkpoint_dir).get("model")
    snap = hub.resolve(source.name, revision, "model", weights=on_ranks, local_only=on_ranks, pinned=pinned)
    return dataclasses.replace(source, snapshot=snap)


def _hub_tokenizer(cfg: TrainConfig, source: models.ModelSource, on_ranks: bool) -> hub.Snapshot | None:
    """The tokenizer's pinned snapshot when a hub id (a hub model's own: in the model's snapshot)."""
    name = models.tokenizer_name(source, cfg.model.tokenizer)
    if name == source.name and source.snapshot is not None:
        return source.snapshot
    if not models.is_hub_id(name):
        return None
    pinned = hub.read_pins(cfg.checkpoint.checkpoint_dir).get("tokenizer")
    return hub.resolve(name, None, "tokenizer", weights=False, local_only=on_ranks, pinned=pinned)


def _spike_guard_mode(cfg: TrainConfig, ts: TrainSettings) -> str:
    mode = cfg.guard.spike_guard
    if mode == "off" or ts.discards_nonfinite_steps:
        return mode
    why = (
        f"DeepSpeed applies non-finite gradients in {ts.precision} without ZeRO ({ts.path}), so a spiking step "
        "cannot be discarded"
    )
    if "spike_guard" in cfg.explicit:
        raise ConfigError(
            f"--spike_guard {mode}: {why}: train in bf16 or under ZeRO, or use --spike_guard off"
        )
    print0(f"Spike guard off: {why}")
    return "off"


def _sample_prompts(cfg: TrainConfig, tokenizer: Any, seq_length: int) -> tuple[prompts.Prompt, ...]:
    report = cfg.report
    if report.sample_prompts is None:
        return ()
    template = chat.options(cfg.data, tokenizer, chat.TEXT)[
        "template"
    ]  # --chat_template, else the tokenizer's
    given = prompts.read(report.sample_prompts)
    return prompts.encode(given, tokenizer, template, seq_length, report.sample_max_new_tokens)


def _blocks_or_error(
    dataset: token_shards.PreparedDataset, split: str, cfg: TrainConfig, seq_length: int
) -> BlockSource:
    blocks = dataset.blocks(
        split,
        seq_length,
        documents_apart=cfg.data.packing == PACKING_DOCUMENTS,
        truncation_mode=cfg.data.truncation_mode,
    )
    if isinstance(blocks, PackedBlocks):  # documents packed whole: how full the blocks are, what was cut
        print0(f"Data: {split}: {blocks.stats.line(seq_length)}")
    elif isinstance(blocks, PairBlocks):  # pairs: how many were cut to the block length, or dropped
        print0(blocks.summary)
    if len(blocks) == 0:
        which, fix = split_origin(cfg.data, split)
        raise ConfigError(
            f"{which} has {dataset.tokens(split)} tokens, fewer than one block of {seq_length}: fix: {fix}"
        )
    return blocks


def _check_objective(cfg: TrainConfig, train_blocks: BlockSource) -> None:
    """Preference pairs and a preference objective go together: either alone would train something else than
    asked, silently."""
    paired = isinstance(train_blocks, PairBlocks)
    objective = cfg.setting("objective")
    if cfg.objective.preference and not paired:
        raise ConfigError(
            f"{objective} {cfg.objective.objective} trains on preference pairs, and {cfg.data.dataset} is not "
            "(rows with 'chosen' and 'rejected': docs/preference.md): give preference data, or --objective lm"
        )
    if paired and not cfg.objective.preference:
        raise ConfigError(
            f"{cfg.data.dataset} holds preference pairs and {objective} is lm (the next-token loss): pass "
            "--objective dpo or simpo (docs/preference.md), or train on the chosen answers as prompt/completion "
            "rows"
        )
    if paired and cfg.optim.sequence_parallel > 1:
        raise ConfigError(
            f"{cfg.setting('sequence_parallel')} {cfg.optim.sequence_parallel} and {objective} "
            f"{cfg.objective.objective}: preference pairs are not split across ranks: drop --sequence_parallel"
        )


def split_origin(data: Any, split: str) -> tuple[str, str]:
    """Where a split's documents came from (the flag that named them), and how to give it more."""
    if split != "validation":
        return f"{split} data of {data.dataset}", "use more data or a smaller --seq_length"
    if data.validation_dataset is not None:
        return (
            f"validation data of --validation_dataset {data.validation_dataset}",
            "give --validation_dataset more text, use a smaller --seq_length, or leave it out to hold out "
            "--validation_fraction of the training data",
        )
    if data.validation_split is not None:
        return (
            f"validation split {data.validation_split} of {data.dataset}",
            "name a larger --validation_split or use a smaller --seq_length",
        )
    return (
        f"validation data held out of {data.dataset} (--validation_fraction {data.validation_fraction})",
        "raise --validation_fraction, or set it to 0 to skip validation",
    )


def _select_resume(cfg: TrainConfig) -> protocol.ResumeTarget | None:
    """The newest verified local checkpoint; with an S3 tier and none local, the newest complete one in S3."""
    ckpt = cfg.checkpoint
    target = protocol.select_resume(ckpt.checkpoint_dir, ckpt.resume_from_checkpoint)
    if ckpt.s3_checkpoint_uri is None:
        return target
    from model_utils.checkpoint import s3_tier

    tier = s3_tier.S3Tier(ckpt.s3_checkpoint_uri)
    tier.check_access()
    if target is not None or ckpt.resume_from_checkpoint is not None:
        return target
    tag = tier.newest_complete_tag()
    if tag is None:
        return None
    print0(f"No verified local checkpoint: downloading {tag} from {ckpt.s3_checkpoint_uri}")
    tier.download(tag, Path(ckpt.checkpoint_dir))
    return protocol.select_resume(ckpt.checkpoint_dir, None)


def _here(fn: Callable[[], Any]) -> Any:
    return fn()


def prepare_on_ranks(cfg: TrainConfig, dist: DistInfo) -> ResolvedRun:
    """`prepare` as a rank runs it: work one process must do (tokenizing into the cache) on rank 0 first, the
    others after it; decisions made on rank 0 and shared."""
    from model_utils.launch import distributed

    return prepare(
        cfg,
        world_size=dist.world_size,
        run_first=partial(distributed.main_first, info=dist),
        decide_once=partial(distributed.decide_on_main, info=dist),
    )


def prepare(
    cfg: TrainConfig,
    world_size: int | None = None,
    run_first: Callable[[Callable[[], Any]], Any] = _here,
    decide_once: Callable[[Callable[[], Any]], Any] = _here,
    settings: RunSettings | None = None,
    fetch_hub: bool = False,
    plan: batch_layout.Ranks | None = None,
) -> ResolvedRun:
    """Resolve model, tokenizer, sequence length, DeepSpeed settings, checkpoint target and packed data.

    `world_size` is the ranks' (None in one-process tools); `plan` (`dskit config`, not on the ranks): the ranks
    to resolve for, so that what the ranks derive from their hardware is shown (what only a GPU probe settles, the
    micro batch `auto`, stays open); `run_first` runs a cache-building function on one
    rank before the others (they then read the cache); `decide_once` runs a decision (which checkpoint
    verifies, the probed micro batch) on one rank and shares it. `settings`: resolve_settings(cfg), when the
    caller has it already. `fetch_hub` (`dskit prepare`/`preflight`, once per job before the ranks start): fetch a
    hub model's weights and pin its (and a hub tokenizer's) commit in the checkpoint dir, where the ranks read it.
    """
    on_ranks = world_size is not None
    ranks = batch_layout.Ranks(world_size, _rank_gpu_bytes()) if world_size is not None else plan
    settings = settings or resolve_settings(
        cfg,
        None if ranks is None else ranks.gpu_bytes,
        1 if ranks is None else ranks.world_size,
        on_ranks=on_ranks,
    )
    with settings.config.origins_named():
        return _prepare(settings, ranks, on_ranks, run_first, decide_once, fetch_hub)


def _prepare(
    settings: RunSettings,
    ranks: batch_layout.Ranks | None,
    on_ranks: bool,
    run_first: Callable[[Callable[[], Any]], Any],
    decide_once: Callable[[Callable[[], Any]], Any],
    fetch_hub: bool,
) -> ResolvedRun:
    cfg = settings.config  # with the launch environment's settings joined (resolve_settings)
    protocol.check_writable(cfg.checkpoint.checkpoint_dir)
    world_size = None if ranks is None else ranks.world_size
    sequence_parallel.check(cfg, settings.model_config, settings.seq_length, world_size)
    # The data-parallel ranks: each group of --sequence_parallel ranks reads one share of the step.
    data_ranks = None if world_size is None else world_size // cfg.optim.sequence_parallel
    settings = dataclasses.replace(settings, tokenizer=_hub_tokenizer(cfg, settings.source, on_ranks))
    if fetch_hub:
        settings = _fetch_hub(settings)
    if cfg.report.tracking_uri is not None:
        from model_utils.observe import trackers

        # Fails in seconds when a tracking server is down, not after MLflow's minutes of retries.
        decide_once(lambda: trackers.check_reachable(cfg.report.tracking_uri))
    _check_mlflow_parent(cfg, decide_once)
    _check_profile_steps(cfg, cfg.loop.max_steps if cfg.loop.epochs is None else None)
    resume = decide_once(lambda: _select_resume(cfg))
    if resume is not None:  # refuse another architecture or block length before any data work
        check_resume(settings, resume.path)
        lora.check_resume(resume.path, launch_record.read(resume.path), cfg.lora)
    tokenizer = models.load_tokenizer(settings.source, cfg.model.tokenizer, settings.tokenizer)
    models.check_vocab(tokenizer, settings.model_config)
    tokenizer_name = cfg.model.tokenizer or settings.source.name
    samples = _sample_prompts(cfg, tokenizer, settings.seq_length)
    seq = settings.seq_length
    train_blocks: BlockSource
    val_blocks: BlockSource | None
    if cfg.data.sources is not None:  # a weighted mixture: each source prepared as a single dataset is
        opened = mixture.open_sources(
            cfg.data,
            cfg.explicit,
            tokenizer,
            tokenizer_name,
            run_first,
            seq,
            cfg.loop.seed,
            _from_run_file(cfg),
        )
        train_blocks, val_blocks, data_fingerprint = opened.train, opened.validation, opened.fingerprint
        rendered = validation_fingerprint = None
    else:
        dataset = block_cache.prepared(
            cfg.data, cfg.explicit, tokenizer, tokenizer_name, run_first, _from_run_file(cfg)
        )
        # The template its rows were rendered with (a prepared dir's own, whatever the flags say).
        rendered = dataset.manifest.get("chat")
        data_fingerprint = token_shards.content_fingerprint(dataset.manifest)
        train_blocks = _blocks_or_error(dataset, "train", cfg, seq)
        val_blocks = _blocks_or_error(dataset, "validation", cfg, seq) if dataset.holds_validation else None
        validation_fingerprint = (
            None if val_blocks is None else token_shards.content_fingerprint(dataset.manifest, "validation")
        )
    # The chat template the run trains with (its data's, else --chat_template, else the tokenizer's own) on the
    # tokenizer every checkpoint saves in hf_config/: each export is prompted as the run was trained.
    template = rendered or chat.options(cfg.data, tokenizer, chat.TEXT)
    if template["template_from"] != chat.TOKENIZER_TEMPLATE:
        tokenizer.chat_template = template["template"]
    _check_objective(cfg, train_blocks)
    if val_blocks is None and (cfg.loop.validation_only or cfg.loop.validation_at_start):
        flag = "validation_only" if cfg.loop.validation_only else "validation_at_start"
        raise ConfigError(
            f"{cfg.setting(flag)} true: there is no validation data: give --validation_dataset, "
            "--validation_split, or a --validation_fraction above 0 of --dataset"
        )
    # Other data or another chat template refused before any rank trains (--new_data: the ranks reset its position);
    # an evaluation saves nothing: it measures the checkpoint on any data, in any template.
    if resume is not None and not cfg.loop.validation_only:
        check_resume(
            settings, resume.path, data_fingerprint=data_fingerprint, chat_template=tokenizer.chat_template
        )
    settings = _cuda_batch_default(settings, ranks)
    micro_batch = _micro_batch(settings, train_blocks, val_blocks, ranks, on_ranks, decide_once)
    settings = _accumulation(settings, micro_batch, data_ranks)
    steps_per_epoch = max_steps = None
    if isinstance(micro_batch, int) and data_ranks is not None:
        global_batch = micro_batch * settings.train.gradient_accumulation_steps * data_ranks
        steps_per_epoch = sampler.epoch_blocks(train_blocks) // global_batch
        if steps_per_epoch == 0:
            raise ConfigError(
                f"train data has {sampler.epoch_blocks(train_blocks)} blocks per epoch, fewer than one global batch "
                f"of {global_batch} "
                f"(micro batch {micro_batch} x accumulation {settings.train.gradient_accumulation_steps} x "
                f"{data_ranks} data-parallel ranks): use more data, fewer ranks or a smaller batch"
            )
    epochs = cfg.loop.epochs
    if epochs is None:
        max_steps = cfg.loop.max_steps
    elif steps_per_epoch is not None:
        max_steps = epochs * steps_per_epoch
    _check_profile_steps(cfg, max_steps)  # with --epochs, max_steps is known only now
    settings, schedule_change, loads_schedule_state = _resumed_schedule(settings, resume, max_steps)
    run = ResolvedRun(
        settings,
        tokenizer,
        train_blocks,
        val_blocks,
        resume,
        world_size,
        micro_batch,
        steps_per_epoch,
        max_steps,
        schedule_change,
        loads_schedule_state,
        data_fingerprint,
        samples,
        validation_fingerprint=validation_fingerprint,
    )
    if run.layout is not None:
        print0(run.layout.describe())
    if max_steps is not None and isinstance(micro_batch, int):
        run.deepspeed_config()  # an explicit total_num_steps that disagrees fails here, before any rank trains
    schedule = settings.train.schedule
    if max_steps is not None:
        schedule.client(max_steps)  # a --decay_from_step beyond the run fails here, before any rank trains
        if schedule.warmup_ratio is None and schedule.warmup_for(max_steps) not in (
            None,
            schedule.warmup_steps,
        ):
            print0(
                f"Warm-up of {schedule.warmup_steps} steps is longer than the run: warming up over its {max_steps} "
                "steps"
            )
    return run


def _from_run_file(cfg: TrainConfig) -> Callable[[str], str | None]:
    """A setting's name as a message says it when the run file gave it (TrainConfig.setting), else None."""
    return lambda flag: cfg.setting(flag) if cfg.origin_of(flag).startswith("run file") else None


def _fetch_hub(settings: RunSettings) -> RunSettings:
    source, tok = settings.source, settings.tokenizer
    pins: dict[str, hub.Snapshot] = {}
    if source.snapshot is not None:
        snap = hub.with_weights(source.snapshot, "model")
        source = dataclasses.replace(source, snapshot=snap)
        pins["model"] = snap
        if tok is settings.source.snapshot:
            tok = snap
    if tok is not None and tok is not source.snapshot:
        pins["tokenizer"] = tok
    if not pins:
        return settings
    hub.write_pins(settings.config.checkpoint.checkpoint_dir, pins)
    print0(
        "Hub snapshots pinned for the ranks (HF cache "
        f"{hub.cache_dir()}, which must be on the shared filesystem for multi-node jobs): "
        + ", ".join(f"{s.repo}@{s.commit[:12]}" for s in pins.values())
    )
    return dataclasses.replace(settings, source=source, tokenizer=tok)


def check_resume(
    settings: RunSettings,
    tag_dir: Path,
    world_size: int | None = None,
    optimizer_groups: list[list[int]] | None = None,
    data_fingerprint: str | None = None,
    chat_template: Any = launch_record.NOT_KNOWN,
) -> launch_record.ResumePlan:
    """launch_record.check_resume with this run's settings: the preflight's (before and after the data) and the
    trainer's (with the optimizer groups) are the same comparison."""
    cfg = settings.config
    return launch_record.check_resume(
        tag_dir,
        settings.model_config,
        settings.seq_length,
        world_size,
        optimizer_groups,
        backend=cfg.optim.backend,
        zero_stage=settings.train.zero_stage,
        data_fingerprint=data_fingerprint,
        new_data=cfg.checkpoint.new_data,
        dataset=cfg.data.dataset,
        precision=settings.train.precision,
        sources=cfg.data.sources,
        chat_template=chat_template,
    )


def _resumed_schedule(
    settings: RunSettings, resume: protocol.ResumeTarget | None, max_steps: int | None
) -> tuple[RunSettings, str | None, bool]:
    """The settings with the schedule a resume trains (the checkpoint's warm-up kept, the decay to max_steps), the
    line saying what changed from the schedule the checkpoint ran (None: nothing, or no resume), and whether the
    checkpoint's scheduler state is loaded (not into another kind of schedule)."""
    ran = None if resume is None or max_steps is None else launch_record.ran_schedule(resume.path)
    step = None if resume is None else protocol.tag_step(resume.tag)
    if ran is None or step is None:
        return settings, None, True
    assert max_steps is not None
    ts = settings.train
    change = ts.schedule.resume_line(ran, ts.optim.lr, step, max_steps)
    kept = dataclasses.replace(ts, schedule=ts.schedule.resumed(ran))
    return dataclasses.replace(settings, train=kept), change, not ts.schedule.switches_from(ran)


def _check_profile_steps(cfg: TrainConfig, max_steps: int | None) -> None:
    window = cfg.report.profile_window()
    if window is not None and max_steps is not None and window[1] > max_steps:
        raise ConfigError(
            f"--profile_steps {cfg.report.profile_steps} ends after the run's last step {max_steps}: profile "
            f"steps up to {max_steps}"
        )


def _check_mlflow_parent(cfg: TrainConfig, decide_once: Callable[[Callable[[], Any]], Any]) -> None:
    """MLFLOW_RUN_ID agrees with --mlflow_parent_run_id (every rank drops it), and the store has the parent."""
    report = cfg.report
    if "mlflow" not in report.trackers:
        return
    from model_utils.observe import trackers

    parent = report.mlflow_parent_run_id
    trackers.take_env_run_id(parent)
    if parent is not None:
        decide_once(lambda: trackers.check_parent_run(report.tracking_uri, Path(report.report_dir), parent))


def _cuda_batch_default(settings: RunSettings, ranks: batch_layout.Ranks | None) -> RunSettings:
    """On CUDA ranks without a batch flag (or batch keys in the DeepSpeed config): micro batch auto and the
    default global batch. Decided where --micro_batch_size auto is, on the ranks; CPU keeps the embedded default."""
    ts = settings.train
    if ranks is None or not ranks.on_cuda or ts.batch_given or ts.global_batch_tokens is not None:
        return settings
    print0(
        f"CUDA batch default (no batch flag given): --micro_batch_size auto, --global_batch_tokens "
        f"{CUDA_GLOBAL_BATCH_TOKENS}"
    )
    chosen = ts.with_batch(
        micro_batch_size=AUTO,
        global_batch_tokens=CUDA_GLOBAL_BATCH_TOKENS,
        global_batch_from="the CUDA default",
    )
    return replace(settings, train=chosen)


def _accumulation(settings: RunSettings, micro_batch: int | str, world_size: int | None) -> RunSettings:
    """With a global batch in tokens, the accumulation that comes nearest it (known once micro batch and ranks are)."""
    ts = settings.train
    if ts.global_batch_tokens is None or not isinstance(micro_batch, int) or world_size is None:
        return settings
    rows = 2 if settings.config.objective.preference else 1  # a pair's 2 sequences
    steps = batch_layout.accumulation_for(
        ts.global_batch_tokens, micro_batch, world_size, rows * settings.seq_length
    )
    return replace(settings, train=ts.with_batch(gradient_accumulation_steps=steps))


def _micro_batch(
    settings: RunSettings,
    train_blocks: BlockSource,
    val_blocks: BlockSource | None,
    ranks: batch_layout.Ranks | None,
    on_ranks: bool,
    decide_once: Callable[[Callable[[], Any]], Any],
) -> int | str:
    """--micro_batch_size auto becomes a number on the training ranks (rank 0 probes its GPU; CPU ranks take 1);
    `dskit prepare`, which starts no process group and uses no GPU, leaves it open, as a plan for GPUs does."""
    chosen = settings.train.micro_batch_size
    if chosen != AUTO:
        return chosen
    if settings.config.optim.sequence_parallel > 1:  # the probe would measure a whole sequence on one GPU
        print0("--micro_batch_size auto: 1 under sequence parallelism (a sequence spans its group's GPUs)")
        return 1
    if settings.config.objective.preference:  # the probe measures blocks, not pairs of them
        print0(
            "--micro_batch_size auto: 1 pair (its chosen and rejected sequences) under a preference objective"
        )
        return 1
    if ranks is None or (ranks.on_cuda and not on_ranks):
        print0("--micro_batch_size auto: probed on the GPU by the training ranks when they start")
        return AUTO
    if not ranks.on_cuda:
        print0("--micro_batch_size auto: 1 (no CUDA GPU; the memory probe needs one)")
        return 1
    from model_utils.resolve import micro_batch_probe

    n_val = None if val_blocks is None else len(val_blocks)
    return decide_once(
        lambda: micro_batch_probe.resolve(
            settings, sampler.epoch_blocks(train_blocks), n_val, ranks.world_size
        )
    )
