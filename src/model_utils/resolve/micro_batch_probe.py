"""`--micro_batch_size auto`: the largest micro batch that fits the GPU, probed once and cached.

The probe runs forward and backward of the model as it will train (training dtype, Liger when it is on) at
micro batch 1, 2, 4, ... and stops at the first that runs out of memory. During each try it holds a ballast
allocation of what DeepSpeed keeps on the GPU beside the model: the fp32 optimizer states and gradient
partition unless they are offloaded, and ZeRO's communication buckets. A size fits when it finishes with the
allocator's peak under HEADROOM of the GPU's memory (fragmentation, NCCL's buffers). The model runs eagerly: a
compilation per candidate would take minutes, and compiled training keeps no more activations than eager.

The result is cached in <data_cache_dir>/micro_batch_size.json, keyed by model architecture, GPU model and
memory, sequence length, kernels and the ballast, so later runs (and every node sharing the cache) skip the
probe. It resolves in preflight on the training ranks (rank 0 probes, every rank gets the answer) before the
DeepSpeed config is filled in; `dskit config` and `dskit prepare` leave it at "auto". Without a GPU it is 1.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from model_utils.compat import liger_internals
from model_utils.config.arguments import CHECKPOINTING_NONE
from model_utils.errors import ConfigError
from model_utils.launch import startup
from model_utils.model import activation_checkpointing, kernels
from model_utils.observe.log import print0

if TYPE_CHECKING:
    from model_utils.resolve.run_settings import RunSettings

HEADROOM = 0.9  # a candidate must peak under this fraction of the GPU's memory
MAX_MICRO_BATCH = 256  # the probe stops here even when more would fit
CACHE_FILE = "micro_batch_size.json"
# DeepSpeed's defaults when a config leaves them out (elements, not bytes).
DEFAULT_BUCKET = 500_000_000


def search_micro_batch(fits: Callable[[int], bool], max_size: int = MAX_MICRO_BATCH) -> int | None:
    """The largest power of two <= max_size for which fits() holds, trying 1, 2, 4, ... up to the first
    failure (memory grows with the batch, so nothing larger can fit); None when 1 does not fit."""
    best = None
    size = 1
    while size <= max_size and fits(size):
        best = size
        size *= 2
    return best


class ProbeCache:
    """A JSON object of probe key -> result, replaced atomically so concurrent runs never read a torn file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}  # missing or damaged: probe again
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> int | None:
        entry = self._read().get(key)
        value = entry.get("micro_batch_size") if isinstance(entry, dict) else None
        return value if isinstance(value, int) and value >= 1 else None

    def put(self, key: str, micro_batch_size: int, detail: dict[str, Any]) -> None:
        data = self._read()
        data[key] = {"micro_batch_size": micro_batch_size, **detail}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".micro_batch_size.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, self.path)


def cached_search(
    cache: ProbeCache, key: str, fits: Callable[[int], bool], detail: dict[str, Any], what: str
) -> tuple[int, bool]:
    """(micro batch, whether it came from the cache); a size of 1 that does not fit is a ConfigError."""
    cached = cache.get(key)
    if cached is not None:
        return cached, True
    found = search_micro_batch(fits)
    if found is None:
        raise ConfigError(
            f"--micro_batch_size auto: even micro batch 1 does not fit {what}: use a smaller --seq_length, "
            "a config that offloads the optimizer (deepspeed/ds_config.json) or ZeRO-3"
        )
    cache.put(key, found, detail)
    return found, False


def gpu_reserve_bytes(ds_config: dict[str, Any], n_params: int, world_size: int) -> int:
    """What DeepSpeed keeps on each GPU beyond the bf16 weights and gradients the probe itself holds."""
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
    shards = world_size if stage >= 1 else 1
    # fp32 master weights, Adam's two moments and the fp32 gradient partition: 16 bytes a parameter.
    optimizer = 0 if offload else 16 * n_params // shards
    buckets = 0
    if stage >= 1:
        elements = int(zero.get("reduce_bucket_size", DEFAULT_BUCKET)) + int(
            zero.get("allgather_bucket_size", DEFAULT_BUCKET)
        )
        # DeepSpeed's documentation: overlap_comm keeps 4.5x the bucket sizes (in 2-byte elements).
        overlap = zero.get("overlap_comm", stage == 3)
        buckets = int(2 * elements * (4.5 if overlap else 1.0))
    return optimizer + buckets


def _architecture_hash(model_config: Any) -> str:
    d = model_config.to_dict()
    d.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


class _GpuProbe:
    """fits(batch) for search_micro_batch: builds the model on the GPU on first use (a cache hit never does).
    Used as a context: inside it the older objects are frozen (each probe's gc.collect() walks the probe's own
    objects only: launch/startup.py), and its end frees the probe's GPU memory (`close`)."""

    def __init__(
        self,
        model_config: Any,
        dtype: torch.dtype,
        chosen: kernels.Plan,
        seq_length: int,
        reserve: int,
        checkpointing: str = CHECKPOINTING_NONE,
    ) -> None:
        self.model_config, self.dtype, self.chosen = model_config, dtype, chosen
        self.checkpointing = checkpointing  # --activation_checkpointing, as training will use it
        self.seq_length, self.reserve = seq_length, reserve
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.limit = int(HEADROOM * torch.cuda.get_device_properties(self.device).total_memory)
        self.model: Any = None

    def _build(self) -> Any:
        from transformers import AutoModelForCausalLM

        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(
                self.model_config, attn_implementation="sdpa", dtype=self.dtype
            )
        model.train()
        activation_checkpointing.apply(model, self.checkpointing, announce=False)
        return kernels.apply_plan(model, self.chosen, compile_model=False)  # the kernels training will use

    def __call__(self, batch: int) -> bool:
        if self.model is None:
            self.model = self._build()
        out_of_memory, peak = False, 0
        ballast: torch.Tensor | None = None
        try:
            ballast = torch.empty(self.reserve, dtype=torch.uint8, device=self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            ids = torch.randint(0, self.model_config.vocab_size, (batch, self.seq_length), device=self.device)
            self.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_reserved(self.device)
        except torch.OutOfMemoryError:
            out_of_memory = True
        del ballast  # before empty_cache, also after an out-of-memory error
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return not out_of_memory and peak <= self.limit

    def close(self) -> None:
        self.model = None  # frees the probe's GPU memory before the real model is built
        gc.collect()
        torch.cuda.empty_cache()

    def __enter__(self) -> _GpuProbe:
        self._context = contextlib.ExitStack()
        self._context.enter_context(startup.older_objects_frozen())  # before the probe makes any object
        self._context.callback(self.close)  # first on the way out: its collection of the probe's objects too
        return self

    def __exit__(self, *exc: object) -> None:
        self._context.close()


def resolve(settings: RunSettings, n_train_blocks: int, n_val_blocks: int | None, world_size: int) -> int:
    """The micro batch for --micro_batch_size auto on this process's CUDA GPU (rank 0 of the run; CPU ranks take 1
    without a probe: resolver._micro_batch)."""
    from transformers import AutoModelForCausalLM

    cfg, model_config, ts = settings.config, settings.model_config, settings.train
    device = torch.device("cuda", torch.cuda.current_device())
    ds_config = ts.deepspeed_json(micro_batch_size=1, total_steps=1)  # the bucket sizes, for the reserve
    seq_length = settings.seq_length
    chosen = kernels.plan(cfg.model, model_config.model_type, device)
    with torch.device("meta"):  # shapes only: the parameter count, and the class Liger would patch
        skeleton = AutoModelForCausalLM.from_config(model_config)
    reserve = gpu_reserve_bytes(ds_config, sum(p.numel() for p in skeleton.parameters()), world_size)
    props = torch.cuda.get_device_properties(device)
    gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    key = (
        f"{cfg.model.model}|{_architecture_hash(model_config)}|{gpu}|seq {seq_length}|"
        f"{chosen.describe()}|reserve {reserve // 2**20} MiB"
    )
    checkpointing = cfg.model.activation_checkpointing
    if checkpointing != CHECKPOINTING_NONE:  # keys of runs without it stay as they were
        key += f"|activation checkpointing {checkpointing}"
    cache = ProbeCache(Path(cfg.data.data_cache_dir) / CACHE_FILE)
    with (
        _GpuProbe(model_config, ts.torch_dtype(), chosen, seq_length, reserve, checkpointing) as probe,
        liger_internals.patches_undone(skeleton),
    ):
        found, from_cache = cached_search(
            cache,
            key,
            probe,
            {"model": cfg.model.model, "gpu": gpu, "seq_length": seq_length},
            f"{gpu} at --seq_length {seq_length}",
        )
    # Never more than the data holds: one global batch must fit in the train (and validation) blocks.
    cap = n_train_blocks // (ts.gradient_accumulation_steps * world_size)
    if n_val_blocks is not None:
        cap = min(cap, n_val_blocks // world_size)
    micro_batch = max(1, min(found, cap))
    source = f"cached in {cache.path}" if from_cache else f"probed, cached in {cache.path}"
    capped = f"; capped at {micro_batch} by the data" if micro_batch < found else ""
    print0(f"--micro_batch_size auto: {micro_batch} on {gpu} at seq {seq_length} ({source}{capped})")
    return micro_batch
