"""Importing and initialising DeepSpeed without the start-up work a dskit run never uses.

Every rank pays DeepSpeed's start-up before its first step, and the launchers' preflight pays the import once
more. Two parts of it are work for features dskit does not use, measured on a 2-core CPU machine:
- `import deepspeed` imports MLflow (~2 s) because DeepSpeed's autotuner logs to it when installed. dskit
  never runs that autotuner, and its own tracker (trackers.py) imports MLflow itself when asked to.
- `deepspeed.initialize` with the CPU-offload optimizer calls py-cpuinfo's `get_cpu_info()` three times (the
  Adam op and its builder's arch and SIMD checks); each call starts a Python subprocess (~1.2 s). The answer
  cannot change within a process, so it is computed once; nor until the host reboots, so the engine keeps it
  beside the ops built for this CPU, one file per boot, and only the first rank of a host probes (95 probes took
  83 CPU-s of one `make test` here).

- `deepspeed.initialize` (and every ZeRO-1/2 gradient reduction) imports DeepSpeed's Muon optimizer even when
  it is not the optimizer. Its module decorates three functions with `torch.compile` at import time, which
  imports torch's dynamo and inductor (~3 s per rank here, and jinja2 with them). `import_deepspeed` imports
  that module once with those decorators made lazy: each function compiles on its first call, so Muon, when
  it is used, still runs compiled.
- Importing transformers imports jinja2 (chat templates, which a training rank never renders) and, through
  accelerate (which transformers' DeepSpeed integration imports), boto3 for accelerate's SageMaker config
  command. `import_transformers` holds both back on the first import; dskit's S3 tier imports boto3 itself
  when it is used. It also answers transformers' `is_scipy_available()` (cached) while scipy is held back:
  transformers imports scipy (321 modules, ~0.3 CPU-s of a rank's ~5) for the Hungarian matching of object
  detection losses and for vision and audio processors, never for a causal LM.

It also keeps lines out of every rank's log that tell a dskit user nothing they can act on, each matched
exactly (by logger and message, or by the whole printed line), so that every other warning still shows:
- transformers' progress bars ("Loading weights" when a rank loads a pretrained model, e.g. for LoRA;
  "Writing model shards" in `dskit export`): `transformers_bars_off`; the kit's own bar says how far a run is.
- DeepSpeed's zero_to_fp32 prints ("Processing zero checkpoint", shapes, counts) and progress bars while
  `dskit export` consolidates a ZeRO tag: `zero_to_fp32_quiet`; its errors still raise.
- torch.utils.cpp_extension's "No CUDA runtime is found, using CUDA_HOME=..." when a CPU run's ops are loaded
  on a machine with a CUDA toolkit but no GPU (the launcher says the ranks are on the CPU; `dskit doctor`
  checks torch against the GPUs and the driver).
- DeepSpeed's "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", printed by each CPU
  rank when its process group starts (`dskit doctor` reports the ops; a failed build still raises).
- DeepSpeed's "Attempting to get learning rate from scheduler before it has started", which its warm-up
  schedulers log while they are constructed in `deepspeed.initialize`; the trainer sets the schedule's
  iteration before the first step. And their "total_num_steps 1 is less than warmup_num_steps 1" in a 1-step
  run: they warm up over 2 steps at least, the kit's warm-up never outlasts the run (and the kit's own line
  says when it shortened it).
- DeepSpeed's "OVERFLOW! Skipping step" while the engine discards a step the spike guard rejected on purpose
  (the guard's own line says why); a real overflow is still logged.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import io
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

NO_CUDA_RUNTIME = re.compile(r"No CUDA runtime is found, using CUDA_HOME=.*")
OP_BUILT = re.compile(r"DeepSpeed [\w.]+ built successfully")
LR_BEFORE_START = re.compile(
    re.escape("Attempting to get learning rate from scheduler before it has started")
)
# DeepSpeed's warm-up schedulers warm up over at least 2 steps and say so for a 1-step run ("total_num_steps 1 is
# less than warmup_num_steps 1"); the kit's warm-up never outlasts the run, and the kit says when it shortens it.
ONE_STEP_WARMUP = re.compile(r"total_num_steps [01] is less than warmup_num_steps \d+")
OVERFLOW_SKIP = re.compile(r"\[deepspeed\] OVERFLOW! .*")


class DropMessages(logging.Filter):
    """A logger filter that drops the records whose whole message matches `pattern`."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.fullmatch(record.getMessage()) is None


def fewer_full_collections() -> None:
    """CPython's collector walks every object at a full collection. A kit process's imports (torch,
    transformers, DeepSpeed) make about 400,000 that live to its end, and as many that die young: 6 full
    collections during the imports alone, 0.65 of their 4 CPU-s. A full collection a hundredth as often (the
    young generations as before, which collect most cycles): about none during the imports, and rarely after.
    Called first by every entry point (a rank, `dskit`, the SageMaker entry)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


FULL_COLLECTION_EVERY = 1000  # collections of the middle generation (CPython's default: 10)


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """What the process holds by now (the imports' objects: hundreds of thousands) kept out of the cyclic
    collector for a while, which otherwise walks all of it at each full collection: a data unit's tokenizing
    (up to a sixth of a conversation preparation's time), the micro-batch probe's searches (a gc.collect() after
    each probe: 0.2 s each in a bare process, about 1 s in the test suite's). Given back after, so that the
    collection at the process's exit sees it all (extension modules check). Where something froze objects
    before (a forking server), they stay as they were."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, on the CPU accelerator when there is no GPU, without importing MLflow.

    Call it before any other import of deepspeed: the first import decides.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    import torch

    if not torch.cuda.is_available():
        # DeepSpeed would pick the CPU anyway, but print a warning on stdout of every rank first.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Logged when DeepSpeed loads its CPU ops where a CUDA toolkit is installed (see the module doc).
        cpp_extension_logger = logging.getLogger("torch.utils.cpp_extension")
        if not any(isinstance(f, DropMessages) for f in cpp_extension_logger.filters):
            cpp_extension_logger.addFilter(DropMessages(NO_CUDA_RUNTIME))
    with _held_back(("mlflow",)):  # importable again afterwards, for dskit's own MLflow tracker
        import deepspeed
    _import_muon_compiling_lazily()
    return deepspeed


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _lazy_compile(model: Any = None, **options: Any) -> Any:
    """torch.compile, deferred to the first call (torch.compile(fn) itself imports dynamo and inductor)."""
    if model is None:
        return functools.partial(_lazy_compile, **options)
    compiled = None

    @functools.wraps(model)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(model, **options)
        return compiled(*args, **kwargs)

    return run


def _import_muon_compiling_lazily() -> None:
    """Import DeepSpeed's Muon module with its `@compiler.compile()` decorators lazy (see the module doc)."""
    if MUON_MODULE in sys.modules:
        return
    from model_utils.compat import deepspeed_internals

    with (
        deepspeed_internals.compile_decorator_replaced(lambda: _lazy_compile),
        contextlib.suppress(ImportError),
    ):
        importlib.import_module(MUON_MODULE)  # (ImportError: a DeepSpeed without Muon)


# Optional dependencies of transformers and accelerate that a training rank does not use (see the module doc).
HELD_BACK_FROM_TRANSFORMERS = ("jinja2", "boto3", "scipy")


@contextlib.contextmanager
def _held_back(names: tuple[str, ...]) -> Iterator[None]:
    """While active, `import NAME` raises ImportError and importlib.util.find_spec(NAME) is None, so libraries
    that probe for an optional dependency skip it. Names already imported are left alone."""
    held = [name for name in names if name not in sys.modules]
    for name in held:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in held:
            del sys.modules[name]  # importable again afterwards, by whoever needs it


def import_transformers(chat_templates: bool = False) -> ModuleType:
    """`import transformers` (and accelerate, which it imports for its DeepSpeed integration) without the
    optional imports a rank does not use. Call it before any other import of transformers: the first decides.
    Chat templates (jinja2) are then unavailable in this process, unless `chat_templates` (a process that may
    prepare conversation or prompt/completion data renders them)."""
    if "transformers" not in sys.modules:
        held = tuple(n for n in HELD_BACK_FROM_TRANSFORMERS if not (chat_templates and n == "jinja2"))
        with _held_back(held):
            import accelerate  # noqa: F401  (imported here so its boto3 probe runs while boto3 is held back)
            import transformers  # noqa: F401  (returned from sys.modules below)
            from transformers.utils import import_utils

            import_utils.is_scipy_available()  # cached, as False: the modeling import skips scipy
    transformers_bars_off()
    return sys.modules["transformers"]


def transformers_bars_off() -> None:
    """transformers' progress bars ("Loading weights", "Writing model shards") off in this process: each
    redraw is another line in a log file, and a tiny model's bar tells nobody anything."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


@contextlib.contextmanager
def cpu_info_computed_once(host_cache: Path | None = None) -> Iterator[None]:
    """py-cpuinfo's `get_cpu_info()` answers from the first call while this is active (see the module doc); with
    `host_cache` (a directory), from the answer an earlier process of this host's boot left there, else it
    probes and leaves its answer there."""
    import cpuinfo

    original = cpuinfo.get_cpu_info
    # DeepSpeed imports the name at each call.
    cpuinfo.get_cpu_info = functools.cache(functools.partial(host_cpu_info, original, host_cache))
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = original


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # new at each boot, and each host's own


def host_cpu_info(probe: Callable[[], dict[str, Any]], host_cache: Path | None) -> dict[str, Any]:
    """`probe()`'s answer, kept in `host_cache` for this boot of this host (a shared filesystem's hosts each
    have theirs). Without a cache or a boot id (not Linux), or when the file cannot be read or written, it
    probes: a slower start, never a failed one."""
    path = None
    if host_cache is not None:
        with contextlib.suppress(OSError):
            path = host_cache / f"dskit-cpuinfo-{BOOT_ID.read_text().strip()}.json"
    if path is None:
        return probe()
    from model_utils.storage.file_manifest import kept_json

    return kept_json(path, probe, lambda kept: isinstance(kept, dict) and bool(kept))


class _LineFilter(io.TextIOBase):
    """A text stream that passes each complete line on to `target` unless the whole line matches `drop`."""

    def __init__(self, target: TextIO, drop: re.Pattern[str]) -> None:
        self.target, self.drop, self.pending = target, drop, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        for line in lines:
            if self.drop.fullmatch(line) is None:
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def finish(self) -> None:
        if self.pending:
            self.target.write(self.pending)
        self.target.flush()


@contextlib.contextmanager
def op_built_lines_dropped() -> Iterator[None]:
    """DeepSpeed's "DeepSpeed <op> built successfully" lines (see the module doc) stay off stdout while this
    is active (around `deepspeed.init_distributed`); every other line goes through as it is printed."""
    lines = _LineFilter(sys.stdout, OP_BUILT)
    try:
        with contextlib.redirect_stdout(lines):
            yield
    finally:
        lines.finish()


@contextlib.contextmanager
def schedule_start_unlogged() -> Iterator[None]:
    """DeepSpeed's "before it has started" lr warning is not logged while this is active: wrap
    `deepspeed.initialize` in it, whose warm-up schedulers read their lr at iteration -1 when constructed (see
    the module doc). The warning still shows when anything reads the lr later, before the schedule starts."""
    from deepspeed.utils import logger

    drops = [DropMessages(LR_BEFORE_START), DropMessages(ONE_STEP_WARMUP)]
    for drop in drops:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for drop in drops:
            logger.removeFilter(drop)


@contextlib.contextmanager
def overflow_unlogged() -> Iterator[None]:
    """DeepSpeed's overflow warnings are not logged while this is active: wrap a step discarded on purpose."""
    from deepspeed.utils import logger

    drop = DropMessages(OVERFLOW_SKIP)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def zero_to_fp32_quiet() -> Iterator[None]:
    """DeepSpeed's zero_to_fp32 without its prints (stdout) and tqdm bars while this is active (see the module
    doc): wrap the consolidation, up to the last tensor materialised (ZeRO-3's lazy mode gathers then)."""
    from deepspeed.utils import zero_to_fp32

    original = zero_to_fp32.tqdm
    zero_to_fp32.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        zero_to_fp32.tqdm = original
