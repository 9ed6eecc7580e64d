"""The engine seam, one small protocol per concern: `Engine`, a built engine (the trainer's step, this rank's state);
`ConfigRules`, what the resolver settles before building; `CheckpointFormat`, a tag's files read without an engine;
`MemoryModel`, the memory a layout takes. Each engine implements all four in one class (deepspeed_engine.py,
fsdp_engine.py): its instances are the Engine, the class itself the other three, so a built engine answers those too
(`type(engine).reshards_on_load`). The registry (engines/__init__.py) hands each caller the one it needs. The
crash-safe checkpoint protocol sits above (checkpoint/protocol.py): an engine only handles its own files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from model_utils.data.step_batches import Batch


class Run(Protocol):
    """What an engine reads of the run it is built from: resolve.resolver.ResolvedRun, which sits above engines/
    (`settings.train` is its resolve.train_settings.TrainSettings: optim, schedule, precision, fsdp_cpu_offload)."""

    settings: Any
    max_steps: int | None
    loads_schedule_state: bool  # False: a resume onto another --lr_schedule (load() leaves its state out)
    sequence_parallel: int  # ranks sharing each sequence (--sequence_parallel)

    def deepspeed_config(self) -> dict[str, Any]: ...


TRAIN, EVAL = "train", "eval"  # an objective's metrics: of the training steps, of validation


class Objective(Protocol):
    """What the loss of a micro-batch is: the next-token loss over its tokens (step_loss.TokenMean, the default) or
    a preference objective over its pairs (preference.Preference). Every engine computes its losses through one."""

    # The fingerprint of the weights the objective's reference log-probabilities are of (DPO: those the run starts
    # from; loop/observers/reference.py computes them); None: it has no reference.
    reference_weights: str | None

    def summed_loss(self, module: Any, batch: Batch, divisor: torch.Tensor) -> torch.Tensor:
        """The batch's losses (of its tokens, of its pairs) summed, over `divisor` (step_loss.loss_divisor)."""
        ...

    def eval_summed_loss(self, module: Any, batch: Batch) -> float:
        """The batch's losses summed, without gradients (validation divides by its loss units)."""
        ...

    def take(self, mode: str) -> list[float]:
        """This rank's sums of the objective's own metrics (TRAIN or EVAL) since the last call; summed over the
        ranks (one collective with the caller's own numbers), `means` makes them metrics. [] when it has none."""
        ...

    def means(self, sums: list[float]) -> dict[str, float]:
        """The metrics records show (their keys) from `take`'s sums over the ranks."""
        ...


class Engine(Protocol):
    """The training step (the trainer), this rank's state (the checkpoint protocol), and building."""

    module: torch.nn.Module  # the model being trained (for export and for counting parameters)
    title: ClassVar[str]  # the engine as the log names it ("DeepSpeed", "FSDP2")
    objective: Objective  # what its losses are (from_run's; step_loss.TokenMean by default)

    @staticmethod
    def runs_schedule(implementation: str) -> str:
        """How this engine runs the lr scheduler class `implementation` (ScheduleSpec.implementation), for the
        schedule's line in the log and `dskit config`."""
        ...

    @staticmethod
    def prepare_model(model: torch.nn.Module, run: Run, device: torch.device) -> torch.nn.Module:
        """The model as the engine trains it, before anything holds its parameters (the optimizer's groups are
        built from what this returns): FSDP shards it, DeepSpeed leaves it as it is."""
        ...

    @classmethod
    def from_run(
        cls,
        model: torch.nn.Module,
        run: Run,
        device: torch.device,
        param_groups: list[dict[str, Any]],
        objective: Objective | None = None,
    ) -> Engine:
        """The engine for the run (its optimizer and lr schedule), around the prepared model, training
        `param_groups` on `objective` (default: the next-token loss)."""
        ...

    def train_step(
        self,
        micro_batches: list[Batch],
        keep: Callable[[torch.Tensor], bool] | None = None,
        targets: int | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """Forward and backward over every micro-batch, then one optimizer step (and lr step). The gradients are
        those of the step's loss over its tokens (step_loss.py): the summed token losses of all targets of all its
        micro-batches on all ranks over the number of those targets. Returns this rank's share of that loss, as a
        detached device tensor (read it once: each read waits for the device), whose mean over the ranks is the
        step's loss; and whether the step was applied.

        `keep`, given this rank's share once every micro-batch's forward has run and before the update, decides
        whether the step happens: False discards it (no change to weights, optimizer state, lr schedule or
        optimizer_steps(); the data is consumed) and the engine trains on as if it never saw it.

        `targets`: the step's target count over all ranks when the caller's collective summed it already (the
        trainer's per-step collective carries the next step's: loop/consensus.py); None: counted here."""
        ...

    def eval_loss(self, batch: Batch) -> float:
        """The batch's losses summed over its loss units (batch.loss_units of them: tokens, or pairs)."""
        ...

    def sequence_logps(self, batch: Batch) -> torch.Tensor:
        """Each row's summed log-probabilities of its targets, without gradients, in the mode the engine is in
        (the reference pass of a preference objective: loop/observers/reference.py). Every rank calls it with the
        same number of batches: a sharded model's forward needs them all."""
        ...

    def generate(self, prompts: list[tuple[int, ...]], new_tokens: int) -> list[list[int]]:
        """The `new_tokens` token ids that greedily follow each prompt (generation.py), in eval mode. Every rank
        calls it with the same prompts: a sharded model's forward needs them all."""
        ...

    def train(self) -> None: ...

    def eval(self) -> None: ...

    def lr(self) -> float:
        """The lr the next optimizer step runs at."""
        ...

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step, if the engine computed one."""
        ...

    def optimizer_steps(self) -> int:
        """Optimizer steps applied (discarded ones are not steps), over the whole run."""
        ...

    def skipped_steps(self) -> int:
        """Optimizer steps the engine skipped (fp16 overflow), over the whole run."""
        ...

    def wall_clock_ms(self) -> dict[str, float]:
        """Milliseconds the last optimizer step spent per phase (forward, backward, optimizer step, ...) when
        the engine measures them (DeepSpeed: `wall_clock_breakdown`); empty when it does not."""
        ...

    def start_schedule_at(self, step: int) -> None:
        """Position the lr schedule for optimizer step `step + 1` (fresh starts and every resume)."""
        ...

    def save(self, tag_dir: Path, client_state: dict[str, Any]) -> None:
        """This rank's share of the model, optimizer and scheduler state, plus client_state, into tag_dir."""
        ...

    def after_failed_save(self) -> None:
        """On a rank whose save() raised: take part in the collectives the save still runs on the ranks whose
        writes went through, so that all ranks leave the save together (none waits in one forever)."""

    def load(self, tag_dir: Path, weights_only: bool, universal: bool = False) -> dict[str, Any] | None:
        """Restore from tag_dir (weights only: no optimizer or scheduler state); returns the client state,
        None when tag_dir holds no state this engine can read. `universal`: tag_dir was written by
        convert_universal (a checkpoint of another world size)."""
        ...

    def close(self) -> None:
        """Release the engine's hooks and buffers (another engine may be built in this process next)."""
        ...


class ConfigRules(Protocol):
    """What an engine makes of a DeepSpeed-format config, before anything is built (resolve/train_settings.py,
    config/deepspeed_file.py, the registry's jit_ops)."""

    # The DeepSpeed-format config the engine trains with when none is given, and the default's GPU-only sibling
    # that CUDA ranks pick where the memory estimate fits (None: the engine has none).
    default_config: ClassVar[str]
    gpu_only_config: ClassVar[str | None]
    # True: the model is built in fp32, its sharded parameters being the master weights (FSDP); False: in the
    # training precision, the engine keeping fp32 masters in its optimizer (DeepSpeed).
    model_in_fp32: ClassVar[bool]

    @staticmethod
    def check_config(ds: dict[str, Any], path: str) -> None:
        """Refuse, in one line, what a DeepSpeed-format config asks that this engine would silently not honour."""
        ...

    @staticmethod
    def discards_nonfinite_steps(ds: dict[str, Any], precision: str) -> bool:
        """Whether the engine throws a step with non-finite gradients away whole, under the checked config `ds`
        (the spike guard's skip relies on it)."""
        ...

    @staticmethod
    def jit_ops(ds: dict[str, Any], device_type: str) -> tuple[str, ...]:
        """The DeepSpeed op builders (class names, e.g. "CPUAdamBuilder") the engine JIT-loads when it trains
        under the checked config `ds` on ranks of `device_type` ("cpu", "cuda"); the registry's jit_ops adds the
        process group's."""
        ...


class CheckpointFormat(Protocol):
    """A checkpoint tag's files as this engine writes them, read without an engine."""

    # True: load() reads a checkpoint of any world size, optimizer state included (FSDP's DCP); False: one of
    # another world size is rewritten by convert_universal first (DeepSpeed).
    reshards_on_load: ClassVar[bool]

    @staticmethod
    def owns_tag(tag_dir: Path) -> bool:
        """Whether tag_dir holds a checkpoint this engine wrote (its own files are there)."""
        ...

    @staticmethod
    def writer_rank(rel: str) -> int | None:
        """The rank that wrote the tag's file `rel` (a path relative to the tag dir): one rank's own shard, hashed by
        that rank right after its write; None for the engine's other files (the protocol's main rank hashes those)."""
        ...

    @staticmethod
    def converted_tag(tag: str) -> str | None:
        """The name of `tag`'s copy made by convert_universal, beside it (never a tag's name: never a resume
        candidate); None for an engine that reshards on load and makes none."""
        ...

    @staticmethod
    def convert_universal(source: Path, output: Path) -> str:
        """Rewrite the checkpoint in `source` into `output` so that load(output, universal=True) restores it,
        optimizer and scheduler state included, at any world size. One process; returns its chatter. Called
        only for an engine that does not reshard on load."""
        ...

    @staticmethod
    def check_exportable(tag_dir: Path) -> None:
        """A ConfigError (one line) when the tag lacks what read_full_state_dict reads."""
        ...

    @staticmethod
    def read_client_state(tag_dir: Path) -> dict[str, Any]:
        """The client state `save` kept in the tag (dskit's train state), read in this one process without an
        engine or its weights (dskit eval: the run's tracker)."""
        ...

    @staticmethod
    def read_full_state_dict(tag_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tag's full (unsharded) weights in `dtype`, read in this one process with no process group, whatever
        world size wrote them (dskit export); a ConfigError when they cannot be read."""
        ...

    @staticmethod
    def checkpoint_bytes_per_param(half_precision: bool) -> int:
        """Bytes one parameter takes in a tag (weights, masters, optimizer state), for the doctor's disk check."""
        ...


class MemoryModel(Protocol):
    """GPU memory and host RAM of a run laid out for this engine: memory.py's types (`Any` here: memory.py imports the
    registry, which imports this module), a ModelShape in a ZeroLayout (naming its engine) taking a MemoryEstimate."""

    # True: the engine shards by ZeRO stage (0-3) with optimizer and parameter offload, as the layout says
    # (memory.check_zero); False: it shards everything, with one switch to offload it all.
    zero_stages: ClassVar[bool]

    @staticmethod
    def estimate_memory(m: Any, lay: Any) -> Any:
        """The memory a model of shape `m` takes trained in layout `lay` by this engine."""
        ...

    @staticmethod
    def describe_layout(layout: Any) -> str:
        """The layout in a few words for logs and `dskit estimate` (sharding, offload, micro batch)."""
        ...

    @staticmethod
    def layout_flags(layout: Any) -> list[str] | None:
        """The training flags that select the layout's sharding and offload (a shipped config, a switch), or None
        where the kit ships nothing that does: `dskit estimate` recommends only layouts these select."""
        ...
