"""DeepSpeed behind the engine seam (base.py), `--backend deepspeed`: ZeRO stages, offload and precision come from its
config. DeepSpeedEngine implements every protocol of the seam: the step, what it reads of a config, its checkpoint
format (the files of its tags, the conversion of a tag for another world size into its universal layout, reading a
tag's full weights for `dskit export`) and its memory model (ZeRO's model states and buffers: estimate_zero).
"""

from __future__ import annotations

import contextlib
import io
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from model_utils.config.deepspeed_file import get
from model_utils.engines import deepspeed_config, generation, memory, step_loss
from model_utils.engines.memory import Line, MemoryEstimate, ModelShape, ZeroLayout
from model_utils.errors import ConfigError
from model_utils.launch import ops, startup
from model_utils.observe.log import print0
from model_utils.optim import schedules

if TYPE_CHECKING:
    from model_utils.data.step_batches import Batch
    from model_utils.engines.base import Objective, Run

# DeepSpeed's global timers (deepspeed.utils.timer): summed over the micro-batches of one optimizer step, and
# reset at its accumulation boundary. Its *_microstep timers hold the last micro-batch only.
WALL_CLOCK_TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
# DeepSpeed counts a discarded step in global_steps; the count of them travels with the checkpoint.
DISCARDED_KEY = "dskit_discarded_steps"
# A tag's files: ZeRO-1/2 write mp_rank_00_model_states.pt (with the client state), ZeRO-3
# zero_pp_rank_<R>_mp_rank_00_model_states.pt; each rank one *optim_states.pt shard (the fp32 masters).
MODEL_STATES = "mp_rank_00_model_states.pt"
MODEL_STATES_GLOB = "*model_states.pt"
OPTIM_STATES_GLOB = "*optim_states.pt"
# One rank's own shard (its optimizer state; ZeRO-3 also its model states): `[bf16_]zero_pp_rank_<R>_mp_rank_00_...`.
RANK_SHARD = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_\w+\.pt$")
# A tag converted for another world size (universal layout): `<tag>-universal`, never itself a resume candidate
# (its name is no tag's), kept while its source tag is.
UNIVERSAL_SUFFIX = "-universal"
# Bytes per parameter in a tag: the 16-bit (or fp32) module weights, the fp32 masters and Adam's two fp32 moments.
_CHECKPOINT_BYTES_PER_PARAM = {True: 2 + 12, False: 4 + 12}  # keyed by "half-precision training"


_ADAM_TYPES = ("adam", "adamw")
TORCH_ADAM = "torch_adam"  # DeepSpeed's optimizer param: torch.optim's Adam/AdamW instead of its own kernels


def _offloaded_optimizer(ds: dict[str, Any]) -> bool:
    return get(ds, ("zero_optimization", "offload_optimizer", "device")) in ("cpu", "nvme")


def _with_torch_adam(ds: dict[str, Any]) -> dict[str, Any] | None:
    """`ds` with torch_adam set, where CPU ranks take torch's Adam(W) instead of FusedAdam; None: left as it is."""
    optimizer = ds.get("optimizer")
    if not isinstance(optimizer, dict) or str(optimizer.get("type", "")).lower() not in _ADAM_TYPES:
        return None
    if _offloaded_optimizer(ds) or TORCH_ADAM in (optimizer.get("params") or {}):
        return None
    return {**ds, "optimizer": {**optimizer, "params": {**(optimizer.get("params") or {}), TORCH_ADAM: True}}}


def torch_adam_on_cpu(ds: dict[str, Any]) -> dict[str, Any]:
    """The config for CPU ranks: torch's AdamW (Adam) where DeepSpeed would take FusedAdam, a GPU kernel whose CPU
    copy it would first JIT-build (minutes of silence, for no speed-up on a CPU). An offloaded optimizer keeps
    DeepSpeedCPUAdam (built by `make warm`, and faster), and a torch_adam the config sets is left as it is."""
    changed = _with_torch_adam(ds)
    if changed is None:
        return ds
    params = changed["optimizer"]["params"]
    # DeepSpeed's rule: decoupled weight decay for "AdamW", and for "Adam" unless adam_w_mode is off.
    adamw = str(changed["optimizer"]["type"]).lower() == "adamw" or params.get("adam_w_mode", True)
    print0(
        f"Optimizer: torch.optim.{'AdamW' if adamw else 'Adam'} on CPU ranks (DeepSpeed's FusedAdam is a GPU kernel)"
    )
    return changed


# The op builder DeepSpeed's optimizer of each type loads (engine._configure_basic_optimizer), by where its state
# lives: (offloaded to the CPU, on the device). None: a torch.optim optimizer, nothing to build.
_OPTIMIZER_OPS: dict[str, tuple[str | None, str | None]] = {
    "adam": ("CPUAdamBuilder", "FusedAdamBuilder"),
    "adamw": ("CPUAdamBuilder", "FusedAdamBuilder"),
    "adagrad": ("CPUAdagradBuilder", None),
    "lamb": ("FusedLambBuilder", "FusedLambBuilder"),
    "lion": ("CPULionBuilder", "FusedLionBuilder"),
}


def jit_ops(ds: dict[str, Any], device_type: str) -> tuple[str, ...]:
    """The DeepSpeed op builders (class names) that deepspeed.initialize loads for config `ds` on ranks of
    `device_type`: the optimizer's kernel, and the async-IO op when anything is offloaded to NVMe."""
    if device_type == "cpu":
        ds = _with_torch_adam(ds) or ds
    ops: list[str] = []
    optimizer = ds.get("optimizer")
    if isinstance(optimizer, dict) and not (optimizer.get("params") or {}).get(TORCH_ADAM):
        offloaded, on_device = _OPTIMIZER_OPS.get(str(optimizer.get("type", "")).lower(), (None, None))
        op = offloaded if _offloaded_optimizer(ds) else on_device
        if op is not None:
            ops.append(op)
    offloads = (
        get(ds, ("zero_optimization", key, "device")) for key in ("offload_optimizer", "offload_param")
    )
    if "nvme" in offloads:
        ops.append("AsyncIOBuilder")
    return tuple(ops)


# --- the memory model: ZeRO's model states and buffers (the rest: memory.py) ---


def _elements(n: int) -> str:
    """An element count as DeepSpeed configs write it: 500000000 -> '5e8'."""
    mantissa, exponent = f"{n:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _pinned(nbytes: int, pin: bool) -> int:
    # PyTorch's CachingHostAllocator rounds every pinned allocation up to a power of two (its default
    # pinned_max_round_threshold), so a 149 MB fp32 partition locks 256 MiB.
    return 1 << (nbytes - 1).bit_length() if pin and nbytes > 1 else nbytes


def _pinned_subgroups(numel: int, bytes_per: int, sub_group_size: int, pin: bool) -> int:
    """ZeRO-3 allocates its per-partition CPU buffers per sub-group of at most sub_group_size elements."""
    full, rest = divmod(numel, max(sub_group_size, 1))
    return full * _pinned(sub_group_size * bytes_per, pin) + _pinned(rest * bytes_per, pin)


def estimate_zero(m: ModelShape, lay: ZeroLayout) -> MemoryEstimate:
    """DeepSpeed ZeRO (--backend deepspeed) at any stage and offload: what DeepSpeed 0.19 allocates
    (runtime/zero/stage_1_and_2.py, stage3.py) for a model built in full in every process (no zero.Init) and AdamW.
    The model states follow DeepSpeed's own estimators (estimate_zero2/3_model_states_mem_needs) within 10% for
    the configurations tests/unit/engines/test_deepspeed_engine.py compares; each place that counts differently
    says why."""
    P, N, b = m.total_params, lay.world_size, lay.dtype_bytes
    part = memory.ceil_div(P, N)  # each rank's partition of the flat parameter buffer
    L, big = m.largest_layer_params, m.largest_param
    off_opt = lay.offload_optimizer
    # The parameters that hold gradients and optimizer states: all, or under LoRA the adapters alone (the frozen
    # base reaches no optimizer group). Parameters themselves (the bf16 base) count in full either way.
    lora = m.trainable_params is not None
    full_params, full_part = P, part
    if lora:
        assert m.trainable_params is not None and m.largest_trainable_param is not None
        P, part = m.trainable_params, memory.ceil_div(m.trainable_params, N)
        L, big = min(L, P), m.largest_trainable_param  # a layer's gradient: at most the trainable ones

    # --- parameters, gradients, optimizer states on the GPU ---
    # Optimizer states are the fp32 master weights and Adam's m and v: 12 bytes per parameter of the partition.
    # Gradients include the fp32 copy DeepSpeed makes of the partition's gradients for the step (4 bytes), as
    # DeepSpeed's estimators count it (their "18 = 2 + 4 + 4 + 8").
    if lay.stage == 3:
        # Parameters under stage3_param_persistence_threshold (norms) stay whole on every rank: well under 1%
        # of a real model, and left out as DeepSpeed's estimator leaves them out.
        params = (0 if lay.offload_params else b * full_part) + b * m.largest_layer_params
        params_how = f"{'' if lay.offload_params else '1/' + str(N) + ' partition + '}largest layer gathered"
        # The fp32 copy of the partition's gradients exists only during the step, when no layer is gathered,
        # so the larger of the two counts. DeepSpeed's estimator counts 18 bytes per partitioned parameter and
        # leaves out the bf16 parameter partition itself (it does count it when the optimizer is offloaded).
        grads = (0 if off_opt else b * part) + max(b * L, 0 if off_opt else 4 * part)
        grads_how = "largest layer's" + ("" if off_opt else f" or the fp32 step copy, + 1/{N} partition")
    else:
        params, params_how = b * full_params, "whole model on every GPU"
        if lay.stage == 0:
            grads, grads_how = (b + 4) * P, "whole model, bf16 and fp32"
        elif lay.stage == 1:
            grads = b * P + (0 if off_opt else 4 * part)
            grads_how = "whole model (ZeRO-1 does not partition them)" + (
                "" if off_opt else " + fp32 partition"
            )
        else:
            grads = 0 if off_opt else (b + 4) * part
            grads_how = "reduced into the CPU partition" if off_opt else f"1/{N} partition, bf16 and fp32"
    if lay.stage == 0:
        optim, optim_how = 12 * P, "fp32 master + Adam m, v, whole model"
    elif off_opt:
        optim, optim_how = 0, "on the CPU"
    else:
        optim, optim_how = 12 * part, f"fp32 master + Adam m, v of a 1/{N} partition"

    # --- DeepSpeed's buffers ---
    if lay.stage == 3:
        # One reduce bucket per dtype (stage3.py), and the parameters prefetched ahead of the running layer.
        buffers = (
            b * lay.reduce_bucket_size if lay.contiguous_gradients else 0
        ) + b * lay.prefetch_bucket_size
        buffers_how = f"reduce bucket {_elements(lay.reduce_bucket_size)}, prefetch {_elements(lay.prefetch_bucket_size)}"
    else:
        contiguous = lay.contiguous_gradients or off_opt  # DeepSpeed forces contiguous gradients with offload
        if lay.stage == 0 or not contiguous:
            n_buckets, bucket_numel = 1, min(P, lay.reduce_bucket_size)
        else:
            n_buckets, bucket_numel = (2 if lay.overlap_comm else 1), lay.reduce_bucket_size
        # The largest gradient exists once outside the bucket before it is copied in; with offload it is staged
        # through a GPU buffer of the same size. The all-gather after the step works in place in the flat
        # parameter buffer (all_gather_into_tensor over NCCL), so allgather_bucket_size costs nothing extra.
        buffers = n_buckets * b * bucket_numel + b * big + (b * big if off_opt else 0)
        buffers_how = f"reduce buckets {n_buckets} x {_elements(bucket_numel)}, largest gradient" + (
            ", offload staging" if off_opt else ""
        )
        buffers_how += "; all-gather in place"

    states = (
        Line("parameters", params, params_how),
        Line("gradients", grads, grads_how),
        Line("optimizer states", optim, optim_how),
        Line("buffers", buffers, buffers_how),
    )

    # --- host RAM per node ---
    P = full_params  # the build holds the whole model
    ranks = lay.ranks_per_node
    pin = lay.pin_memory
    # DeepSpeed's estimators assume the fp32 model built on the CPU in every process (their "4 * n_gpus"),
    # true for presets; a pretrained model is loaded directly in bf16, so it takes half that.
    build = int(ranks * m.build_bytes_per_param * P * memory.BUILD_BUFFER_FACTOR)
    per_rank, offload_how = 0, ""
    if lay.stage in (1, 2) and off_opt:
        # stage_1_and_2.py: pinned fp32 master partition, a pinned bf16 copy of it, pinned fp32 gradients and a
        # pinned staging buffer of the largest parameter; CPU Adam's m and v are ordinary memory. DeepSpeed's
        # estimator counts 16 bytes per parameter and leaves out the bf16 copy and the staging buffer.
        per_rank = (
            _pinned(4 * part, pin) + _pinned(b * part, pin) + _pinned(4 * part, pin) + _pinned(b * big, pin)
        ) + 8 * part
        if lay.gradient_accumulation_steps > 1:
            per_rank += _pinned(b * part, pin)  # gradients accumulated on the CPU between boundaries
        offload_how = "fp32 master, its bf16 copy, fp32 grads, staging buffer, Adam m and v"
    elif lay.stage == 3 and (off_opt or lay.offload_params):
        sub = lay.sub_group_size
        if off_opt:
            # stage3.py: fp32 master and Adam m, v in ordinary memory; pinned fp32 gradients per sub-group and
            # the pinned bf16 gradient partition. DeepSpeed's estimator counts 16 bytes (18 with parameters).
            per_rank += 12 * part + _pinned_subgroups(part, 4, sub, pin) + _pinned(b * part, pin)
            offload_how = "fp32 master, Adam m and v, fp32 and bf16 grads"
        if lay.offload_params:
            per_rank += _pinned(b * full_part, pin)
            offload_how += (", " if offload_how else "") + "bf16 parameters"
    offload = ranks * per_rank
    pinned_note = "; pinned ones rounded up to 2^n bytes" if pin and offload else ""
    build_how = f"{m.total_params / 1e6:.2f}M params x {m.build_bytes_per_param} B"
    return memory.estimate_of(m, lay, states, (build, build_how), (offload, f"{offload_how}{pinned_note}"))


class DeepSpeedEngine:
    title = "DeepSpeed"
    objective: Objective = step_loss.TokenMean()
    # A checkpoint of another world size goes through convert_universal first (trainer._load).
    reshards_on_load = False
    # ZeRO stages 0-3, with optimizer and parameter offload (memory.check_zero).
    zero_stages = True
    default_config = "deepspeed/ds_config.json"  # ZeRO-2, optimizer offloaded to the CPU
    gpu_only_config = "deepspeed/ds_config_gpu.json"  # ZeRO-2, no offload: CUDA ranks where it fits
    model_in_fp32 = False  # built in the training precision; DeepSpeed keeps the fp32 masters
    # The shipped config of each (ZeRO stage, offload) layout (layout_flags). None for ZeRO-1 with offload (ZeRO-2's
    # keeps less on the GPU) nor stage 0 (dskit estimate never recommends it: ZeRO-1 is as fast with less memory).
    shipped_configs: ClassVar[dict[tuple[int, str], str]] = {
        (1, "none"): "deepspeed/ds_config_zero1.json",
        (2, "none"): gpu_only_config,
        (2, "optimizer"): default_config,
        (3, "none"): "deepspeed/ds_config_zero3_gpu.json",
        (3, "optimizer"): "deepspeed/ds_config_zero3.json",
        (3, "optimizer+params"): "deepspeed/ds_config_zero3_offload_params.json",
    }

    @staticmethod
    def check_config(ds: dict[str, Any], path: str) -> None:
        """DeepSpeed reads every key of its own config: its checks run for both engines (deepspeed_config.check)."""

    discards_nonfinite_steps = staticmethod(deepspeed_config.discards_nonfinite_steps)
    jit_ops = staticmethod(jit_ops)

    def __init__(
        self,
        model: torch.nn.Module,
        ds_config: dict[str, Any],
        param_groups: list[dict[str, Any]] | None = None,
        lr_scheduler: Callable[[Any], Any] | None = None,
        sequence_parallel: int = 1,
    ) -> None:
        """`param_groups`: the optimizer's parameter groups (param_groups.py); default: one group of every
        trainable parameter. `lr_scheduler`: optimizer -> scheduler, for a schedule DeepSpeed has none of (the
        config then has no scheduler section). `sequence_parallel`: ranks sharing each sequence (Ulysses,
        sequence_parallel.py); the model's attention is routed through DeepSpeed's wrapper here."""
        deepspeed = startup.import_deepspeed()
        self.sequence_parallel = sequence_parallel
        mpu = None
        if sequence_parallel > 1:
            from model_utils.engines import sequence_parallel as ulysses

            mpu = ulysses.register(model, sequence_parallel, ds_config["train_micro_batch_size_per_gpu"])
            ds_config = {**ds_config, "sequence_parallel_size": sequence_parallel}
        # The CPU's description beside the ops built for it: one probe per host and boot, not per rank.
        with startup.cpu_info_computed_once(ops.extensions_dir()), startup.schedule_start_unlogged():
            self._engine, _, _, _ = deepspeed.initialize(
                model=model,
                model_parameters=param_groups or [p for p in model.parameters() if p.requires_grad],
                config=ds_config,
                lr_scheduler=lr_scheduler,
                mpu=mpu,
            )
        self.module = self._engine.module
        self._averaged_over = self._reduction_ranks()  # fixed for the engine's life: not asked each step
        self._discarded = 0  # steps discarded at the caller's request (train_step's `keep`)
        # False (from_run: a resume onto another --lr_schedule): load() leaves the scheduler's state out,
        # another class's; the schedule is positioned by start_schedule_at either way.
        self._loads_schedule_state = True

    @staticmethod
    def prepare_model(model: torch.nn.Module, run: Run, device: torch.device) -> torch.nn.Module:
        return model  # deepspeed.initialize partitions the model itself

    @classmethod
    def from_run(
        cls,
        model: torch.nn.Module,
        run: Run,
        device: torch.device,
        param_groups: list[dict[str, Any]],
        objective: Objective | None = None,
    ) -> DeepSpeedEngine:
        # DeepSpeed runs the schedules it has a class for from its JSON; the kit's own (wsd, linear) are handed over.
        assert run.max_steps is not None
        client = run.settings.train.schedule.client(run.max_steps)
        scheduler = None if client is None else client.lambda_lr
        ds = run.deepspeed_config()
        if device.type == "cpu":
            ds = torch_adam_on_cpu(ds)
        ops.build_ops(jit_ops(ds, device.type), device.type)  # announced, before DeepSpeed loads them
        engine = cls(model, ds, param_groups, lr_scheduler=scheduler, sequence_parallel=run.sequence_parallel)
        engine._loads_schedule_state = run.loads_schedule_state
        if objective is not None:
            engine.objective = objective
        return engine

    def train_step(
        self,
        micro_batches: list[Batch],
        keep: Callable[[torch.Tensor], bool] | None = None,
        targets: int | None = None,
    ) -> tuple[torch.Tensor, bool]:
        losses = []
        applied = True
        skipped_before = self._engine.skipped_steps
        # DeepSpeed's backward divides each micro-batch's loss by the accumulation steps and its reduction averages
        # the gradients over the data-parallel ranks (it sums a sequence's shards): the divisor gives both back
        # (step_loss.py).
        accumulation = int(self._engine.gradient_accumulation_steps())  # what its backward divides by
        assert accumulation == len(micro_batches), (accumulation, len(micro_batches))
        divisor = step_loss.loss_divisor(micro_batches, accumulation * self._averaged_over, targets)
        last = len(micro_batches) - 1
        mean_loss = None  # the step's, once its last forward has run
        for i, batch in enumerate(micro_batches):
            loss = self.objective.summed_loss(self._engine, batch, divisor)
            losses.append(loss.detach())
            if i == last:
                # This rank's share, whose mean over all ranks is the step's loss (the divisor's ranks are not
                # all of them under sequence parallelism).
                scale = step_loss.world_ranks() / self._averaged_over
                mean_loss = torch.stack(losses).double().sum() * scale / accumulation
                if keep is not None and not keep(mean_loss):
                    # The earlier micro-batches' gradients already sit in ZeRO's buffers (zero_grad() does not
                    # clear them) and step() without a backward fails. A non-finite gradient makes DeepSpeed's
                    # own overflow check throw the whole step away instead: weights, optimizer state and lr
                    # schedule stay exactly as they were (tests/e2e/test_spike_guard.py; preflight allows the
                    # guard only where DeepSpeed checks).
                    loss = loss * float("nan")
                    applied = False
            with contextlib.nullcontext() if applied else startup.overflow_unlogged():
                self._engine.backward(loss)
                self._engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
        if not applied:
            assert self._engine.skipped_steps == skipped_before + 1, "DeepSpeed applied a discarded step"
            self._discarded += 1
        assert mean_loss is not None
        return mean_loss, applied

    def _reduction_ranks(self) -> int:
        """The ranks DeepSpeed's gradient reduction divides by: the data-parallel ones, as it sums a sequence's
        shards; but ZeRO-3's reduce-scatter divides by all ranks, shards included (DeepSpeed 0.19: only its
        all-reduce path corrects for sequence parallelism), so its gradients would come out N times too small
        (tests/e2e/test_step_loss.py fails when that changes)."""
        ranks = step_loss.world_ranks()
        if self._engine.zero_optimization_stage() == 3 and self._engine.zero_reduce_scatter():
            return ranks
        return ranks // self.sequence_parallel

    def eval_loss(self, batch: Batch) -> float:
        return self.objective.eval_summed_loss(self._engine, batch)

    @torch.no_grad()
    def sequence_logps(self, batch: Batch) -> torch.Tensor:
        from model_utils.engines import preference  # preference runs only

        return preference.sequence_logps(self._engine, batch)[0]

    def generate(self, prompts: list[tuple[int, ...]], new_tokens: int) -> list[list[int]]:
        # Through the engine's forward: under ZeRO-3 its hooks gather each layer's weights on every rank.
        return generation.greedy(self._engine, prompts, new_tokens, self._engine.device)

    def train(self) -> None:
        self._engine.train()

    def eval(self) -> None:
        self._engine.eval()

    def lr(self) -> float:
        return float(self._engine.get_lr()[0])

    def grad_norm(self) -> float | None:
        norm = self._engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def optimizer_steps(self) -> int:
        return int(self._engine.global_steps) - self._discarded

    def skipped_steps(self) -> int:
        return int(getattr(self._engine, "skipped_steps", 0)) - self._discarded

    def wall_clock_ms(self) -> dict[str, float]:
        if not self._engine.wall_clock_breakdown():
            return {}
        # DeepSpeed caches its timers in every engine.step() before it logs and resets the global ones at the
        # boundary: read after the boundary step, the cache holds this optimizer step's totals.
        cache = self._engine.get_wall_clock_timers()
        return {name: float(cache[name]) for name in WALL_CLOCK_TIMERS if name in cache}

    def start_schedule_at(self, step: int) -> None:
        schedules.start_at(self._engine.lr_scheduler, step)

    def save(self, tag_dir: Path, client_state: dict[str, Any]) -> None:
        state = {
            **client_state,
            # Marks the checkpoint as convertible with deepspeed.checkpoint.ds_to_universal (world-size changes).
            "universal_checkpoint_info": {},
            DISCARDED_KEY: self._discarded,
        }
        # DeepSpeed's own `latest` (a plain write before its last barrier) is never used: checkpoint.py owns it.
        self._engine.save_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, client_state=state, save_latest=False
        )

    def after_failed_save(self) -> None:
        # Every write of save_checkpoint comes after its collectives but its last, a barrier: the ranks whose
        # writes went through wait there.
        torch.distributed.barrier()

    def load(self, tag_dir: Path, weights_only: bool, universal: bool = False) -> dict[str, Any] | None:
        # `universal`: tag_dir was written by convert_universal. DeepSpeed reads its `checkpoint.load_universal`
        # config flag only while loading (engine.load_universal_checkpoint()), so it is set for this load
        # alone: a same-world-size resume of an ordinary tag must not see it.
        if weights_only and not universal and self._other_stage(tag_dir):
            return self._load_weights_of_other_stage(tag_dir)
        config = self._engine._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = universal
        try:
            path, client_state = self._engine.load_checkpoint(
                str(tag_dir.parent),
                tag=tag_dir.name,
                load_optimizer_states=not weights_only,
                load_lr_scheduler_states=not weights_only and self._loads_schedule_state,
            )
        finally:
            config.load_universal_checkpoint = before
        if path is None:
            return None
        self._discarded = int(client_state.get(DISCARDED_KEY, 0))  # global_steps came back with them
        return client_state

    def _other_stage(self, tag_dir: Path) -> bool:
        """Whether tag_dir was saved on the other side of ZeRO-3 (which partitions the weights and names its
        model-states files per rank) from this engine: DeepSpeed's own load finds none of its files."""
        saved_by_stage3 = not (tag_dir / MODEL_STATES).is_file() and any(tag_dir.glob(MODEL_STATES_GLOB))
        return saved_by_stage3 != bool(self._engine.zero_optimization_partition_weights())

    def _load_weights_of_other_stage(self, tag_dir: Path) -> dict[str, Any] | None:
        """The weights of a tag saved under another ZeRO stage (its fp32 masters, consolidated on rank 0) into
        this engine's module, the optimizer's masters refreshed from them; the client state and step counts from
        the tag's model states (every stage writes them with each rank's)."""
        import deepspeed

        states = sorted(tag_dir.glob(MODEL_STATES_GLOB))
        if not states:
            return None
        stage3 = bool(self._engine.zero_optimization_partition_weights())
        # ZeRO-3: rank 0 alone holds the full weights, gathering one parameter at a time to copy it in; below
        # ZeRO-3 every rank holds the whole model anyway and reads its own copy (no collective).
        reads = not stage3 or torch.distributed.get_rank() == 0
        full = self.read_full_state_dict(tag_dir, torch.float32) if reads else {}
        names = [name for name, _ in self.module.named_parameters()]
        lacking = torch.tensor([sum(name not in full for name in names) if reads else 0])
        torch.distributed.all_reduce(lacking)  # every rank stops, or none (ZeRO-3's gathers need them all)
        if int(lacking):
            raise ConfigError(
                f"checkpoint {tag_dir} lacks {int(lacking)} of this model's parameters: resume it with its own "
                "--deepspeed_config (ZeRO stage), or use a new --checkpoint_dir"
            )
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                gathered = deepspeed.zero.GatheredParameters([param], modifier_rank=0) if stage3 else None
                with gathered or contextlib.nullcontext():
                    if reads:
                        param.copy_(full[name])
        optimizer = self._engine.optimizer
        if hasattr(optimizer, "refresh_fp32_params"):  # its fp32 masters from the weights just copied in
            optimizer.refresh_fp32_params()
        # Memory-mapped: a ZeRO-0/1/2 file holds the 16-bit weights too, which are not read here.
        saved = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True)
        self._engine.global_steps = int(saved["global_steps"])
        self._engine.global_samples = int(saved.get("global_samples", 0))
        self._engine.skipped_steps = int(saved.get("skipped_steps", 0))
        self._discarded = int(saved.get(DISCARDED_KEY, 0))
        return saved

    # --- the checkpoint's files, without an engine ---

    @staticmethod
    def owns_tag(tag_dir: Path) -> bool:
        return any(tag_dir.glob(MODEL_STATES_GLOB))

    @staticmethod
    def writer_rank(rel: str) -> int | None:
        if rel == MODEL_STATES:
            return 0  # ZeRO-1/2: data-parallel rank 0 writes the module's weights and the client state
        m = RANK_SHARD.search(rel)
        return int(m[1]) if m else None

    @staticmethod
    def converted_tag(tag: str) -> str:
        return f"{tag}{UNIVERSAL_SUFFIX}"

    @staticmethod
    def convert_universal(source: Path, output: Path) -> str:
        """Rewrite the checkpoint in `source` (saved at any world size) into `output` in DeepSpeed's universal
        layout (one file per parameter and optimizer state, under output/zero/), which load(universal=True)
        reads at any world size. One process, no collectives; returns DeepSpeed's chatter (progress bars)."""
        from deepspeed.checkpoint import ds_to_universal

        args = types.SimpleNamespace(
            input_folder=str(source),
            output_folder=str(output),
            # Serial: a process pool forked from a rank (threads, a process group) is not safe.
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,  # dskit saves universal_checkpoint_info (save above)
        )
        chatter = io.StringIO()
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
        # main() also writes `latest_universal` beside output with a plain open(); dskit never reads it.
        (output.parent / "latest_universal").unlink(missing_ok=True)
        return chatter.getvalue()

    @staticmethod
    def check_exportable(tag_dir: Path) -> None:
        if not any(tag_dir.glob(OPTIM_STATES_GLOB)):
            raise ConfigError(
                f"checkpoint {tag_dir} has no {OPTIM_STATES_GLOB}: export needs ZeRO's fp32 master weights, "
                "saved with the optimizer state; export another tag"
            )

    @staticmethod
    def read_client_state(tag_dir: Path) -> dict[str, Any]:
        # Every ZeRO stage writes the client state into each model-states file; memory-mapped, so a ZeRO-0/1/2
        # file's 16-bit weights are not read.
        states = sorted(tag_dir.glob(MODEL_STATES_GLOB))
        return torch.load(states[0], map_location="cpu", weights_only=False, mmap=True) if states else {}

    @staticmethod
    def read_full_state_dict(tag_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The consolidated fp32 masters (DeepSpeed's zero_to_fp32 over the optimizer shards, any stage), each
        materialised and cast one tensor at a time, in this one process (memory: dskit/export.py)."""
        startup.import_deepspeed()
        with startup.zero_to_fp32_quiet():
            return DeepSpeedEngine._consolidate(tag_dir, dtype)

    @staticmethod
    def _consolidate(tag_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            lazy = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag_dir.name, lazy_mode=True)
        except (ValueError, FileNotFoundError) as e:  # its checks of the shard set (count, stage, sizes)
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(
                f"DeepSpeed cannot consolidate {tag_dir} ({reason}): export another tag of that run"
            ) from None
        # Tied weights (Qwen3's lm_head and embed_tokens) are one object under two names: materialise it once
        # so the tie survives as shared storage. Ids are read while every object is alive.
        first_name: dict[int, str] = {}
        alias = {name: first_name.setdefault(id(t), name) for name, t in lazy.items()}
        state: dict[str, torch.Tensor] = {}
        for name in list(lazy):
            tensor = lazy.pop(name)
            if alias[name] != name:
                continue
            tensor = tensor.contiguous()  # ZeRO-3: gathers this one parameter from the shards; ZeRO-2: a view
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, source in alias.items():
            state.setdefault(name, state[source])
        return state

    @staticmethod
    def checkpoint_bytes_per_param(half_precision: bool) -> int:
        return _CHECKPOINT_BYTES_PER_PARAM[half_precision]

    # --- the memory model (estimate_zero above, memory.py) ---

    estimate_memory = staticmethod(estimate_zero)

    @staticmethod
    def runs_schedule(implementation: str) -> str:
        # DeepSpeed builds its own classes from the config's scheduler section; the kit's LambdaLR is handed to
        # deepspeed.initialize. DeepSpeed steps either with its optimizer.
        return f"{implementation}, stepped by the DeepSpeed engine"

    @staticmethod
    def describe_layout(layout: ZeroLayout) -> str:
        where = {
            "none": "no offload",
            "optimizer": "optimizer offloaded to CPU",
            "optimizer+params": "optimizer and parameters offloaded to CPU",
            "params": "parameters offloaded to CPU",
        }[layout.offload]
        pinned = " (pinned)" if layout.pin_memory and layout.offload != "none" else ""
        return f"ZeRO-{layout.stage}, {where}{pinned}, micro batch {layout.micro_batch_size}"

    @staticmethod
    def layout_flags(layout: ZeroLayout) -> list[str] | None:
        path = DeepSpeedEngine.shipped_configs.get((layout.stage, layout.offload))
        return None if path is None else ["--deepspeed_config", path]

    def close(self) -> None:
        self._engine.destroy()
