"""The training loop, split into named steps, over explicit checkpointable state.

Steps are optimizer steps (accumulation boundaries), never micro-batches: `max_steps`, logging, validation and
checkpoint frequencies all count them. The trainer reads the resolved run (preflight.py), talks to an engine
(engine.py), feeds the reporter's step clock (reporter.py), and calls its observers at the loop's named points
(hooks.py: the reporter's output, the profiler, the S3 uploads, the spike guard's records); `close()` runs on
every exit path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import numpy as np
import torch

from model_utils import engines
from model_utils.checkpoint import launch_record, protocol
from model_utils.config.arguments import ALL
from model_utils.data import mixture, step_batches, token_bytes
from model_utils.data.sampler import BlockSampler, DataPosition, ValidationPlan, validation_plan
from model_utils.engines.base import Engine
from model_utils.errors import ConfigError, RunDiverged
from model_utils.launch import launch_env, walltime
from model_utils.launch.distributed import DistInfo, all_reduce_sum, any_rank, decide_on_main
from model_utils.launch.preemption import StopRequest, slurm_restart_count
from model_utils.loop import consensus, faults, hooks, observers, spike_guard, stragglers
from model_utils.loop.state import TrainState
from model_utils.model import activation_checkpointing, kernels, lora, models
from model_utils.model.models import build_model
from model_utils.observe import metrics, run_name, step_line, watchdog
from model_utils.observe.log import print0, warn0
from model_utils.observe.reporter import Reporter
from model_utils.optim import param_groups
from model_utils.resolve.resolver import ResolvedRun, check_resume, split_origin

T = TypeVar("T")

# What became of a step's data (Trainer.train_step); an applied one then stands or is rolled back (hooks.py).
APPLIED, DISCARDED, DROPPED = "applied", hooks.DISCARDED, hooks.DROPPED


def create_engine(run: ResolvedRun, dist: DistInfo) -> tuple[Engine, param_groups.DecayGroups]:
    """The model in the training dtype, with the planned kernels, inside the engine (--backend); and its decay
    groups."""
    cfg = run.config
    ts = run.settings.train
    # Weights are identical on every rank (one seed); data order and dropout differ per rank.
    model = build_model(run.source, run.model_config, cfg.loop.seed, ts.model_dtype())
    if run.documents_apart:  # before compile traces the attention
        models.attend_within_documents(model, dist.device)
    # Before Liger swaps modules and compile traces: the per-layer switch is set once on the plain model.
    activation_checkpointing.apply(model, cfg.model.activation_checkpointing)
    # Adapters after the checkpointing switch and before the kernels, which go on the inner Hugging Face model
    # (Liger knows no PeftModel; compile traces the tree with the adapters): see lora.py. The base is frozen, so
    # the decay groups below (trainable parameters only) hold the adapters alone.
    model = lora.apply(model, cfg.lora, cfg.loop.seed)
    kernels.optimize_model(lora.hf_model(model), cfg.model, dist.device)
    engine_type = engines.engine_class(ts.backend)
    # Before the decay groups: the engine may swap the parameters (FSDP shards them into DTensors); the groups are
    # of what it trains.
    model = engine_type.prepare_model(model, run, dist.device)
    groups = param_groups.split_for_weight_decay(model, cfg.optim.no_decay_embeddings)
    print0(groups.describe(ts.optim.weight_decay, cfg.optim.no_decay_embeddings))
    assert run.max_steps is not None
    print0(ts.schedule.describe(run.max_steps, engine_type.runs_schedule))
    torch.manual_seed(cfg.loop.seed + dist.rank)
    engine = engine_type.from_run(model, run, dist.device, groups.optimizer_groups())
    return engine, groups


class Trainer:
    def __init__(self, run: ResolvedRun, dist: DistInfo) -> None:
        assert run.world_size == dist.world_size and isinstance(run.micro_batch_size, int), (
            "prepare on the ranks"
        )
        assert run.max_steps is not None
        self.run, self.dist, self.cfg = run, dist, run.config
        self.max_steps: int = run.max_steps
        self.reporter: Reporter | None = None
        self.hooks = hooks.Hooks()  # the observers, once the loop is set up
        self.batches: step_batches.StepBatches | None = None
        self.fault: faults.FaultInjector | None = None
        self.guard = spike_guard.SpikeGuard(self.cfg.guard, run.settings.spike_guard)
        self.global_loss = float("nan")  # the last step's loss over all ranks (when the guard watches)
        self.spike: spike_guard.Spike | None = None  # what the guard saw in the last step's loss
        self.consensus = consensus.StepConsensus(dist.rank, dist.world_size, dist.device)
        self.agreement: consensus.Agreement | None = None  # this turn's, once its collective ran
        # The next step's targets over all ranks, summed in this turn's collective: (its position, the count).
        self.next_targets: tuple[DataPosition, int] | None = None
        self.step_times = stragglers.StepTimes()  # this rank's, until the collective carries them
        self.sampler = BlockSampler.of(
            run.train_blocks,
            run.micro_batch_size,
            run.gradient_accumulation_steps,
            dist.rank,
            dist.world_size,
            self.cfg.loop.seed,
        )
        assert self.sampler.steps_per_epoch == run.steps_per_epoch, "one owner of steps per epoch: preflight"
        try:
            self.val_plans = self._validation_plans()
            # The UTF-8 bytes each token id stands for, for validation's bits per byte: built once (a few us per id).
            self.token_bytes = None if self.val_plans is None else token_bytes.byte_lengths(run.tokenizer)
            self.engine, self.decay_groups = create_engine(run, dist)
            self.fault = faults.FaultInjector.from_env(self.engine.module, dist.rank)
            self.flops_per_token = metrics.flops_per_token(run.model_config, run.seq_length, self.cfg.lora)
            peak_tflops = metrics.peak_tflops(metrics.device_name(dist.device), self.cfg.report.peak_tflops)
            self.reporter = Reporter(
                self.cfg, dist, self.max_steps, run.tokens_per_step, self.flops_per_token, peak_tflops
            )
            # Flash attention's variable-length path reads documents from the positions of one flattened row.
            self.flatten = models.flattens_documents(lora.hf_model(self.engine.module))
            self.batches = step_batches.StepBatches(run.train_blocks, self.sampler, dist.device, self.flatten)
            resolved = {**run.to_dict()["resolved"], "optimizer_groups": self.decay_groups.layout()}
            self.launch = launch_record.collect(
                self.cfg.to_dict(), resolved, run.deepspeed_config(), dist.world_size
            )
            self.state = self._resume_or_start()
            self.guard.load_state_dict(self.state.guard)
            print0(self.guard.describe())
            self.stop = StopRequest()
            self.interrupted = False  # the ranks agreed the stop is a Ctrl-C (after_step)
            self.last_save_time = time.monotonic()
            self.walltime = walltime.WalltimePlanner() if dist.is_main else None
            resumed_at = self.state.step if run.resume is not None else None
            self.state.tracker_state = self.reporter.open(
                self.state.run_id, self.state.tracker_state, resumed_at
            )
            context = observers.LoopContext(run, dist, self.engine, self.reporter, self.state.step)
            self.hooks = hooks.Hooks(observers.build(context))
        except BaseException:
            self.close()  # the batch worker and a tracker run opened before the error
            raise

    # --- set-up steps ---

    def _validation_plans(self) -> list[tuple[str | None, int, ValidationPlan]] | None:
        """A plan per validation source (a mixture's sources each; one dataset's blocks, unnamed): (name, its
        first block, plan)."""
        blocks = self.run.val_blocks
        if blocks is None:
            return None
        mb = self.run.micro_batch_size
        assert isinstance(mb, int)
        batches = self.cfg.loop.validation_batches
        plans = []
        for name, first, count in mixture.parts(blocks):
            plan = validation_plan(
                count, None if batches == ALL else batches, mb, self.dist.rank, self.dist.world_size
            )
            if count < mb * self.dist.world_size:
                which = (
                    f"source {name}'s" if name is not None else split_origin(self.cfg.data, "validation")[0]
                )
                print0(
                    f"Validation: {which} has {count} blocks, fewer than micro batch {mb} x "
                    f"{self.dist.world_size} ranks: each validation reads all {count} (a rank without one repeats "
                    "one, uncounted)"
                )
            plans.append((name, first, plan))
        return plans

    def _resume_or_start(self) -> TrainState:
        target = self.run.resume
        if target is None:
            if self.cfg.loop.validation_only:
                print0(step_line.validation_only_line(self.run.source.name, 0))
            else:
                print0(step_line.fresh_line(self.cfg.checkpoint.checkpoint_dir))
            self.engine.start_schedule_at(0)
            return TrainState(run_id=decide_on_main(lambda: run_name.new_run_id(self.cfg), self.dist))
        state, target = self._load(target)
        if self.cfg.loop.validation_only:
            # An evaluation is a run of its own (its id, metrics file and tracker run) of the model at its step: it
            # adds nothing to the runs of the checkpoint it reads.
            print0(step_line.validation_only_line(target.path, state.step))
            run_id = decide_on_main(lambda: run_name.new_run_id(self.cfg), self.dist)
            return TrainState(step=state.step, tokens_seen=state.tokens_seen, run_id=run_id)
        if (mismatch := run_name.resume_mismatch(self.cfg, state.run_id)) is not None:
            warn0(mismatch)
        pos = state.position
        print0(step_line.resumed_line(target.path, state.step, pos.epoch, pos.consumed, self.engine.lr()))
        if self.run.schedule_change is not None:
            print0(self.run.schedule_change)
        return state

    def _check_every_host_has(self, target: protocol.ResumeTarget) -> None:
        """Rank 0 picked the tag from its own disk; hosts without a shared filesystem (SageMaker restores each
        instance's checkpoints/ on its own) may lack it, and the engine's load would end in a bare assertion."""
        here = protocol.has_local_copy(target)
        lacking = any_rank(
            [r == self.dist.rank and not here for r in range(self.dist.world_size)], self.dist.device
        )
        if any(lacking):
            ranks = [r for r, missing in enumerate(lacking) if missing]
            raise ConfigError(
                f"checkpoint {target.tag} is not on the host of ranks {ranks} (no {target.path} with its manifest "
                "there): restore the checkpoint dir on every host (SageMaker: the CheckpointConfig S3 URI syncs "
                "it), or move that tag aside to resume from an older one"
            )

    def _load(self, target: protocol.ResumeTarget) -> tuple[TrainState, protocol.ResumeTarget]:
        """The engine and the run's state from a checkpoint (a resume, a rollback); the target actually read."""
        self._check_every_host_has(target)
        # The world size is checked apart: another one is resumed whole through a universal copy.
        plan = check_resume(
            self.run.settings,
            target.path,
            optimizer_groups=self.decay_groups.layout(),
            # An evaluation reads no training data: any data may be validated (resolver.prepare).
            data_fingerprint=None if self.cfg.loop.validation_only else self.run.data_fingerprint,
        )
        why_weights_only = plan.weights_only
        saved_ranks = launch_record.saved_world_size(target.path)
        universal = False
        # FSDP's DCP shards reshard on load: another world size resumes whole without a copy.
        reshards = type(self.engine).reshards_on_load
        if (
            why_weights_only is None
            and not reshards
            and saved_ranks is not None
            and saved_ranks != self.dist.world_size
        ):
            why = f"world size changed from {saved_ranks} to {self.dist.world_size}"
            try:
                target, universal = self._universal_copy(target, why), True
            except ConfigError as e:
                why_weights_only = f"{why} and {e}"
        weights_only = why_weights_only is not None
        if reshards and not weights_only and saved_ranks not in (None, self.dist.world_size):
            print0(
                f"world size changed from {saved_ranks} to {self.dist.world_size}: resuming optimizer and lr "
                "schedule state, resharded on load (Distributed Checkpoint)"
            )
        state = TrainState.from_dict(
            protocol.load(self.engine, target, self.dist.rank, weights_only, universal)
        )
        if weights_only:
            warn0(
                f"{why_weights_only}: loaded the weights only (optimizer state starts fresh; the lr schedule and "
                "data position continue)"
            )
        if plan.data_reset is not None:  # the saved position counts blocks of the checkpoint's data
            state.position = DataPosition()
            print0(plan.data_reset)
        # The schedule this run trains, at the loaded step: a resume with another --max_steps reshaped its decay.
        self.engine.start_schedule_at(state.step)
        assert self.engine.optimizer_steps() == state.step, (self.engine.optimizer_steps(), state.step)
        state.run_id = state.run_id or run_name.new_run_id(self.cfg)  # checkpoints of older kits
        return state, target

    def _universal_copy(self, source: protocol.ResumeTarget, why: str) -> protocol.ResumeTarget:
        """The universal copy of `source` in --checkpoint_dir, converted on rank 0 if not there yet (the
        other ranks wait); ConfigError on every rank when it cannot be made."""
        root = Path(self.cfg.checkpoint.checkpoint_dir)
        engine_type = type(self.engine)

        def convert() -> tuple[str, float | None]:
            target, seconds = protocol.convert_universal(engine_type, source, root)
            return target.tag, seconds

        tag, seconds = decide_on_main(convert, self.dist)
        how = "reusing" if seconds is None else f"converted in {seconds:.1f} s to"
        print0(
            f"{why}: resuming optimizer and lr schedule state through DeepSpeed's universal checkpoint "
            f"({how} {root / tag})"
        )
        return protocol.ResumeTarget(root, tag)

    # --- the loop ---

    def train_step(self) -> tuple[str, float]:
        """One optimizer step over this step's micro-batches: APPLIED and the loss, or DISCARDED (the spike
        guard saw the loss spike: no update) or DROPPED (a test fault) and NaN. The data is consumed either way."""
        assert self.reporter is not None and self.batches is not None
        batches = self.batches
        self.data_wait_s = 0.0
        self.step_lr = self.engine.lr()  # the lr this step runs at (the engine advances it after the step)
        position = self.state.position
        if self.fault is not None and self.fault.draw() == "drop":
            self.state.position = self.sampler.advance(position)
            return DROPPED, float("nan")
        micro_batches = self._waited_for(lambda: batches.at(position))
        self.hooks.before_step(self.state.step + 1)
        self.guard.step_starting(position)
        # The loss divisor, when the turn before agreed it (else the engine counts it in a collective of its own).
        agreed = self.next_targets
        self.next_targets = None
        targets = agreed[1] if agreed is not None and agreed[0] == position else None
        # Always asked: the kit's per-step collective runs there, once the forwards have run (loop/consensus.py).
        mean_loss, applied = self.engine.train_step(micro_batches, self._keep, targets)
        if self.fault is not None:
            self.fault.step_done()
        self.state.position = self.sampler.advance(position)
        if not applied:
            return DISCARDED, float("nan")
        self.state.step += 1
        assert self.engine.optimizer_steps() == self.state.step, (
            self.engine.optimizer_steps(),
            self.state.step,
        )
        self.state.tokens_seen += self.run.tokens_per_step
        self.state.skipped_steps = self.engine.skipped_steps()
        loss = mean_loss.item()  # one wait for the device per step, not one per micro-batch
        trained = sum(batch.targets for batch in micro_batches)  # counted on the host when the rows were read
        self.reporter.step_done(loss, trained, self.engine.wall_clock_ms())
        return APPLIED, loss

    def _waited_for(self, read: Callable[[], T]) -> T:
        """A read of the data, its time added to the turn's data wait and told to the reporter."""
        started = time.perf_counter()
        got = read()
        waited = time.perf_counter() - started
        self.data_wait_s += waited
        if self.reporter is not None:
            self.reporter.data_waited(waited)
        return got

    def turn(self) -> hooks.StepReport:
        """One turn of the loop: data a rollback ruled out is passed over, then one step is trained and judged
        by the spike guard. Returns what it did (its observers get it from `fit`)."""
        started = time.perf_counter()
        self.agreement = None
        self.skip_guarded_data()
        step = self.state.step + 1
        self.hooks.on_phase(watchdog.DATA, step)
        outcome, loss = self.train_step()
        if self.agreement is None and self.dist.world_size > 1:  # a dropped step: the engine did not ask
            self.agreement = self._agree(None)
        grad_norm = self.engine.grad_norm() if outcome == APPLIED else None
        stands = outcome == APPLIED
        if outcome != DROPPED and self.guard.active:
            stands = self.guard_step(outcome) and stands
        if outcome == APPLIED:
            outcome = hooks.TRAINED if stands else hooks.ROLLED_BACK
        seconds = time.perf_counter() - started
        sync_wait = self.agreement.wait_s if self.agreement is not None else 0.0
        self.step_times.add(self.data_wait_s, sync_wait, seconds)
        return hooks.StepReport(
            step=step,
            outcome=outcome,
            loss=loss,
            lr=self.step_lr,
            grad_norm=grad_norm,
            data_wait_s=self.data_wait_s,
            seconds=seconds,
            time_left=self.walltime.remaining() if self.walltime is not None else None,
            state=self.state,
            sync_wait_s=sync_wait,
            rank_times=self.agreement.rank_times if self.agreement is not None else None,
        )

    def step(self) -> tuple[bool, float]:
        """A turn as bench and tests drive one: whether an optimizer step now stands (not discarded, not rolled
        back) and its loss (NaN when none). The turn's report goes to the observers (after_step) in `fit` only."""
        report = self.turn()
        return report.trained, report.loss

    def _keep(self, mean_loss: torch.Tensor) -> bool:
        """The engine asks, once the step's forwards have run and before the update, whether this step happens.
        With several ranks the step's one collective runs here (the guard's loss, the stop and save decision, the
        straggler times): the first point where the ranks meet, so a late rank shows in the others' wait. The
        guard judges the loss of the whole step over all ranks, the same on every rank (the mean of the ranks'
        shares is the step's loss over its tokens)."""
        guarding = self.guard.active
        loss = None
        if self.dist.world_size > 1:
            batches = self.batches
            assert batches is not None
            # The next step's targets ride in this collective: its rows are read one step ahead (by now, usually).
            following = self.sampler.advance(self.state.position)
            self.hooks.on_phase(watchdog.DATA, self.state.step + 1)  # a hung read is named as one
            targets = self._waited_for(lambda: batches.targets_at(following))
            self.agreement = self._agree(mean_loss if guarding else None, targets)
            assert self.agreement.targets is not None
            self.next_targets = (following, self.agreement.targets)
            self.hooks.on_phase(watchdog.COMPUTE, self.state.step + 1)
            loss = self.agreement.loss
        elif guarding:
            loss = float(mean_loss.item())
        if not guarding:
            return True
        assert loss is not None
        self.global_loss = loss
        self.spike = self.guard.judge_loss(self.state.step + 1, loss)
        return self.spike is None

    def _agree(self, loss: torch.Tensor | None, targets: int | None = None) -> consensus.Agreement:
        """The turn's one collective: the loss given, the stop and save flags, the next step's targets given, and
        the ranks' step times when a straggler window is full (loop/consensus.py)."""
        self.hooks.on_phase(watchdog.DECISION, self.state.step + 1)
        every = self.cfg.loop.straggler_every
        due = self.dist.world_size > 1 and every > 0 and self.step_times.turns >= every
        times = self.step_times.take() if due else None
        return self.consensus.agree(loss, self._decision_flags(), times, targets)

    def _decision_flags(self) -> list[bool]:
        """This rank's say on stopping or saving after the turn: it was signalled (by Ctrl-C?), its clock says a
        save is due, rank 0's walltime plan says save (or save and stop) now, or an observer asked to stop."""
        ckpt = self.cfg.checkpoint
        minutes = (time.monotonic() - self.last_save_time) / 60
        time_due = (
            ckpt.checkpoint_interval_minutes is not None and minutes >= ckpt.checkpoint_interval_minutes
        )
        plan = self._walltime_plan()
        return [
            self.stop.signal_name is not None,
            self.stop.interrupted,
            time_due,
            plan.save_now,
            plan.stop_now,
            self.hooks.stop is not None,
        ]

    # --- the spike guard ---

    def guard_step(self, outcome: str) -> bool:
        """The guard's verdict on the step just run; False when it was rolled back. Raises RunDiverged when the
        run must stop (the same on every rank: the guard saw the same numbers everywhere)."""
        guard, step = self.guard, self.state.step
        if outcome == DISCARDED:
            assert self.spike is not None
            action = guard.step_skipped()
            warn0(
                f"Spike guard: skipped step {step + 1}: {self.spike.describe()}: no update, its data is consumed "
                f"({guard.consecutive_skips} in a row, {guard.skipped_steps} in the run)"
            )
            self._guard_event(spike_guard.SPIKE_SKIP, step + 1, self.spike)
            if action == spike_guard.STOP:
                self._diverged(
                    f"{guard.consecutive_skips} steps in a row skipped as loss spikes (--max_consecutive_skips): "
                    "the model, not one batch, went wrong; resume with --spike_guard rollback to go back to the "
                    "last checkpoint, or lower --lr"
                )
            if action == spike_guard.ROLLBACK:
                return self._roll_back(f"{guard.consecutive_skips} loss spikes in a row", must=True)
            return True
        spike, action = guard.step_applied(step, self.global_loss, self.engine.grad_norm())
        if spike is None:
            return True
        self._guard_event(spike_guard.SPIKE_GRAD_NORM, step, spike)
        if action == spike_guard.ROLLBACK:
            return self._roll_back(f"{spike.describe()} at step {step}", must=False)
        warn0(
            f"Spike guard: step {step}'s {spike.describe()}: the update is applied (DeepSpeed computes the norm in "
            "its optimizer step); --spike_guard rollback would go back to the last checkpoint"
        )
        return True

    def _roll_back(self, why: str, must: bool) -> bool:
        """Back to the newest verified checkpoint, skipping the data that led here from then on. Without a
        checkpoint, or past --max_rollbacks: stop when `must` (the model is broken), else carry on."""
        guard = self.guard
        if not guard.may_roll_back():
            self._diverged(
                f"{why} after {guard.rollbacks} rollbacks (--max_rollbacks {self.cfg.guard.max_rollbacks}): the "
                "run keeps diverging; lower --lr, or inspect the data around the skipped ranges in the metrics file"
            )
        root = Path(self.cfg.checkpoint.checkpoint_dir)
        self.hooks.on_phase(watchdog.CHECKPOINT, self.state.step)  # loading may take as long as a save
        protocol.verify_in_parallel(str(root))  # the ranks check the files; rank 0's choice reads none again
        target = decide_on_main(lambda: protocol.newest_verified(root), self.dist)
        if target is None:
            if must:
                self._diverged(f"{why} and no verified checkpoint in {root} to roll back to: lower --lr")
            warn0(
                f"Spike guard: {why}, but no verified checkpoint in {root} yet to roll back to: carrying on"
            )
            return True
        live = self.state
        assert self.reporter is not None
        self.reporter.restart_clock()  # the steps since the last log line are undone, and not logged
        state, target = self._load(target)
        start, end = guard.rolled_back(state.guard, state.position, live.position)
        state.run_id, state.tracker_state = live.run_id, live.tracker_state
        self.state = state
        warn0(
            f"Spike guard: {why}: rolled back from step {live.step} to step {state.step} ({target.tag}); the data "
            f"from epoch {start.epoch} block {start.consumed} to epoch {end.epoch} block {end.consumed} will be "
            f"skipped (rollback {guard.rollbacks} of at most {self.cfg.guard.max_rollbacks})"
        )
        rollback = hooks.Rollback(live.step, target.tag, why, start, end)
        self.hooks.on_guard_event(
            hooks.GuardEvent(spike_guard.ROLLBACK, state.step, guard.counters(), rollback=rollback)
        )
        return False

    def _guard_event(self, event: str, step: int, spike: spike_guard.Spike) -> None:
        self.hooks.on_guard_event(hooks.GuardEvent(event, step, self.guard.counters(), spike=spike))

    def _diverged(self, why: str) -> NoReturn:
        self.hooks.on_end(self.state, "diverged")
        raise RunDiverged(f"the spike guard stopped the run at step {self.state.step}: {why}")

    def skip_guarded_data(self) -> None:
        """Data a rollback ruled out is consumed without training when training reaches it again."""
        start = self.state.position
        steps = 0
        while self.guard.skips_data_at(self.state.position):
            self.state.position = self.sampler.advance(self.state.position)
            steps += 1
        if steps:
            print0(
                f"Spike guard: skipped {steps} steps of data from epoch {start.epoch} block {start.consumed} "
                "(what led to a rollback)"
            )

    @torch.no_grad()
    def validate(self) -> metrics.Validation:
        """The loss of the planned validation blocks: a mean over their target tokens on all ranks, so a full
        pass gives the loss of the whole set whatever the world size; and of each source of a mixture apart
        (the overall loss: over every source's blocks read). With it the bytes of text those targets decode to,
        for bits per byte."""
        plans, byte_lengths = self.val_plans, self.token_bytes
        assert plans is not None and byte_lengths is not None
        started = time.perf_counter()
        self.engine.eval()
        # Summed token losses in float64: the order of batches and ranks does not round it.
        sums: list[float] = []
        for _, first, plan in plans:
            loss_sum, targets, text_bytes = 0.0, 0, 0
            for indices, weight in zip(plan.batches, plan.weights, strict=True):
                # Each batch is progress: a full pass (--validation_batches all) may outlast the watchdog's limit.
                self.hooks.on_phase(watchdog.VALIDATION, self.state.step)
                batch = self._val_batch(first + indices)  # on the host, where its text bytes are counted
                # Every rank runs it, counted or not: ZeRO-3/FSDP gather the weights in each forward.
                loss = self.engine.eval_loss(batch.to(self.dist.device))
                if weight:  # 0: a repeated batch that keeps the ranks' forwards in step, not counted
                    loss_sum += loss
                    targets += batch.targets
                    labels = batch.labels[batch.labels != step_batches.IGNORE_INDEX].numpy()
                    text_bytes += int(byte_lengths[labels].sum())
            sums += [loss_sum, float(targets), float(text_bytes)]
        self.engine.train()
        totals = all_reduce_sum(sums, self.dist.device)  # one collective for every source
        scores = [
            metrics.Score(nats, int(targets), int(text_bytes))
            for nats, targets, text_bytes in zip(totals[0::3], totals[1::3], totals[2::3], strict=True)
        ]
        return metrics.Validation(
            score=metrics.Score.combined(scores),
            blocks=sum(plan.blocks for _, _, plan in plans),
            total_blocks=sum(plan.total_blocks for _, _, plan in plans),
            seconds=time.perf_counter() - started,
            sources=tuple(
                (name, score) for (name, _, _), score in zip(plans, scores, strict=True) if name is not None
            ),
        )

    def _val_batch(self, indices: np.ndarray) -> step_batches.Batch:
        assert self.run.val_blocks is not None
        return step_batches.gather(self.run.val_blocks, indices, pin=False, flatten=self.flatten)

    def save_checkpoint(self) -> None:
        self.hooks.on_phase(watchdog.CHECKPOINT, self.state.step)
        started = time.perf_counter()
        tag = protocol.checkpoint_tag(self.run.source.short_name, self.state.step)
        self.state.guard = self.guard.state_dict()
        request = protocol.SaveRequest(
            checkpoint_dir=self.cfg.checkpoint.checkpoint_dir,
            tag=tag,
            step=self.state.step,
            train_state=self.state.to_dict(),
            config=self.cfg.to_dict(),
            launch=self.launch,
        )
        final = protocol.save(self.engine, request, self.dist.rank, self.run.model_config, self.run.tokenizer)
        if final is not None:
            protect = {self.run.resume.tag} if self.run.resume else set()
            protect |= self.hooks.tags_in_use(tag)  # e.g. uploads in flight
            ckpt = self.cfg.checkpoint
            protocol.rotate(
                final.parent, ckpt.keep_checkpoints, protect, ckpt.keep_every_steps, type(self.engine)
            )
        seconds = time.perf_counter() - started
        if self.walltime is not None:
            self.walltime.record_save(seconds)
        self.hooks.after_checkpoint_saved(hooks.SavedCheckpoint(self.state.step, tag, final, seconds))
        self.last_save_time = time.monotonic()

    def fit(self) -> TrainState:
        if self.cfg.loop.validation_only:
            return self.validate_only()
        self.start()
        train_started = time.perf_counter()
        reason = None
        while self.state.step < self.max_steps and reason is None:
            reason = self.advance()
        self.finish(reason or "done", time.perf_counter() - train_started)
        return self.state

    def validate_only(self) -> TrainState:
        """--validation_only: the loop's validation of the model the run starts from, recorded as the loop records
        it (the validation line, the metrics file, the trackers) at that model's step; no step, no save."""
        assert self.reporter is not None
        self.hooks.on_start(self.state)
        self.hooks.after_validation(self.state.step, self.validate())
        self.hooks.on_end(self.state, step_line.VALIDATED)
        self.reporter.close()
        print0(step_line.validated_line(self.state.step))
        return self.state

    def start(self) -> None:
        """What the loop does once before its first turn: the announcements, the observers' start and, with
        --validation_at_start, a fresh run's validation at step 0 (its curve's start)."""
        assert self.reporter is not None
        run = self.run
        print0(
            f"Training {run.source.name} with {type(self.engine).title} for {self.max_steps} steps: "
            f"{self.dist.world_size} ranks x micro batch "
            f"{run.micro_batch_size} x accumulation {run.gradient_accumulation_steps} x "
            f"{run.seq_length} tokens = {run.tokens_per_step} tokens/step, "
            f"{run.steps_per_epoch} steps/epoch"
        )
        self._announce_start()
        self.engine.train()
        if self.state.step >= self.max_steps:
            print0(f"Nothing to train: already at step {self.state.step} of {self.max_steps}")
        if self.cfg.loop.validation_at_start and self.state.step == 0:
            self.hooks.after_validation(0, self.validate())
        self.reporter.restart_clock()

    def advance(self) -> str | None:
        """One turn of the loop with everything after it (observers, validation, checkpoint): why the ranks agreed
        to stop after it, or None."""
        report = self.turn()
        self.hooks.after_step(report)
        return self.after_step(report.trained)

    def finish(self, reason: str, train_s: float) -> None:
        assert self.reporter is not None
        self.hooks.on_end(self.state, reason)  # uploads finish, then the end record
        self.reporter.close()  # the progress bar goes before the closing lines
        self._announce_end(reason, train_s)

    def close(self) -> None:
        """Stop the batch worker, close the observers, end the tracker's run and release the engine: on success
        and on errors alike. Idempotent."""
        if self.batches is not None:
            self.batches.close()
        self.hooks.on_close()
        if self.fault is not None:
            self.fault.close()
        if self.reporter is not None:
            self.reporter.close()
        engine = self.__dict__.pop("engine", None)  # a closed trainer has no engine
        if engine is not None:
            engine.close()

    def _announce_start(self) -> None:
        assert self.reporter is not None
        restarts = slurm_restart_count()
        if restarts is not None:
            print0(f"SLURM job {os.environ['SLURM_JOB_ID']}, SLURM_RESTART_COUNT={restarts}")
        self.hooks.on_start(self.state)
        peak = self.reporter.peak_tflops
        peak_text = "unknown: pass --peak_tflops for MFU" if peak is None else f"{peak:g}"
        print0(
            f"FLOPs/token {self.flops_per_token / 1e9:.3g} G "
            f"({'4N frozen + 6N adapters' if self.cfg.lora.enabled else '6N'} + attention); "
            f"{metrics.device_name(self.dist.device)} peak bf16 TFLOP/s {peak_text}"
        )
        remaining = self.walltime.remaining() if self.walltime is not None else None
        if remaining is not None:
            print0(
                f"Job time limit: {step_line.format_duration(remaining)} left; checkpoints are planned around it"
            )

    def _announce_end(self, reason: str, train_s: float) -> None:
        assert self.reporter is not None
        s = self.state
        if reason == "preempted":
            by = "Ctrl-C" if self.interrupted else self.stop.signal_name or "another rank"
            print0(step_line.preempted_line(s.step, by))
        elif reason == "walltime":
            print0(step_line.walltime_line(s.step))
        elif reason == "done":
            print0(step_line.done_line(s.step, self.max_steps, s.tokens_seen))
        else:
            why = self.hooks.stop.why if self.hooks.stop is not None else "asked on another rank"
            print0(step_line.stopped_line(s.step, reason, why))
        if train_s > 0:
            overhead = self.reporter.overhead_s
            print0(
                f"Metrics overhead: {overhead:.3f} s of {train_s:.1f} s training "
                f"({100 * overhead / train_s:.2f}%)"
            )

    def after_step(self, trained: bool = True) -> str | None:
        """Validate and checkpoint when due (after a trained step). Returns why the ranks agreed to stop after this
        step, or None."""
        assert self.reporter is not None
        paused = time.perf_counter()
        loop, ckpt, step = self.cfg.loop, self.cfg.checkpoint, self.state.step
        last = trained and step == self.max_steps
        due = trained and (step % ckpt.checkpoint_freq == 0 or last)
        if trained and self.val_plans is not None and (step % loop.validation_freq == 0 or last):
            self.hooks.after_validation(step, self.validate())
        if trained:
            self.hooks.evaluate(step, last)  # the samples (loop/observers/samples.py)
        # The turn's collective decided (with several ranks, in the step; with one, here and now).
        agreed = self.agreement if self.agreement is not None else self._agree(None)
        self.agreement = None
        stop, interrupted, time_due, walltime_save, walltime_stop, asked = agreed.flags
        self.interrupted = interrupted
        if interrupted and not last:
            print0(step_line.interrupted_line(step))
        if due or stop or time_due or walltime_save or walltime_stop or asked:
            if walltime_save and not (stop or walltime_stop):
                print0(
                    f"Saving early at step {step}: the next checkpoint would land too close to the time limit"
                )
            self.save_checkpoint()
        self.reporter.exclude(time.perf_counter() - paused)
        if last:
            return None
        reason = None
        if stop:
            reason = "preempted"
        elif walltime_stop:
            reason = "walltime"
        elif asked:  # the asking observer's reason; a rank whose observers did not ask says "observer"
            reason = self.hooks.stop.reason if self.hooks.stop is not None else "observer"
        if reason is not None and self.dist.is_main and os.environ.get(launch_env.STOP_REASON_FILE):
            # Saved, and stopping: the launcher's reason to requeue, and its word that the save is done (a second
            # Ctrl-C from here on aborts nothing unsaved).
            reason_file = Path(os.environ[launch_env.STOP_REASON_FILE])
            reason_file.parent.mkdir(parents=True, exist_ok=True)
            reason_file.write_text(reason + "\n")
        return reason

    def _walltime_plan(self) -> walltime.Decision:
        if self.walltime is None:
            return walltime.Decision()
        assert self.reporter is not None
        ckpt, step = self.cfg.checkpoint, self.state.step
        next_save = min(self.max_steps, (step // ckpt.checkpoint_freq + 1) * ckpt.checkpoint_freq)
        return self.walltime.decide(step, self.reporter.step_time(), next_save)
