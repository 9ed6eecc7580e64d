"""PyTorch FSDP2 behind the engine seam (base.py): `--backend fsdp`.

The model is built in fp32 (the sharded parameters are the master weights), each decoder layer and then the
root are sharded with `fully_shard` on a one-dimensional device mesh of the rank's device type (a CPU mesh on
CPU: with gloo on a machine that has GPUs, FSDP2 would otherwise move to CUDA, pytorch#132471). bf16 runs are
FSDP2's MixedPrecisionPolicy (bf16 parameters in compute, fp32 gradient reduction). The optimizer, lr schedule
and clipping are the run's resolved settings (optim/settings.py), the same DeepSpeed reads from its JSON: torch
AdamW (fused on CUDA), and the ScheduleSpec's torch scheduler (DeepSpeed's own class for cosine/constant, the
kit's LambdaLR for wsd/linear, schedules.py), so both engines train the same lr. `check_config` refuses what a
DeepSpeed-format config asks that this engine would not honour. A checkpoint is Distributed Checkpoint (DCP)
shards of model and optimizer in `dcp/` plus one small torch file of the scheduler and the client state, written
by rank 0; DCP reshards on load, so a resume on another world size needs no conversion. `dskit export` reads those shards
here too (read_full_state_dict). Its memory model: estimate_fsdp.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from model_utils.compat import transformers_internals
from model_utils.engines import generation, memory, sequence_parallel, step_loss
from model_utils.engines.memory import Line, MemoryEstimate, ModelShape, ZeroLayout
from model_utils.errors import ConfigError, first_line
from model_utils.optim import schedules
from model_utils.optim.schedules import ScheduleSpec
from model_utils.optim.settings import OptimSettings

# What this engine reads of a DeepSpeed-format config; anything else there is DeepSpeed-only and refused.
CONFIG_KEYS = {
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "gradient_clipping": None,
    "optimizer": None,
    "scheduler": None,
    "bf16": {"enabled"},
    "steps_per_print": None,  # DeepSpeed's logging cadence: nothing to honour, harmless
}
OPTIMIZERS = ("AdamW", "Adam")  # both run as torch AdamW (DeepSpeed's Adam is AdamW by default too)
OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay"}
# torch AdamW's defaults, for what the config leaves out
DEFAULT_BETAS, DEFAULT_EPS, DEFAULT_WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.01

if TYPE_CHECKING:
    from model_utils.data.step_batches import Batch
    from model_utils.engines.base import Objective, Run

# A tag's files: DCP shards of model and optimizer in dcp/ (one .distcp file per rank and DCP's .metadata), and
# rank 0's small file of scheduler and client state.
DCP_DIR = "dcp"
STATE_FILE = "fsdp_client_state.pt"
# One rank's own shard file, as DCP's FileSystemWriter names it: dcp/__<R>_<N>.distcp.
RANK_SHARD = re.compile(rf"^{DCP_DIR}/__(\d+)_\d+\.distcp$")
# Bytes per parameter in a tag: the fp32 parameters (the masters) and Adam's two moments, no 16-bit copy.
CHECKPOINT_BYTES_PER_PARAM = 12


def shard(model: torch.nn.Module, device: torch.device, bf16: bool, cpu_offload: bool) -> torch.nn.Module:
    """fully_shard every decoder layer, then the root (which keeps the embeddings, final norm and head), in place.
    Parameters become DTensors: anything that holds parameters (the optimizer's groups) is built after this."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy: dict[str, Any] = {"mesh": mesh}
    if bf16:
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        # Pinned host memory needs CUDA; CPU ranks (the tests) offload to where they already are, unpinned.
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    layer_types = set(transformers_internals.no_split_modules(_hf_model(model).config))
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    assert layers, f"no decoder layers ({layer_types}) in {type(model).__name__}"
    for layer in layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    return model


def _hf_model(model: torch.nn.Module) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def estimate_fsdp(m: ModelShape, lay: ZeroLayout) -> MemoryEstimate:
    """FSDP2 (--backend fsdp), kept simple: every rank holds 1/N of the fp32 master parameters, their fp32
    gradients and Adam's m and v (16 bytes per trainable parameter / N; LoRA: the frozen base's 4 bytes / N only),
    plus, during compute, the running decoder layer and the prefetched next one gathered in the compute dtype,
    and the running layer's unsharded fp32 gradient before its reduce-scatter. With accumulation the unsharded
    gradients of the whole model stay between micro-batches (no reduce until the last). --fsdp_cpu_offload moves
    the shards (parameters, gradients, optimizer) to host RAM; the gathered layers stay on the GPU."""
    P, N, b = m.total_params, lay.world_size, lay.dtype_bytes
    T = m.trainable_params if m.trainable_params is not None else P
    L = m.largest_layer_params
    off = lay.offload_optimizer
    shard_p, shard_t = memory.ceil_div(P, N), memory.ceil_div(T, N)
    params = (0 if off else 4 * shard_p) + 2 * b * L
    params_how = ("" if off else f"fp32 1/{N} shard + ") + "2 layers gathered (running, prefetched)"
    grads = (0 if off else 4 * shard_t) + 4 * min(L, T)
    grads_how = ("" if off else f"fp32 1/{N} shard + ") + "the running layer's unsharded fp32 gradient"
    if lay.gradient_accumulation_steps > 1:
        grads += b * T
        grads_how += "; unsharded gradients kept between micro-batches"
    optim = 0 if off else 8 * shard_t
    optim_how = "on the CPU" if off else f"Adam m, v of a 1/{N} shard (the shard is the fp32 master)"
    states = (
        Line("parameters", params, params_how),
        Line("gradients", grads, grads_how),
        Line("optimizer states", optim, optim_how),
        Line("buffers", 0, "FSDP2's all-gather and reduce-scatter buffers are the layers counted above"),
    )
    ranks = lay.ranks_per_node
    build = int(ranks * 4 * P * memory.BUILD_BUFFER_FACTOR)  # built in fp32 on every rank before sharding
    offload = ranks * (4 * shard_p + 12 * shard_t) if off else 0
    return memory.estimate_of(
        m,
        lay,
        states,
        (build, f"{P / 1e6:.2f}M params x 4 B"),
        (offload, "fp32 shard, its gradients, Adam m and v"),
    )


class FsdpEngine:
    title = "FSDP2"
    objective: Objective = step_loss.TokenMean()
    # DCP reshards to any world size on load: trainer._load makes no universal copy for this engine.
    reshards_on_load = True
    # No ZeRO stages: everything is sharded, and --fsdp_cpu_offload moves all of it to the host.
    zero_stages = False
    default_config = "deepspeed/fsdp.json"  # the kit's config without ZeRO (the ZeRO default is DeepSpeed's)
    gpu_only_config = None
    model_in_fp32 = True  # the sharded fp32 parameters are the masters; bf16 is the compute policy

    @staticmethod
    def discards_nonfinite_steps(ds: dict[str, Any], precision: str) -> bool:
        return True  # it steps its optimizer itself: it can always leave a step out

    @staticmethod
    def jit_ops(ds: dict[str, Any], device_type: str) -> tuple[str, ...]:
        return ()  # torch's AdamW and collectives: no DeepSpeed op

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimSettings,
        schedule: ScheduleSpec,
        total_steps: int,
        param_groups: list[dict[str, Any]],
        device: torch.device,
        cpu_offload: bool = False,
    ) -> None:
        """`model`: sharded (shard()); `optim` and `schedule`: the run's resolved settings, the schedule over
        `total_steps`; `param_groups`: built from the sharded model."""
        self.module = model
        self._device = device  # where the inputs go (with --fsdp_cpu_offload too: the layers compute there)
        self._optimizer = torch.optim.AdamW(
            param_groups,
            lr=optim.lr,
            betas=optim.betas or DEFAULT_BETAS,
            eps=DEFAULT_EPS if optim.eps is None else optim.eps,
            weight_decay=DEFAULT_WEIGHT_DECAY if optim.weight_decay is None else optim.weight_decay,
            # Fused on CUDA (one kernel for every parameter); the CPU-offloaded step runs on the CPU.
            fused=device.type == "cuda" and not cpu_offload,
        )
        # None: a config without a scheduler, a constant lr, as under DeepSpeed
        self._scheduler = schedule.torch_scheduler(self._optimizer, total_steps)
        self._clip = optim.gradient_clipping
        self._steps = 0  # applied optimizer steps
        # False (from_run: a resume onto another --lr_schedule): load() leaves the scheduler's state out,
        # another class's; the schedule is positioned by start_schedule_at either way.
        self._loads_schedule_state = True
        self._grad_norm: float | None = None

    @staticmethod
    def prepare_model(model: torch.nn.Module, run: Run, device: torch.device) -> torch.nn.Module:
        ts = run.settings.train
        if run.sequence_parallel > 1:
            # The attention's all-to-all is the model's own: FSDP2 shards over every rank and its reduce-scatter
            # averages over all of them, which the step's divisor (over every rank) already gives back.
            micro_batch = run.deepspeed_config()["train_micro_batch_size_per_gpu"]
            sequence_parallel.register(model, run.sequence_parallel, micro_batch)
        return shard(model, device, ts.precision == "bf16", ts.fsdp_cpu_offload)

    @classmethod
    def from_run(
        cls,
        model: torch.nn.Module,
        run: Run,
        device: torch.device,
        param_groups: list[dict[str, Any]],
        objective: Objective | None = None,
    ) -> FsdpEngine:
        ts = run.settings.train
        assert run.max_steps is not None
        engine = cls(
            model, ts.optim, ts.schedule, run.max_steps, param_groups, device, cpu_offload=ts.fsdp_cpu_offload
        )
        engine._loads_schedule_state = run.loads_schedule_state
        if objective is not None:
            engine.objective = objective
        return engine

    @staticmethod
    def check_config(ds: dict[str, Any], path: str) -> None:
        """This engine reads the optimizer, scheduler, clipping, batch and bf16 of a DeepSpeed-format config; a
        DeepSpeed-only option set there (ZeRO, offload, fp16's loss scaler, ...) would be silently ignored:
        refused, in one line."""
        fix = "remove it or train with --backend deepspeed (docs/fsdp.md lists what fsdp reads)"
        if "zero_optimization" in ds:
            raise ConfigError(
                f"zero_optimization in {path} is DeepSpeed's ZeRO, which --backend fsdp does not run (FSDP2 shards "
                "parameters, gradients and optimizer state itself): remove the section (CPU offload under fsdp: "
                "--fsdp_cpu_offload) or train with --backend deepspeed"
            )
        if isinstance(ds.get("fp16"), dict) and ds["fp16"].get("enabled"):
            raise ConfigError(
                f"fp16 in {path}: --backend fsdp has no loss scaler; use bf16 (a bf16 section) or --backend deepspeed"
            )
        for key, value in ds.items():
            if value is False or (isinstance(value, dict) and value.get("enabled") is False):
                continue  # switched off (e.g. wall_clock_breakdown: false, fp16.enabled: false): nothing to honour
            if key not in CONFIG_KEYS:
                raise ConfigError(
                    f"{key} in {path} is a DeepSpeed-only option --backend fsdp does not honour: {fix}"
                )
            allowed = CONFIG_KEYS[key]
            if allowed is not None and isinstance(value, dict) and set(value) - allowed:
                extra = sorted(set(value) - allowed)[0]
                raise ConfigError(f"{key}.{extra} in {path} is DeepSpeed-only under --backend fsdp: {fix}")
        optimizer = ds.get("optimizer")
        if not isinstance(optimizer, dict):
            raise ConfigError(
                f"{path} has no optimizer section: --backend fsdp trains with torch AdamW, configured there: add "
                '"optimizer": {"type": "AdamW", "params": {"lr": "auto"}} (as deepspeed/fsdp.json has)'
            )
        if optimizer.get("type") not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer type {optimizer.get('type')!r} in {path}: --backend fsdp trains with torch AdamW "
                f"(type {' or '.join(OPTIMIZERS)}); change the type or train with --backend deepspeed"
            )
        extra = sorted(set(optimizer.get("params", {})) - OPTIMIZER_PARAMS)
        if extra:
            raise ConfigError(
                f"optimizer.params.{extra[0]} in {path} is DeepSpeed-only under --backend fsdp (torch AdamW takes "
                f"{', '.join(sorted(OPTIMIZER_PARAMS))}): remove it"
            )

    def train_step(
        self,
        micro_batches: list[Batch],
        keep: Callable[[torch.Tensor], bool] | None = None,
        targets: int | None = None,
    ) -> tuple[torch.Tensor, bool]:
        losses = []
        applied = True
        last = len(micro_batches) - 1
        # FSDP2's reduce-scatter averages the gradients over the ranks: the divisor gives that back (step_loss.py).
        divisor = step_loss.loss_divisor(micro_batches, step_loss.world_ranks(), targets)
        step_loss_sum = None  # the step's, once its last forward has run
        for i, batch in enumerate(micro_batches):
            # No reduce-scatter until the last micro-batch: FSDP2 accumulates the unsharded gradients meanwhile.
            self.module.set_requires_gradient_sync(i == last)
            loss = self.objective.summed_loss(self.module, batch, divisor)
            losses.append(loss.detach())
            if i == last:
                step_loss_sum = torch.stack(losses).double().sum()
                if keep is not None and not keep(step_loss_sum):
                    applied = False
            # A discarded step still runs its backward: the last micro-batch's reduce-scatter releases the
            # unsharded gradients the earlier ones left in FSDP2's buffers (zero_grad alone would not reach them);
            # the gradients are then dropped below, with no optimizer or scheduler step.
            loss.backward()
        if applied:
            self._grad_norm = self._clip_gradients()
            self._optimizer.step()
            if self._scheduler is not None:
                self._scheduler.step()
            self._steps += 1
        self._optimizer.zero_grad(set_to_none=True)
        assert step_loss_sum is not None
        return step_loss_sum, applied

    def _clip_gradients(self) -> float:
        """The global gradient norm before clipping (over every rank's shards), clipping to gradient_clipping."""
        from torch.distributed.tensor import DTensor

        grads = [
            p.grad for group in self._optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the shards' partial norms, reduced over the mesh
        if self._clip > 0:
            params = [p for group in self._optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grads_with_norm_(params, self._clip, norm)
        return float(norm)

    def eval_loss(self, batch: Batch) -> float:
        return self.objective.eval_summed_loss(self.module, batch)

    @torch.no_grad()
    def sequence_logps(self, batch: Batch) -> torch.Tensor:
        from model_utils.engines import preference  # preference runs only

        return preference.sequence_logps(self.module, batch)[0]

    def generate(self, prompts: list[tuple[int, ...]], new_tokens: int) -> list[list[int]]:
        # The sharded root's forward all-gathers each layer in turn: every rank runs every forward.
        return generation.greedy(self.module, prompts, new_tokens, self._device)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def lr(self) -> float:
        return float(self._optimizer.param_groups[0]["lr"])

    def grad_norm(self) -> float | None:
        return self._grad_norm

    def optimizer_steps(self) -> int:
        return self._steps

    def skipped_steps(self) -> int:
        return 0  # no loss scaler: FSDP never skips a step on its own

    def wall_clock_ms(self) -> dict[str, float]:
        return {}

    def start_schedule_at(self, step: int) -> None:
        schedules.start_at(self._scheduler, step)

    def save(self, tag_dir: Path, client_state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        model_state, optim_state = get_state_dict(self.module, self._optimizer)
        # Every rank writes its own shards (and rank 0 the metadata) into dcp/.
        try:
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tag_dir / DCP_DIR))
        except CheckpointException as e:  # a BaseException: raised as the failing rank's own error
            rank, (error, _) = next(iter(e.failures.items()))
            raise RuntimeError(f"rank {rank}: {first_line(error)}") from error
        if torch.distributed.get_rank() == 0:
            state = {
                "client_state": client_state,
                "scheduler": None if self._scheduler is None else self._scheduler.state_dict(),
                "optimizer_steps": self._steps,
            }
            torch.save(state, tag_dir / STATE_FILE)

    def after_failed_save(self) -> None:
        # A failed DCP write raises on every rank (DCP gathers the outcome), and rank 0's own file comes after
        # the last collective: nothing is left to join.
        pass

    def load(self, tag_dir: Path, weights_only: bool, universal: bool = False) -> dict[str, Any] | None:
        import torch.distributed.checkpoint as dcp

        assert not universal, "DCP reshards on load: no universal copy is made for FSDP"
        state_file = tag_dir / STATE_FILE
        if not state_file.is_file() or not (tag_dir / DCP_DIR).is_dir():
            return None
        dcp_dir = str(tag_dir / DCP_DIR)
        if weights_only:
            model_state = get_model_state_dict(self.module)
            dcp.load({"model": model_state}, checkpoint_id=dcp_dir)
            set_model_state_dict(self.module, model_state)
        else:
            # A torch LambdaLR keeps its `initial_lr` in the optimizer's param groups, DeepSpeed's classes do not:
            # onto another schedule the key is this run's scheduler's, not one to read from the checkpoint.
            initial_lrs = (
                []
                if self._loads_schedule_state
                else [group.pop("initial_lr", None) for group in self._optimizer.param_groups]
            )
            # get_state_dict initialises a fresh optimizer's state (a step at lr 0) so DCP has tensors to load
            # into; the saved state then replaces it, resharded for this world size.
            model_state, optim_state = get_state_dict(self.module, self._optimizer)
            loaded = {"model": model_state, "optim": optim_state}
            dcp.load(loaded, checkpoint_id=dcp_dir)
            set_state_dict(
                self.module,
                self._optimizer,
                model_state_dict=loaded["model"],
                optim_state_dict=loaded["optim"],
                options=StateDictOptions(strict=True),
            )
            for group, initial_lr in zip(self._optimizer.param_groups, initial_lrs, strict=False):
                group.pop("initial_lr", None)
                if initial_lr is not None:
                    group["initial_lr"] = initial_lr
        saved = torch.load(state_file, weights_only=False)
        loads_schedule = not weights_only and self._loads_schedule_state
        if loads_schedule and self._scheduler is not None and saved["scheduler"] is not None:
            self._scheduler.load_state_dict(saved["scheduler"])
        # The step count comes back either way (as DeepSpeed's global_steps does); a weights-only resume
        # repositions the schedule with start_schedule_at.
        self._steps = int(saved["optimizer_steps"])
        return saved["client_state"]

    # --- the checkpoint's files, without an engine ---

    @staticmethod
    def owns_tag(tag_dir: Path) -> bool:
        return (tag_dir / STATE_FILE).is_file()

    @staticmethod
    def writer_rank(rel: str) -> int | None:
        if rel in (STATE_FILE, f"{DCP_DIR}/.metadata"):
            return 0  # save() writes the state file on rank 0, DCP's coordinator (rank 0) the metadata
        m = RANK_SHARD.match(rel)
        return int(m[1]) if m else None

    @staticmethod
    def converted_tag(tag: str) -> None:
        return None  # no converted copies: DCP reshards on load

    @staticmethod
    def convert_universal(source: Path, output: Path) -> str:
        raise AssertionError("FSDP checkpoints reshard on load (reshards_on_load): nothing to convert")

    @staticmethod
    def check_exportable(tag_dir: Path) -> None:
        if not (tag_dir / DCP_DIR / ".metadata").is_file():
            raise ConfigError(
                f"checkpoint {tag_dir} has no {DCP_DIR}/.metadata: its Distributed Checkpoint shards are "
                "missing; export another tag"
            )

    @staticmethod
    def read_client_state(tag_dir: Path) -> dict[str, Any]:
        state_file = tag_dir / STATE_FILE
        return torch.load(state_file, weights_only=False)["client_state"] if state_file.is_file() else {}

    @staticmethod
    def read_full_state_dict(tag_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tag's weights: DCP's shards read into full tensors in this one process (no process group:
        `no_dist`), whatever world size wrote them. The shards hold the fp32 masters; each is cast after reading."""
        import warnings

        import torch.distributed.checkpoint as dcp

        dcp_dir = tag_dir / DCP_DIR
        metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
        # save() wrote {"model": ..., "optim": ...}; DCP flattens the keys to "model.<name>".
        wanted = {
            key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.items()
            if key.startswith("model.") and isinstance(meta, dcp.metadata.TensorStorageMetadata)
        }
        loaded = {"model": wanted}
        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming the intent is to load in a single process": it is.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(loaded, checkpoint_id=str(dcp_dir), no_dist=True)
        return {name: t.to(dtype) if t.is_floating_point() else t for name, t in loaded["model"].items()}

    @staticmethod
    def checkpoint_bytes_per_param(half_precision: bool) -> int:
        return CHECKPOINT_BYTES_PER_PARAM  # fp32 masters whatever the compute precision

    # --- the memory model (estimate_fsdp above, memory.py) ---

    estimate_memory = staticmethod(estimate_fsdp)

    @staticmethod
    def runs_schedule(implementation: str) -> str:
        # DeepSpeed's classes too are plain torch schedulers: this engine builds them over torch AdamW itself.
        return f"{implementation} over torch AdamW, stepped by the FSDP engine"

    @staticmethod
    def describe_layout(layout: ZeroLayout) -> str:
        # offload_optimizer is --fsdp_cpu_offload here, which moves all sharded state
        where = "sharded state offloaded to CPU" if layout.offload_optimizer else "no offload"
        return f"FSDP2, {where}, micro batch {layout.micro_batch_size}"

    @staticmethod
    def layout_flags(layout: ZeroLayout) -> list[str] | None:
        return ["--backend", "fsdp", *(["--fsdp_cpu_offload", "true"] if layout.offload_optimizer else [])]

    def close(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)
