"""Where the loop starts: a fresh run, or a checkpoint read back whole (the engine's state, the loop's state and
each observer's), the same way for a resume and for a spike guard's rollback.

A checkpoint of another world size is resumed whole through DeepSpeed's universal layout (converted once on rank
0) or, for FSDP's resharding DCP shards, directly; where the run's settings allow only its weights
(launch_record.check_resume: another ZeRO stage, other parameter groups), those are loaded and said.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils import engines
from model_utils.checkpoint import launch_record, protocol
from model_utils.data.sampler import DataPosition
from model_utils.errors import ConfigError
from model_utils.launch.distributed import DistInfo, any_rank, decide_on_main
from model_utils.loop.state import TrainState, observer_states
from model_utils.observe import run_name, step_line
from model_utils.observe.log import print0, warn0
from model_utils.resolve.resolver import ResolvedRun, check_resume


@dataclass(frozen=True)
class Loaded:
    state: TrainState
    observers: dict[str, dict[str, Any]]  # each observer's saved state, by name
    target: protocol.ResumeTarget  # the checkpoint actually read (a universal copy's, for another world size)


def start(
    run: ResolvedRun, dist: DistInfo, engine: Any, groups: list[list[int]]
) -> tuple[TrainState, dict[str, dict[str, Any]]]:
    """The loop's state at its start and what each observer saved, by name: the resumed checkpoint's (run.resume,
    which the preflight chose), said in one line; a fresh run's (its lr schedule at step 0, a new run id, decided
    on rank 0), nothing saved."""
    cfg = run.config
    if run.resume is None:
        if cfg.loop.validation_only:
            print0(step_line.validation_only_line(run.source.name, 0))
        else:
            print0(step_line.fresh_line(cfg.checkpoint.checkpoint_dir))
        engine.start_schedule_at(0)
        return TrainState(run_id=decide_on_main(lambda: run_name.new_run_id(cfg), dist)), {}
    loaded = load(run, dist, engine, groups, run.resume)
    state, target = loaded.state, loaded.target
    if cfg.loop.validation_only:
        # An evaluation is a run of its own (its id, metrics file and tracker run) of the model at its step: it
        # adds nothing to the runs of the checkpoint it reads.
        print0(step_line.validation_only_line(target.path, state.step))
        run_id = decide_on_main(lambda: run_name.new_run_id(cfg), dist)
        return TrainState(state.step, state.tokens_seen, run_id=run_id), {}
    if (mismatch := run_name.resume_mismatch(cfg, state.run_id)) is not None:
        warn0(mismatch)
    pos = state.position
    print0(step_line.resumed_line(target.path, state.step, pos.epoch, pos.consumed, engine.lr()))
    if run.schedule_change is not None:
        print0(run.schedule_change)
    return state, loaded.observers


def load(
    run: ResolvedRun, dist: DistInfo, engine: Any, groups: list[list[int]], target: protocol.ResumeTarget
) -> Loaded:
    """The engine's, the loop's and the observers' state from a checkpoint (a resume, a rollback)."""
    cfg = run.config
    _check_every_host_has(target, dist)
    # The world size is checked apart: another one is resumed whole through a universal copy.
    plan = check_resume(
        run.settings,
        target.path,
        optimizer_groups=groups,
        # An evaluation reads no training data: any data may be validated (resolver.prepare).
        data_fingerprint=None if cfg.loop.validation_only else run.data_fingerprint,
    )
    why_weights_only = plan.weights_only
    saved_ranks = launch_record.saved_world_size(target.path)
    universal = False
    # FSDP's DCP shards reshard on load: another world size resumes whole without a copy.
    reshards = engines.checkpoint_format(run.settings.train.backend).reshards_on_load
    if why_weights_only is None and not reshards and saved_ranks not in (None, dist.world_size):
        why = f"world size changed from {saved_ranks} to {dist.world_size}"
        try:
            target, universal = _universal_copy(run, dist, target, why), True
        except ConfigError as e:
            why_weights_only = f"{why} and {e}"
    weights_only = why_weights_only is not None
    if reshards and not weights_only and saved_ranks not in (None, dist.world_size):
        print0(
            f"world size changed from {saved_ranks} to {dist.world_size}: resuming optimizer and lr schedule "
            "state, resharded on load (Distributed Checkpoint)"
        )
    saved = protocol.load(engine, target, dist.rank, weights_only, universal)
    state = TrainState.from_dict(saved)
    if weights_only:
        warn0(
            f"{why_weights_only}: loaded the weights only (optimizer state starts fresh; the lr schedule and data "
            "position continue)"
        )
    if plan.data_reset is not None:  # the saved position counts blocks of the checkpoint's data
        state.position = DataPosition()
        print0(plan.data_reset)
    # The schedule this run trains, at the loaded step: a resume with another --max_steps reshaped its decay.
    engine.start_schedule_at(state.step)
    assert engine.optimizer_steps() == state.step, (engine.optimizer_steps(), state.step)
    state.run_id = state.run_id or run_name.new_run_id(cfg)  # checkpoints of older kits
    return Loaded(state, observer_states(saved), target)


def _check_every_host_has(target: protocol.ResumeTarget, dist: DistInfo) -> None:
    """Rank 0 picked the tag from its own disk; hosts without a shared filesystem (SageMaker restores each
    instance's checkpoints/ on its own) may lack it, and the engine's load would end in a bare assertion."""
    here = protocol.has_local_copy(target)
    lacking = any_rank([r == dist.rank and not here for r in range(dist.world_size)], dist.device)
    if any(lacking):
        ranks = [r for r, missing in enumerate(lacking) if missing]
        raise ConfigError(
            f"checkpoint {target.tag} is not on the host of ranks {ranks} (no {target.path} with its manifest "
            "there): restore the checkpoint dir on every host (SageMaker: the CheckpointConfig S3 URI syncs it), "
            "or move that tag aside to resume from an older one"
        )


def _universal_copy(
    run: ResolvedRun, dist: DistInfo, source: protocol.ResumeTarget, why: str
) -> protocol.ResumeTarget:
    """The universal copy of `source` in --checkpoint_dir, converted on rank 0 if not there yet (the other ranks
    wait); ConfigError on every rank when it cannot be made."""
    root = Path(run.config.checkpoint.checkpoint_dir)
    fmt = engines.checkpoint_format(run.settings.train.backend)

    def convert() -> tuple[str, float | None]:
        target, seconds = protocol.convert_universal(fmt, source, root)
        return target.tag, seconds

    tag, seconds = decide_on_main(convert, dist)
    how = "reusing" if seconds is None else f"converted in {seconds:.1f} s to"
    print0(
        f"{why}: resuming optimizer and lr schedule state through DeepSpeed's universal checkpoint ({how} "
        f"{root / tag})"
    )
    return protocol.ResumeTarget(root, tag)
