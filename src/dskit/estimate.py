"""`dskit estimate`: per-GPU memory and per-node host RAM of a DeepSpeed ZeRO run, and a configuration that fits.

The memory model itself is model_utils/engines/memory.py with each engine's estimate, and a resolved run's layout
resolve/memory_estimate.py's (a training rank uses them to choose the default DeepSpeed config on CUDA); this
module renders it, judges it against a machine and recommends a layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from model_utils import engines
from model_utils.config.arguments import CHECKPOINTING_NONE, every_n_layers
from model_utils.engines import sequence_parallel
from model_utils.engines.memory import GiB, Line, MemoryEstimate, ModelShape, ZeroLayout, check_zero, estimate
from model_utils.errors import CommandParser, ConfigError
from model_utils.model import models
from model_utils.model.activation_checkpointing import checkpointed_layers
from model_utils.resolve import memory_estimate
from model_utils.resolve.memory_estimate import FIT_FRACTION, MAX_MICRO_BATCH, OFFLOADS, resolve_layout

# The memory estimate's names the doctor and tests/unit/model/test_lora.py reach through this module (its own
# tests import it: tests/unit/resolve/test_memory_estimate.py, tests/unit/engines/test_memory.py).
estimate_for_config = memory_estimate.estimate_for_config
model_shape = memory_estimate.model_shape
with_lora = memory_estimate.with_lora

# --- verdict and recommendation -------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    gpu_bytes: int | None
    gpu_source: str
    host_bytes: int | None
    host_source: str


@dataclass(frozen=True)
class InstanceMemory:
    gpu: str  # its GPU as torch names it (the peak for a forecast: observe.metrics.peak_tflops)
    gpu_mib: int  # one GPU's memory as nvidia-smi reports it (memory.total), as `dskit doctor` reads a node's
    host_gib: int  # the instance's RAM, as AWS lists it


# The GPU and host memory of the instance types whose GPU count the health gate's table holds (THRESHOLDS; the
# tests keep the two tables to the same types). From AWS's instance type pages and nvidia-smi on those GPUs.
INSTANCE_MEMORY: dict[str, InstanceMemory] = {
    "p4d.24xlarge": InstanceMemory("NVIDIA A100-SXM4-40GB", 40960, 1152),
    "p4de.24xlarge": InstanceMemory("NVIDIA A100-SXM4-80GB", 81920, 1152),
    "p5.48xlarge": InstanceMemory("NVIDIA H100 80GB HBM3", 81559, 2048),
    "p5e.48xlarge": InstanceMemory("NVIDIA H200", 143771, 2048),
    "p5en.48xlarge": InstanceMemory("NVIDIA H200", 143771, 2048),
    "g5.48xlarge": InstanceMemory("NVIDIA A10G", 23028, 768),
    "g6e.48xlarge": InstanceMemory("NVIDIA L40S", 46068, 1536),
}


@dataclass(frozen=True)
class Instance:
    """What an instance type gives a run: its GPUs (the health gate's count), their memory, its RAM."""

    name: str
    gpus: int
    gpu: str
    gpu_bytes: int
    host_bytes: int


def instance(instance_type: str | None) -> Instance | None:
    """The instance type, when the kit knows it."""
    from model_utils.launch.health_gate import THRESHOLDS

    memory = INSTANCE_MEMORY.get(instance_type or "")
    if instance_type is None or memory is None:
        return None
    gpus = THRESHOLDS[instance_type].gpus
    return Instance(instance_type, gpus, memory.gpu, memory.gpu_mib * 2**20, memory.host_gib * GiB)


def machine_capacity(
    gpu_memory_gib: float | None, host_memory_gib: float | None, instance_type: str | None = None
) -> Capacity:
    """The given sizes, else the instance type's (when one is given: never this machine's), else this machine's
    first GPU (torch.cuda) and its RAM (psutil)."""
    import psutil
    import torch

    known = instance(instance_type)
    unknown = f"no {instance_type} in the kit's instance table: pass"
    if gpu_memory_gib is not None:
        gpu, gpu_source = int(gpu_memory_gib * GiB), "--gpu_memory_gib"
    elif known is not None:
        gpu, gpu_source = known.gpu_bytes, f"{known.name}'s {known.gpu}"
    elif instance_type is not None:
        gpu, gpu_source = None, f"{unknown} --gpu_memory_gib"
    elif torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu, gpu_source = int(props.total_memory), f"this machine's {props.name}"
    else:
        gpu, gpu_source = None, "no GPU on this machine: pass --gpu_memory_gib"
    if host_memory_gib is not None:
        host, host_source = int(host_memory_gib * GiB), "--host_memory_gib"
    elif known is not None:
        host, host_source = known.host_bytes, known.name
    elif instance_type is not None:
        host, host_source = None, f"{unknown} --host_memory_gib"
    else:
        host, host_source = int(psutil.virtual_memory().total), "this machine"
    return Capacity(gpu, gpu_source, host, host_source)


def _status(used: int, capacity: int | None) -> str:
    if capacity is None:
        return "unknown"
    if used <= FIT_FRACTION * capacity:
        return "fits"
    return "tight" if used <= capacity else "does not fit"


def fits(est: MemoryEstimate, cap: Capacity) -> bool:
    """Both the GPU and the host within FIT_FRACTION of their capacity (an unknown host is not a limit)."""
    host_ok = cap.host_bytes is None or _status(est.host_bytes_per_node, cap.host_bytes) == "fits"
    return _status(est.device_bytes_per_rank, cap.gpu_bytes) == "fits" and host_ok


def verdict(est: MemoryEstimate, cap: Capacity) -> str:
    def part(what: str, used: int, capacity: int | None, source: str) -> tuple[str, str]:
        status = _status(used, capacity)
        if capacity is None:
            return status, f"{what} {used / GiB:.2f} GiB, {status} ({source})"
        pct = 100 * used / capacity
        return status, f"{what} {used / GiB:.2f} of {capacity / GiB:.2f} GiB ({pct:.0f}%, {source}) {status}"

    gpu_status, gpu_text = part("GPU", est.device_bytes_per_rank, cap.gpu_bytes, cap.gpu_source)
    host_status, host_text = part("host RAM", est.host_bytes_per_node, cap.host_bytes, cap.host_source)
    order = ("does not fit", "tight", "unknown", "fits")
    overall = min(gpu_status, host_status, key=order.index)
    if overall == "tight":
        overall = f"tight: above {FIT_FRACTION:.0%}, allocator fragmentation may still run out of memory"
    return f"verdict: {overall} — {gpu_text}; {host_text}"


@dataclass(frozen=True)
class Recommendation:
    estimate: MemoryEstimate | None  # None: nothing fits
    reason: str
    # The training flags that select it, to go with the run's own (model, data, ...): `train it with:`.
    flags: tuple[str, ...] = ()


# Activation checkpointing the recommendation tries, least recompute first (every_N: about 1/N of full's).
CHECKPOINTING_LEVELS = (CHECKPOINTING_NONE, "every_4", "every_2", "full")


def candidates(layout: ZeroLayout, num_layers: int) -> list[tuple[ZeroLayout, list[str]]]:
    """The layouts the recommendation tries on `layout`'s engine and cluster, fastest first, each with the training
    flags that select it (the engine's layout_flags: a layout nothing shipped selects is never tried). No offload
    before offload; within each, no checkpointing before checkpointing (least recompute first), then a lower stage
    before a higher.

    Checkpointing comes before offload: its recompute costs at most one more forward of the decoder (about a third
    more compute), while CPU offload runs Adam on the CPU every step and the GPU mostly waits (docs/speed.md).
    Stage 0 (plain data parallel) is left out: ZeRO-1 trains as fast with a fraction of the optimizer memory.
    FSDP2 has no stages, and no offload before offloading everything (--fsdp_cpu_offload).
    """
    engine = engines.memory_model(layout.backend)
    levels: list[str] = []
    for level in CHECKPOINTING_LEVELS:  # every_4 and every_2 of a 2-layer model are the same one layer
        if not levels or checkpointed_layers(num_layers, level) > checkpointed_layers(num_layers, levels[-1]):
            levels.append(level)
    offloads = OFFLOADS if engine.zero_stages else ("none", "optimizer")
    stages = (1, 2, 3) if engine.zero_stages else (0,)
    out = []
    for offload in offloads:
        for level in levels:
            for stage in stages:
                if offload == "optimizer+params" and stage != 3:
                    continue
                base = dataclasses.replace(
                    layout,
                    stage=stage,
                    offload_optimizer=offload != "none",
                    offload_params=offload == "optimizer+params",
                    activation_checkpointing=level,
                )
                flags = engine.layout_flags(base)
                if flags is not None:
                    out.append((base, flags))
    return out


def sequence_parallel_sizes(shape: ModelShape, layout: ZeroLayout) -> list[int]:
    """The --sequence_parallel sizes the recommendation tries, smallest first: from the layout's own, each that
    divides the ranks and that the model's heads and the sequence split into."""
    heads = SimpleNamespace(num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads)
    world, seq = layout.world_size, layout.seq_length
    if layout.pairs:  # preference pairs are not split across ranks (resolver._check_objective)
        return [layout.sequence_parallel]
    sizes = range(layout.sequence_parallel, world + 1)
    return [
        n
        for n in sizes
        if n == layout.sequence_parallel or sequence_parallel.cannot_split(n, heads, seq, world, "") is None
    ]


def recommend(shape: ModelShape, layout: ZeroLayout, cap: Capacity) -> Recommendation:
    """The fastest (offload, activation checkpointing, stage) that fits at micro batch 1, at its largest
    power-of-two micro batch; with the smallest --sequence_parallel (from the layout's) at which one fits."""
    if cap.gpu_bytes is None:
        return Recommendation(
            None,
            "pass --gpu_memory_gib (e.g. 80 for an H100) or --instance_type to get a configuration that fits",
        )
    for n in sequence_parallel_sizes(shape, layout):
        rec = _recommend_at(shape, dataclasses.replace(layout, sequence_parallel=n), cap)
        if rec.estimate is not None and n > 1:
            why = f"{rec.reason}; groups of {n} GPUs share each sequence: the fewest at which it fits"
            return Recommendation(rec.estimate, why, (*rec.flags, "--sequence_parallel", str(n)))
        if rec.estimate is not None:
            return rec
    return rec


def _recommend_at(shape: ModelShape, layout: ZeroLayout, cap: Capacity) -> Recommendation:
    assert cap.gpu_bytes is not None
    batches = [2**k for k in range(int(math.log2(MAX_MICRO_BATCH)) + 1)]
    nearest_faster: str | None = None  # why the layout just faster than the chosen one does not fit
    zero_stages = engines.memory_model(layout.backend).zero_stages
    for base, selection in candidates(layout, shape.num_layers):
        checkpointing = base.activation_checkpointing
        smallest = estimate(shape, dataclasses.replace(base, micro_batch_size=1))
        if not fits(smallest, cap):
            nearest_faster = _shortfall(smallest, cap)
            continue
        best = max(
            b for b in batches if fits(estimate(shape, dataclasses.replace(base, micro_batch_size=b)), cap)
        )
        chosen = estimate(shape, dataclasses.replace(base, micro_batch_size=best))
        why = (
            f"the fastest that fits ({nearest_faster})"
            if nearest_faster
            else "the fastest: nothing offloaded" + (", the lowest ZeRO stage" if zero_stages else "")
        )
        reason = (
            f"{why}; {best} is the largest micro batch (powers of two up to {MAX_MICRO_BATCH}) within "
            f"{FIT_FRACTION:.0%}: {chosen.device_bytes_per_rank / GiB:.2f} GiB per GPU, "
            f"{chosen.host_bytes_per_node / GiB:.2f} GiB host RAM per node"
        )
        if best != layout.micro_batch_size:
            reason += " (change --gradient_accumulation_steps to keep the global batch)"
        if checkpointing != CHECKPOINTING_NONE:
            without = estimate(
                shape, dataclasses.replace(smallest.layout, activation_checkpointing=CHECKPOINTING_NONE)
            )
            reason += (
                f"; activation checkpointing {checkpointing} is what makes it fit (without it "
                f"{_shortfall(without, cap)})"
            )
        flags = [*selection, "--micro_batch_size", str(best)]
        if checkpointing != CHECKPOINTING_NONE:
            flags += ["--activation_checkpointing", checkpointing]
        return Recommendation(chosen, reason, tuple(flags))
    slowest = estimate(
        shape,
        dataclasses.replace(
            layout,
            stage=3 if zero_stages else 0,
            offload_optimizer=True,
            offload_params=zero_stages,
            micro_batch_size=1,
            activation_checkpointing="full",
        ),
    )
    if _status(slowest.device_bytes_per_rank, cap.gpu_bytes) != "fits":
        fix = "use a shorter --seq_length or GPUs with more memory"
    else:
        fix = "use nodes with more RAM or fewer GPUs per node"
        if cap.host_source == "this machine":
            fix += " (or pass --host_memory_gib with the training nodes' RAM)"
    return Recommendation(None, f"nothing fits: even {_shortfall(slowest, cap)}; {fix}")


def _shortfall(est: MemoryEstimate, cap: Capacity) -> str:
    lay = est.layout
    name = f"ZeRO-{lay.stage} with {'no offload' if lay.offload == 'none' else lay.offload + ' offload'}"
    if every_n_layers(lay.activation_checkpointing) is not None:
        name += f" and activation checkpointing {lay.activation_checkpointing}"
    if lay.sequence_parallel > 1:
        name += f", sequence parallel {lay.sequence_parallel}"
    if _status(est.device_bytes_per_rank, cap.gpu_bytes) != "fits":
        assert cap.gpu_bytes is not None
        limit = FIT_FRACTION * cap.gpu_bytes / GiB
        return f"{name} needs {est.device_bytes_per_rank / GiB:.2f} GiB per GPU at micro batch 1, limit {limit:.2f}"
    assert cap.host_bytes is not None
    limit = FIT_FRACTION * cap.host_bytes / GiB
    return f"{name} needs {est.host_bytes_per_node / GiB:.2f} GiB host RAM per node, limit {limit:.2f}"


# --- the command ----------------------------------------------------------------------------------------


def _kernels(lay: ZeroLayout) -> str:
    if lay.liger:
        kernels = "Liger kernels" + (" (fused loss only) + torch.compile" if lay.compile else "")
    else:
        kernels = "torch.compile" if lay.compile else "eager (no Liger)"
    if every_n_layers(lay.activation_checkpointing) is not None:
        kernels += f", activation checkpointing {lay.activation_checkpointing}"
    return kernels


def render(est: MemoryEstimate) -> str:
    m, lay = est.model, est.layout
    precision = {2: "bf16", 4: "fp32"}[lay.dtype_bytes]
    header = [
        f"{m.name}: {m.total_params / 1e6:.2f}M parameters (largest layer {m.largest_layer_params / 1e6:.2f}M), "
        f"{m.num_layers} layers, vocab {m.vocab_size}"
        + (
            ""
            if m.trainable_params is None
            else f"; LoRA: {m.trainable_params / 1e6:.2f}M train (gradients and optimizer states), the rest frozen"
        ),
        f"{lay.nodes} node{'s' if lay.nodes > 1 else ''} x {lay.ranks_per_node} GPUs, {lay.describe()}"
        f"{' pairs x 2 sequences' if lay.pairs else ''} x {lay.seq_length} tokens"
        + (f" shared by {lay.sequence_parallel} GPUs" if lay.sequence_parallel > 1 else "")
        + f", {precision}, {_kernels(lay)}",
    ]

    width = max(len(line.label) for line in est.device_lines + est.host_lines) + 2

    def table(title: str, lines: tuple[Line, ...], total: int, total_how: str) -> list[str]:
        rows = [f"{title:<{width + 2}}{'GiB':>8}  how"]
        rows += [f"  {line.label:<{width}}{line.bytes / GiB:8.2f}  {line.how}" for line in lines]
        rows.append(f"  {'total':<{width}}{total / GiB:8.2f}  {total_how}")
        return rows

    device = table("per GPU", est.device_lines, est.device_bytes_per_rank, "sum")
    host = table(
        f"per node ({lay.ranks_per_node} ranks)",
        est.host_lines,
        est.host_bytes_per_node,
        "larger of build and offload, plus processes",
    )
    return "\n".join([*header, "", *device, "", *host])


def gpus_per_node(given: int | None, instance_type: str | None) -> int:
    """--gpus_per_node, else the instance type's GPUs, else this machine's, else 8."""
    import torch

    known = instance(instance_type)
    if given is not None:
        if known is not None and given > known.gpus:
            raise ConfigError(
                f"--gpus_per_node {given}: a {known.name} has {known.gpus} GPUs: give at most {known.gpus}, or "
                "leave it out (all of them)"
            )
        return given
    if known is not None:
        return known.gpus
    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def build_parser() -> argparse.ArgumentParser:
    from model_utils.config.arguments import BACKENDS, LIGER_CHOICES, DataArgs, ModelArgs, OptimArgs

    parser = CommandParser(
        prog="dskit estimate",
        description="Per-GPU memory and per-node host RAM of a DeepSpeed ZeRO training config, a verdict "
        "against this machine (or the given sizes) and the fastest configuration that fits.",
    )
    parser.add_argument(
        "--model",
        default=ModelArgs.model,
        help=f"preset, hub id or HF model dir (default: {ModelArgs.model})",
    )
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default: 1)")
    parser.add_argument(
        "--gpus_per_node",
        type=int,
        default=None,
        help="GPUs (ranks) per node (default: the --instance_type's, else this machine's, else 8)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=OptimArgs.backend,
        help="the training engine: deepspeed (ZeRO) or fsdp (FSDP2's memory model, docs/fsdp.md) "
        f"(default: {OptimArgs.backend})",
    )
    parser.add_argument(
        "--fsdp_cpu_offload",
        action="store_true",
        help="--backend fsdp: the sharded parameters, gradients and optimizer state in host RAM",
    )
    parser.add_argument(
        "--zero_stage", type=int, default=None, help="ZeRO stage 0-3 (default: the DeepSpeed config's)"
    )
    parser.add_argument(
        "--offload",
        choices=OFFLOADS,
        default=None,
        help="what ZeRO offloads to the CPU (default: the DeepSpeed config's)",
    )
    parser.add_argument(
        "--micro_batch_size",
        type=int,
        default=None,
        help=f"sequences per GPU per micro-batch (default: {OptimArgs.micro_batch_size}, or the DeepSpeed config's)",
    )
    parser.add_argument(
        "--seq_length",
        type=int,
        default=DataArgs.seq_length,
        help="tokens per sequence (default: the model's, at most 2048)",
    )
    parser.add_argument(
        "--liger",
        choices=LIGER_CHOICES,
        default=ModelArgs.liger,
        help=f"Liger kernels as training would use them; auto: on for model types Liger supports "
        f"(default: {ModelArgs.liger})",
    )
    parser.add_argument(
        "--activation_checkpointing",
        default=ModelArgs.activation_checkpointing,
        help="none, full or every_N (every N-th decoder layer), as training would use it; the recommendation "
        f"adds it when only that fits (default: {ModelArgs.activation_checkpointing})",
    )
    parser.add_argument(
        "--deepspeed_config",
        default=OptimArgs.deepspeed_config,
        help=f"DeepSpeed JSON config (default: {OptimArgs.deepspeed_config})",
    )
    from model_utils.config.arguments import OBJECTIVES, LoraArgs, ObjectiveArgs, field_help

    # LoRA as training would apply it: gradients and optimizer states for the adapters only.
    for name in ("lora_r", "lora_target_modules", "lora_modules_to_save"):
        parser.add_argument(f"--{name}", **field_help(LoraArgs, name))
    parser.add_argument("--sequence_parallel", **field_help(OptimArgs, "sequence_parallel"))
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default=ObjectiveArgs.objective,
        help="dpo or simpo: a micro batch of preference pairs, each two sequences in one forward, from their "
        f"logits (default: {ObjectiveArgs.objective})",
    )
    parser.add_argument(
        "--gpu_memory_gib",
        type=float,
        default=None,
        help="GPU memory to judge against (default: the --instance_type's GPU, else this machine's)",
    )
    parser.add_argument(
        "--host_memory_gib",
        type=float,
        default=None,
        help="host RAM per node to judge against (default: the --instance_type's, else this machine's)",
    )
    forecast = parser.add_argument_group("forecast: time and cost of a planned run (with --tokens)")
    forecast.add_argument("--tokens", type=float, help="tokens the run will train on, e.g. 2e10")
    forecast.add_argument(
        "--mfu",
        help="the model FLOPs utilisation to expect: a fraction (0.4), or a `dskit bench --json` / gpu-check "
        "JSON file, whose best dskit row's measured MFU (and device peak) is used",
    )
    forecast.add_argument(
        "--peak_tflops", type=float, help="the GPU's dense bf16 peak TFLOP/s (default: the bench file's)"
    )
    parser.add_argument(
        "--instance_type",
        help="the nodes' instance type (e.g. p5.48xlarge): their GPUs, GPU memory and RAM for the verdict, the "
        "GPU's peak and the price for the forecast",
    )
    forecast.add_argument(
        "--price_per_hour", type=float, help="one node's price per hour (default: the table's)"
    )
    forecast.add_argument("--market", choices=("on-demand", "spot"), default="on-demand")
    return parser


@dataclass(frozen=True)
class Forecast:
    hours: float  # training time alone: no start-up, checkpoints or validation (dskit cost shows their share)
    node_hours: float
    tokens_per_s: float
    mfu: float
    peak_tflops: float
    cost: float | None
    price_what: str | None


def _measured_mfu(path: Path) -> tuple[float, float | None]:
    """The best measured MFU of a bench (or gpu-check) JSON's dskit rows, and the peak it was measured against."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--mfu {path}: cannot read it as a bench JSON ({e}): give a fraction or a bench file"
        ) from None
    bench = data.get("bench", data)  # gpu-check keeps the bench's JSON under "bench"
    measured = [r["mfu"] for r in bench.get("rows", []) if r.get("kind") == "dskit" and r.get("mfu")]
    if not measured:
        raise ConfigError(
            f"--mfu {path}: no dskit row with a measured MFU (a CPU bench, or an unknown GPU peak): pass a fraction"
        )
    return max(measured), bench.get("peak_tflops")


def forecast(
    flops_per_token: float, tokens: float, gpus: int, nodes: int, mfu: float, peak_tflops: float, price: Any
) -> Forecast:
    """Training time from the FLOPs the tokens need at the expected MFU; money from node-hours x price."""
    tokens_per_s = gpus * mfu * peak_tflops * 1e12 / flops_per_token
    hours = tokens / tokens_per_s / 3600
    cost = None if price is None else hours * nodes * price.per_hour
    return Forecast(
        hours, hours * nodes, tokens_per_s, mfu, peak_tflops, cost, None if price is None else price.what
    )


@dataclass(frozen=True)
class ForecastInputs:
    tokens: float
    mfu: float
    peak_tflops: float
    price: Any  # dskit.cost.Price | None


def forecast_inputs(ns: argparse.Namespace) -> ForecastInputs | None:
    """The forecast's flags, checked before any model is loaded; None without --tokens and --mfu."""
    from dskit import cost

    if ns.tokens is None and ns.mfu is None:
        return None
    if ns.tokens is None or not ns.tokens > 0:
        raise ConfigError("--tokens must be a positive number of training tokens, e.g. 2e10")
    if ns.mfu is None:
        raise ConfigError(
            "a forecast needs --mfu: a fraction such as 0.4, or a `dskit bench --json` file of this model"
        )
    peak = ns.peak_tflops
    try:
        mfu = float(ns.mfu)
    except ValueError:
        mfu, measured_peak = _measured_mfu(Path(ns.mfu))
        peak = peak or measured_peak
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {ns.mfu} must be a fraction in (0, 1], e.g. 0.4 for 40%")
    known = instance(ns.instance_type)
    if peak is None and known is not None:
        from model_utils.observe import metrics

        peak = metrics.peak_tflops(known.gpu)
    if peak is None or not peak > 0:
        raise ConfigError(
            "a forecast needs the GPU's peak: --peak_tflops (e.g. 989 for an H100 SXM), or an --instance_type "
            "whose GPU's peak the kit knows"
        )
    if ns.price_per_hour is not None and ns.price_per_hour < 0:
        raise ConfigError("--price_per_hour must be 0 or more")
    price = cost.price_for(ns.instance_type, ns.market, cost.load_prices(cost.PRICES), ns.price_per_hour)
    return ForecastInputs(ns.tokens, mfu, peak, price)


def forecast_line(inputs: ForecastInputs, settings: Any, nodes: int, ranks: int) -> str:

    seq = settings.config.data.seq_length or 2048
    per_token = models.flops_per_token(settings.model_config, seq, settings.config.lora)
    f = forecast(per_token, inputs.tokens, nodes * ranks, nodes, inputs.mfu, inputs.peak_tflops, inputs.price)
    money = (
        f" = ${f.cost:,.0f} at ${inputs.price.per_hour:g}/h ({f.price_what})"
        if inputs.price is not None
        else " (no price: pass --instance_type or --price_per_hour)"
    )
    return (
        f"forecast: {inputs.tokens:.3g} tokens at MFU {inputs.mfu:.1%} of {inputs.peak_tflops:g} TFLOP/s x "
        f"{nodes * ranks} GPUs ({f.tokens_per_s:,.0f} tokens/s): {f.hours:.1f} h of training, "
        f"{f.node_hours:.1f} node-hours{money}; start-up, checkpoints, validation and restarts come on top "
        "(dskit cost of a past run shows their share)"
    )


def main(argv: list[str]) -> int:
    from model_utils.config.arguments import (
        DataArgs,
        LoraArgs,
        ModelArgs,
        ObjectiveArgs,
        OptimArgs,
        TrainConfig,
    )

    ns = build_parser().parse_args(argv)
    planned = forecast_inputs(ns)  # its bad input fails before the model loads
    from model_utils.resolve import resolver  # torch: after parsing, so --help stays instant

    for flag in ("gpu_memory_gib", "host_memory_gib"):
        value = getattr(ns, flag)
        if value is not None and not value > 0:
            raise ConfigError(f"--{flag} {value} must be positive, e.g. 80")
    if ns.nodes < 1:
        raise ConfigError(f"--nodes {ns.nodes} must be at least 1")
    if ns.gpus_per_node is not None and ns.gpus_per_node < 1:
        raise ConfigError(f"--gpus_per_node {ns.gpus_per_node} must be at least 1")
    if ns.zero_stage is not None:  # fail before loading the model; stages from the file are checked later
        offload = ns.offload or "none"
        check_zero(ns.zero_stage, offload != "none", offload == "optimizer+params")
    if not engines.memory_model(ns.backend).zero_stages and (
        ns.zero_stage is not None or ns.offload is not None
    ):
        flag = "--zero_stage" if ns.zero_stage is not None else "--offload"
        raise ConfigError(
            f"{flag} is DeepSpeed's ZeRO: under --backend {ns.backend} use --fsdp_cpu_offload, or drop it"
        )
    ranks = gpus_per_node(ns.gpus_per_node, ns.instance_type)
    explicit = {"micro_batch_size"} if ns.micro_batch_size is not None else set()
    optim: dict[str, Any] = {"deepspeed_config": ns.deepspeed_config, "backend": ns.backend}
    if ns.deepspeed_config != OptimArgs.deepspeed_config:
        explicit.add("deepspeed_config")  # under fsdp the default is its own config (deepspeed/fsdp.json)
    if ns.fsdp_cpu_offload:
        optim["fsdp_cpu_offload"] = True
        explicit.add("fsdp_cpu_offload")
    if ns.micro_batch_size is not None:
        optim["micro_batch_size"] = ns.micro_batch_size
    if ns.sequence_parallel is not None:
        optim["sequence_parallel"] = ns.sequence_parallel
        explicit.add("sequence_parallel")
    cfg = TrainConfig(
        model=ModelArgs(model=ns.model, liger=ns.liger, activation_checkpointing=ns.activation_checkpointing),
        data=DataArgs(seq_length=ns.seq_length),
        optim=OptimArgs(**optim),
        lora=LoraArgs(
            **{
                name: getattr(ns, name)
                for name in ("lora_r", "lora_target_modules", "lora_modules_to_save")
                if getattr(ns, name) is not None
            }
        ),
        objective=ObjectiveArgs(objective=ns.objective),
        # A flag given explicitly must agree with an explicit key in the DeepSpeed config, as in training.
        explicit=frozenset(explicit),
    )
    settings = resolver.resolve_settings(cfg)
    sequence_parallel.check(cfg, settings.model_config, settings.seq_length, ns.nodes * ranks)
    shape, layout = resolve_layout(settings, ns.nodes, ranks, ns.zero_stage, ns.offload)
    est = estimate(shape, layout)
    cap = machine_capacity(ns.gpu_memory_gib, ns.host_memory_gib, ns.instance_type)
    rec = recommend(shape, layout, cap)
    print(render(est))
    print()
    print(verdict(est, cap))
    if rec.estimate is None:
        print(f"recommend: {rec.reason}")
    else:
        print(f"recommend: {rec.estimate.layout.describe_recommended()} — {rec.reason}")
        print(f"train it with: {shlex.join(rec.flags)}")
    if planned is not None:
        print(forecast_line(planned, settings, ns.nodes, ranks))
    return 0
