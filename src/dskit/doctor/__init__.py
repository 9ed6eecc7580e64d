"""`dskit doctor [TRAINING FLAGS...]`: is this node ready for this run? A pass/warn/fail table, each with a fix.

It takes the training flags (to know the model, data, checkpoint dir and DeepSpeed config) and the launch context
the launchers export (GPUS_PER_NODE, CPU_RANKS, CUDA_VERSION, EFA, SLURM_JOB_NUM_NODES, TORCH_EXTENSIONS_DIR;
defaults from `render.LaunchValues`). Exit status: 1 when a check FAILs, 0 otherwise (WARN does not stop a
launch), 2 for bad flags. It is quick and changes nothing: no op is built, no dataset is loaded in full, no
weights are loaded (parameters are counted on the meta device).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

from model_utils.config.arguments import TrainConfig, parse_args
from model_utils.errors import ConfigError, ModelUnavailable, first_line
from model_utils.observe.ledger_file import instance_type

from .context import GpuProbe, LaunchContext, probe_gpus, ranks_per_node
from .cuda import check_driver, check_gpus, check_toolkit, driver_verdict
from .dataset import check_dataset
from .environment import check_ops, check_uv
from .memory import check_memory
from .network import check_health_gate, check_network, efa_devices, nccl_net_plugins
from .report import Result, Status, _guarded, format_table, summary
from .storage import check_disk

__all__ = [
    "USAGE",
    "GpuProbe",
    "LaunchContext",
    "Result",
    "Status",
    "check_dataset",
    "check_disk",
    "check_driver",
    "check_gpus",
    "check_health_gate",
    "check_memory",
    "check_network",
    "check_ops",
    "check_toolkit",
    "check_uv",
    "diagnose",
    "driver_verdict",
    "efa_devices",
    "format_table",
    "main",
    "nccl_net_plugins",
    "probe_gpus",
    "ranks_per_node",
    "report",
    "run_checks",
    "summary",
]

USAGE = """\
usage: dskit doctor [TRAINING FLAGS...]

Check this node for a training run and print a table: check, PASS/WARN/FAIL/SKIP, what was found, the fix.
The flags are the training flags (see `dskit config --help`). The launch context comes from the environment:
GPUS_PER_NODE, CPU_RANKS, CUDA_VERSION, EFA (auto|on|off), SLURM_JOB_NUM_NODES, TORCH_EXTENSIONS_DIR.
Exit status 1 when any check FAILs, 0 otherwise, 2 for bad flags."""


def run_checks(cfg: TrainConfig, ctx: LaunchContext) -> list[Result]:
    return diagnose(cfg, ctx)[0]


def diagnose(cfg: TrainConfig, ctx: LaunchContext) -> tuple[list[Result], Any]:
    """The check results, and the run's settings (preflight.RunSettings) when the model could be loaded: `dskit
    preflight` hands them on to prepare, so they are resolved once."""
    import torch

    from model_utils.resolve import resolver, train_settings

    gpus = probe_gpus()
    _, on_gpus = ranks_per_node(ctx, gpus)
    settings: resolver.RunSettings | None = None
    model_error = ""
    try:  # a hub model needs the network or the HF cache: `dskit prepare` reports that in full
        settings = resolver.resolve_settings(cfg)  # a misspelt --model or a bad DeepSpeed config: exit 2
        half = settings.train.half_precision
    except ModelUnavailable as e:
        model_error = str(e)
        half = train_settings.resolve(cfg).half_precision
    n_params: int | None = None
    if settings is not None:
        try:
            from dskit.estimate import model_shape

            # Counted as `dskit estimate` counts them (meta device, tied parameters once).
            source = settings.source
            n_params = model_shape(
                settings.model_config,
                source.name,
                source.preset is not None,
                cache_dir=Path(cfg.data.data_cache_dir),
            ).total_params
        except Exception as e:  # an architecture transformers cannot build: prepare reports it properly
            model_error = f"{type(e).__name__}: {first_line(e)}"

    # A mixture's sources each as a dataset of its own (--sources); else --dataset.
    datasets = [(f"dataset {s.name}", cfg.data.for_source(s)) for s in cfg.data.source_specs]
    datasets = datasets or [("dataset", cfg.data)]
    results = [
        _guarded("uv environment", check_uv),
        _guarded("torch CUDA vs driver", lambda: check_driver(gpus, torch.version.cuda, torch.__version__)),
        _guarded("CUDA toolkit", lambda: check_toolkit(ctx, gpus, torch.version.cuda)),
        _guarded("GPUs", lambda: check_gpus(ctx, gpus)),
        _guarded("network (EFA)", lambda: check_network(ctx, on_gpus)),
        _guarded("health gate", lambda: check_health_gate(cfg, ctx, on_gpus, instance_type())),
        _guarded("checkpoint disk", lambda: check_disk(cfg, n_params, half)),
        *(
            dataclasses.replace(_guarded(name, lambda data=data: check_dataset(data)), check=name)
            for name, data in datasets
        ),
        _guarded("DeepSpeed ops", lambda: check_ops(ctx, run_jit_ops(cfg, settings, ctx, gpus))),
    ]
    if settings is not None and cfg.optim.sequence_parallel > 1:
        results.append(_guarded("sequence parallel", lambda: check_sequence_parallel(settings, ctx, gpus)))
    if settings is None:
        results.append(
            Result(
                "host RAM", Status.WARN, f"no estimate: {model_error}", "`dskit prepare` reports the details"
            )
        )
    else:
        try:
            results += check_memory(settings, ctx, gpus)
        except ConfigError:
            raise
        except Exception as e:
            results.append(
                Result("host RAM", Status.WARN, f"no estimate: {type(e).__name__}: {first_line(e)}", "")
            )
    return results, settings


def check_sequence_parallel(settings: Any, ctx: LaunchContext, gpus: GpuProbe) -> Result:
    """--sequence_parallel against the ranks this launch starts, the model's heads and the sequence length."""
    from model_utils.engines.sequence_parallel import cannot_split

    cfg, name = settings.config, "sequence parallel"
    n, ranks = cfg.optim.sequence_parallel, ranks_per_node(ctx, gpus)[0] * ctx.nodes
    why = cannot_split(
        n, settings.model_config, settings.seq_length, ranks, f"{cfg.setting('sequence_parallel')} {n}"
    )
    if why is not None:
        found, _, fix = why.rpartition(": ")
        return Result(name, Status.FAIL, found, fix)
    return Result(name, Status.PASS, f"{ranks // n} group(s) of {n} of the {ranks} ranks share each sequence")


def run_jit_ops(cfg: TrainConfig, settings: Any, ctx: LaunchContext, gpus: GpuProbe) -> tuple[str, ...]:
    """The DeepSpeed ops the ranks of this run will JIT-load (engines.jit_ops), for the config they will train
    with: on GPUs with the kit's default config, the one the memory estimate picks there, as the ranks do."""
    from model_utils import engines
    from model_utils.resolve import resolver, train_settings

    ranks, on_gpus = ranks_per_node(ctx, gpus)
    if settings is not None and on_gpus and gpus.memory_bytes and train_settings.default_in_use(cfg):
        settings = resolver.choose_default_config(settings, gpus.memory_bytes, ranks * ctx.nodes)
    ts = settings.train if settings is not None else train_settings.resolve(cfg)
    # The micro batch and the step count do not change which optimizer runs.
    ds = ts.deepspeed_json(ts.micro_batch_size if isinstance(ts.micro_batch_size, int) else 1, 1)
    return engines.jit_ops(ts.backend, ds, "cuda" if on_gpus else "cpu")


def report(results: list[Result], ctx: LaunchContext) -> int:
    """Print the table and the summary; the exit status (1 when a check FAILs)."""
    print(
        f"dskit doctor on {socket.gethostname()} ({ctx.nodes} node{'s' if ctx.nodes > 1 else ''}):",
        flush=True,
    )
    print(format_table(results))
    print(summary(results), flush=True)
    return 1 if any(r.status is Status.FAIL for r in results) else 0


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    ctx = LaunchContext.from_env(os.environ)
    return report(run_checks(parse_args(argv), ctx), ctx)
