"""The training loop: start, one step at a time, finish. Everything that watches or acts on the steps (checkpoints,
validation, the spike guard, the reporter's lines and trackers, the time limit, the samples, the watchdog, the
ledger, uploads) is an observer on the loop's named points (hooks.py; loop/observers/, one file each).

Steps are optimizer steps (accumulation boundaries), never micro-batches: `max_steps`, logging, validation and
checkpoint frequencies all count them. Each step makes one collective (consensus.py), in the middle of the engine's
step, once its forwards have run: the loss the observers judge, their requests (save, stop), the next step's
target count and, now and then, the ranks' step times. `close()` runs on every exit path.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from model_utils import engines
from model_utils.checkpoint import protocol
from model_utils.data import step_batches
from model_utils.data.sampler import BlockSampler, DataPosition
from model_utils.engines.base import Engine
from model_utils.errors import RunDiverged
from model_utils.launch.distributed import DistInfo, decide_on_main
from model_utils.launch.preemption import StopRequest
from model_utils.loop import consensus, hooks, observers, resume, stragglers
from model_utils.loop.hooks import DISCARDED, INTERRUPTED, PREEMPTED, REQUESTS, ROLLED_BACK, TRAINED
from model_utils.loop.reporter import Reporter
from model_utils.loop.state import TrainState
from model_utils.model import activation_checkpointing, kernels, lora, models, tiled_mlp
from model_utils.model.models import build_model
from model_utils.observe import metrics, step_line, watchdog
from model_utils.observe.log import print0, warn0
from model_utils.optim import param_groups
from model_utils.resolve.resolver import ResolvedRun

T = TypeVar("T")


def create_engine(run: ResolvedRun, dist: DistInfo) -> tuple[Engine, param_groups.DecayGroups, bool]:
    """The model in the training dtype, with the planned kernels, inside the engine (--backend) training on the
    run's objective; its decay groups; and whether the batches flatten documents into one row (the attention's
    variable-length path)."""
    cfg = run.config
    ts = run.settings.train
    # Weights are identical on every rank (one seed); data order and dropout differ per rank.
    model = build_model(run.source, run.model_config, cfg.loop.seed, ts.model_dtype())
    objective = None
    if cfg.objective.preference:
        from model_utils.engines import preference

        objective = preference.Preference(preference.Settings.of(cfg.objective))
        print0(f"Objective: {objective.settings.describe()}")
        if objective.settings.uses_reference:  # the weights the reference log-probabilities are of
            objective.reference_weights = models.weights_fingerprint(model)
    flatten = run.documents_apart and models.attend_within_documents(model, dist.device)  # before compile
    # Before Liger swaps modules and compile traces: the per-layer switch is set once on the plain model.
    activation_checkpointing.apply(model, cfg.model.activation_checkpointing)
    # Adapters after the checkpointing switch and before the kernels, which go on the inner Hugging Face model
    # (Liger knows no PeftModel; compile traces the tree with the adapters): see lora.py. The base is frozen, so
    # the decay groups below (trainable parameters only) hold the adapters alone.
    model = lora.apply(model, cfg.lora, cfg.loop.seed)
    kernels.optimize_model(lora.hf_model(model), cfg.model, dist.device)
    if cfg.model.tiled_mlp:  # around whichever MLP the kernels left
        tiled_mlp.apply(lora.hf_model(model))
    engine_type = engines.engine_class(ts.backend)
    # Before the decay groups: the engine may swap the parameters (FSDP shards them into DTensors); the groups are
    # of what it trains.
    model = engine_type.prepare_model(model, run, dist.device)
    groups = param_groups.split_for_weight_decay(model, cfg.optim.no_decay_embeddings)
    print0(groups.describe(ts.optim.weight_decay, cfg.optim.no_decay_embeddings))
    assert run.max_steps is not None
    print0(ts.schedule.describe(run.max_steps, engine_type.runs_schedule))
    torch.manual_seed(cfg.loop.seed + dist.rank)
    engine = engine_type.from_run(model, run, dist.device, groups.optimizer_groups(), objective)
    return engine, groups, flatten


class Trainer:
    def __init__(self, run: ResolvedRun, dist: DistInfo) -> None:
        assert run.world_size == dist.world_size and isinstance(run.micro_batch_size, int), "prepare on ranks"
        assert run.max_steps is not None
        self.run, self.dist, self.cfg, self.max_steps = run, dist, run.config, run.max_steps
        self.hooks = hooks.Hooks()  # the observers, once the loop is set up
        self.batches: step_batches.StepBatches | None = None
        self.consensus = consensus.StepConsensus(dist.rank, dist.world_size, dist.device)
        self.agreement: consensus.Agreement | None = None  # this step's, once its collective ran
        # The next step's targets over all ranks, summed in this step's collective: (its position, the count).
        self.next_targets: tuple[DataPosition, int] | None = None
        self.step_times = stragglers.StepTimes()  # this rank's, until the collective carries them
        self.sampler = BlockSampler.of(
            run.train_blocks,
            run.micro_batch_size,
            run.gradient_accumulation_steps,
            dist.data_rank,
            dist.data_ranks,
            self.cfg.loop.seed,
        )
        assert self.sampler.steps_per_epoch == run.steps_per_epoch, "one owner of steps per epoch: preflight"
        try:
            self.engine, decay_groups, self.flatten = create_engine(run, dist)
            self.groups = decay_groups.layout()
            self.batches = step_batches.StepBatches(
                run.train_blocks, self.sampler, dist.device, self.flatten, shard=dist.shard
            )
            self.state, saved = resume.start(run, dist, self.engine, self.groups)
            self.signals = StopRequest()  # a preemption's USR1, Ctrl-C: stop after the step, saved
            flops = models.flops_per_token(run.model_config, run.seq_length, self.cfg.lora)
            peak = metrics.peak_tflops(metrics.device_name(dist.device), self.cfg.report.peak_tflops)
            reporter = Reporter(
                self.cfg, dist, self.max_steps, run.tokens_per_step, flops, peak, self.engine.objective
            )
            context = observers.LoopContext(
                run, dist, self.engine, reporter, self.hooks, self.state, saved, self.groups, self.flatten
            )
            self.hooks.attach(observers.build(context))
        except BaseException:
            self.close()  # the batch worker and a tracker run opened before the error
            raise

    # --- the loop ---

    def fit(self) -> TrainState:
        """Start, step until max_steps or an agreed stop, finish (a --validation_only run validates at its start
        and takes no step)."""
        self.start()
        reason = step_line.VALIDATED if self.cfg.loop.validation_only else None
        try:
            while reason is None and self.state.step < self.max_steps:
                reason = self.step().stop
        except RunDiverged:
            self.hooks.on_end(self.state, "diverged")
            raise
        self.finish(reason or "done")
        return self.state

    def start(self) -> None:
        self.hooks.on_start(self.state)
        self.engine.train()
        self.hooks.evaluate(self.state.step, start=True)  # --validation_at_start, --validation_only

    def step(self) -> hooks.StepReport:
        """One optimizer step and everything after it: the observers, the evaluations due, the checkpoint."""
        assert self.batches is not None
        started = time.perf_counter()
        self.agreement, self.data_wait_s = None, 0.0
        while not self.hooks.takes(self.state.position):  # data the observers rule out is passed over
            self.state.position = self.sampler.advance(self.state.position)
        position, step, lr = self.state.position, self.state.step + 1, self.engine.lr()
        self.hooks.on_phase(watchdog.DATA, step)
        micro_batches = self._waited_for(lambda: self.batches.at(position))  # type: ignore[union-attr]
        self.hooks.before_step(step)
        agreed, self.next_targets = self.next_targets, None  # the turn before counted this step's targets
        targets = agreed[1] if agreed is not None and agreed[0] == position else None
        mean_loss, applied = self.engine.train_step(micro_batches, self._keep, targets)
        self.state.position = self.sampler.advance(position)
        if applied:
            self.state.step += 1
            assert self.engine.optimizer_steps() == self.state.step, (self.engine.optimizer_steps(), step)
            self.state.tokens_seen += self.run.tokens_per_step
        report = hooks.StepReport(
            step=step,
            outcome=TRAINED if applied else DISCARDED,
            loss=mean_loss.item() if applied else math.nan,  # one wait for the device a step
            lr=lr,
            grad_norm=self.engine.grad_norm() if applied else None,
            data_wait_s=self.data_wait_s,
            seconds=0.0,
            state=self.state,
            last=applied and self.state.step == self.max_steps,
            trained_tokens=sum(batch.targets for batch in micro_batches),  # counted when the rows were read
            skipped_steps=self.engine.skipped_steps(),
            phase_ms=self.engine.wall_clock_ms(),
        )
        rollback = self.hooks.judge(report)
        if rollback is not None and self._roll_back(rollback):
            report = dataclasses.replace(report, outcome=ROLLED_BACK, state=self.state, last=False)
        sync_wait = self.agreement.wait_s if self.agreement is not None else 0.0
        seconds = time.perf_counter() - started
        self.step_times.add(self.data_wait_s, sync_wait, seconds)
        rank_times = self.agreement.rank_times if self.agreement is not None else None
        report = dataclasses.replace(report, seconds=seconds, sync_wait_s=sync_wait, rank_times=rank_times)
        self.hooks.after_step(report)
        if report.trained:
            self.hooks.evaluate(step, report.last)  # validation, samples
        # The step's collective decided (with several ranks, in the step; with one, here and now).
        requests = self._requests(self.agreement or self._agree(step, None))
        stop = None if report.last else self.hooks.stop_reason(requests)
        asked = self.hooks.stop.why if self.hooks.stop else None  # an observer's Stop on this rank
        by = self.signals.signal_name if stop == "preempted" else asked
        if INTERRUPTED in requests and stop is not None:
            print0(step_line.interrupted_line(self.state.step))
        report = dataclasses.replace(report, requests=requests, stop=stop, stopped_by=by)
        self.hooks.at_checkpoint(report)  # the checkpointer saves when due or asked (a stop saves first)
        return report

    def finish(self, reason: str) -> None:
        self.hooks.on_end(self.state, reason)  # uploads finish, then the end record and line

    def close(self) -> None:
        """Stop the batch worker, close the observers (the tracker's run ends) and release the engine: on success
        and on errors alike. Idempotent."""
        if self.batches is not None:
            self.batches.close()
        self.hooks.on_close()
        engine = self.__dict__.pop("engine", None)  # a closed trainer has no engine
        if engine is not None:
            engine.close()

    # --- inside a step ---

    def _waited_for(self, read: Callable[[], T]) -> T:
        """A read of the data, its time added to the step's data wait."""
        started = time.perf_counter()
        got = read()
        self.data_wait_s += time.perf_counter() - started
        return got

    def _keep(self, mean_loss: torch.Tensor) -> bool:
        """The engine asks, once the step's forwards have run and before the update, whether this step happens.
        With several ranks the step's one collective runs here (the loss the observers judge, their requests, the
        straggler times): the first point where the ranks meet, so a late rank shows in the others' wait. The
        observers judge the loss of the whole step over all ranks, the same on every rank (the mean of the ranks'
        shares is the step's loss over its tokens)."""
        judging = self.hooks.acts("keeps")
        step = self.state.step + 1
        loss = None
        if self.dist.world_size > 1:
            batches = self.batches
            assert batches is not None
            # The next step's targets ride in this collective: its rows are read one step ahead (by now, usually).
            following = self.sampler.advance(self.state.position)
            self.hooks.on_phase(watchdog.DATA, step)  # a hung read is named as one
            targets = self._waited_for(lambda: batches.targets_at(following))
            self.agreement = self._agree(step, mean_loss if judging else None, targets)
            assert self.agreement.targets is not None
            self.next_targets = (following, self.agreement.targets)
            self.hooks.on_phase(watchdog.COMPUTE, step)
            loss = self.agreement.loss
        elif judging:
            loss = float(mean_loss.item())
        return not judging or self.hooks.keeps(step, loss)  # type: ignore[arg-type]

    def _agree(self, step: int, loss: torch.Tensor | None, targets: int | None = None) -> consensus.Agreement:
        """Step `step`'s one collective: the loss given, this rank's requests (its signal; the observers': a save,
        a stop), the next step's targets given, and the ranks' step times when a straggler window is full."""
        self.hooks.on_phase(watchdog.DECISION, step)
        every = self.cfg.loop.straggler_every
        due = self.dist.world_size > 1 and every > 0 and self.step_times.turns >= every
        times = self.step_times.take() if due else None
        asked = self.hooks.requests(step)
        if self.signals.signal_name is not None:
            asked |= {PREEMPTED, INTERRUPTED} if self.signals.interrupted else {PREEMPTED}
        return self.consensus.agree(loss, [r in asked for r in REQUESTS], times, targets)

    @staticmethod
    def _requests(agreement: consensus.Agreement) -> frozenset[str]:
        return frozenset(r for r, raised in zip(REQUESTS, agreement.flags, strict=True) if raised)

    def _roll_back(self, asked: hooks.Rollback) -> bool:
        """Back to the newest verified checkpoint (the observers are told, the state restored); without one,
        RunDiverged when the rollback is a must, else carry on (False)."""
        root = Path(self.cfg.checkpoint.checkpoint_dir)
        self.hooks.on_phase(watchdog.CHECKPOINT, self.state.step)  # loading may take as long as a save
        protocol.verify_in_parallel(str(root))  # the ranks check the files; rank 0's choice reads none again
        target = decide_on_main(lambda: protocol.newest_verified(root), self.dist)
        if target is None:
            why = f"{asked.why} and no verified checkpoint in {root}"
            if asked.must:
                raise RunDiverged(f"the spike guard stopped the run at step {self.state.step}: {why} to roll back to: "
                                  "lower --lr")  # fmt: skip
            warn0(
                f"Spike guard: {asked.why}, but no verified checkpoint in {root} yet to roll back to: carrying on"
            )
            return False
        live = self.state
        loaded = resume.load(self.run, self.dist, self.engine, self.groups, target)
        self.state = dataclasses.replace(loaded.state, run_id=live.run_id)
        done = dataclasses.replace(
            asked,
            from_step=live.step,
            from_position=live.position,
            tag=loaded.target.tag,
            step=self.state.step,
            position=self.state.position,
            saved=loaded.observers,
        )
        self.hooks.after_rollback(done)
        return True
