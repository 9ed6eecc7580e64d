"""The run's observers (loop/hooks.py), one file each, built once the loop is set up.

A new one (an evaluator, a watchdog) is a file here and a line in `build`; the Trainer does not change. A user's
own (--observers MODULE:NAME) is imported by `named` and called like the others' `from_loop`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from model_utils.errors import ConfigError
from model_utils.loop.hooks import Hooks, Observer
from model_utils.loop.observers.checkpointer import Checkpointer
from model_utils.loop.observers.context import LoopContext
from model_utils.loop.observers.guard import Guard
from model_utils.loop.observers.hub_push import HubPush
from model_utils.loop.observers.ledger import Ledger
from model_utils.loop.observers.profiler import Profiler
from model_utils.loop.observers.reference import Reference
from model_utils.loop.observers.reporting import Reporting
from model_utils.loop.observers.s3_uploads import S3Uploads
from model_utils.loop.observers.samples import Samples
from model_utils.loop.observers.stragglers import Stragglers
from model_utils.loop.observers.validation import Validator
from model_utils.loop.observers.walltime import Walltime
from model_utils.loop.observers.watchdog import Watchdog


def named(names: tuple[tuple[str, str], ...]) -> list[Callable[[LoopContext], Observer | None]]:
    """What --observers names (LoopArgs.observer_names), imported: one line for a module or name that is not
    there (the preflight calls this before the ranks start)."""
    found = []
    for module_name, name in names:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise ConfigError(
                f"--observers {module_name}:{name}: no module named {e.name!r} on this Python's path: install it "
                "or add its directory to PYTHONPATH (on every node)"
            ) from None
        factory = getattr(module, name, None)
        if not callable(factory):
            raise ConfigError(
                f"--observers {module_name}:{name}: {module_name} ({module.__file__}) has no class or function "
                f"{name!r}: fix the name"
            )
        found.append(factory)
    return found


def build(ctx: LoopContext) -> list[Observer]:
    """The observers this run has, in calling order: the kit's, then --observers' in their order, the reporter's
    output last (see loop/hooks.py). The reporter's is made first: it opens the run's files and tracker, which
    others write to. When one cannot be made, those made already are closed (a tracker's run, the watchdog's
    thread) before the error goes on."""
    only = ctx.run.config.loop.validation_only  # validates and ends: writes nothing of a training run's
    walltime = None if only else Walltime.from_loop(ctx)
    reporting = Reporting(ctx, walltime.time_left if walltime is not None else lambda: None)
    made: list[Observer] = [reporting]
    # The reference right after the watchdog (which follows its pass): the pairs carry its log-probabilities
    # before anything reads them.
    kits: list[Callable[[LoopContext], Observer | None]] = [Watchdog.from_loop, Reference.from_loop]
    if not only:
        kits += [
            S3Uploads.from_loop,
            HubPush.from_loop,
            Profiler.from_loop,
            Guard.from_loop,
            Stragglers.from_loop,
        ]
        kits += [Ledger.from_loop, Validator.from_loop, Samples.from_loop, lambda _: walltime, Checkpointer]
    else:
        kits += [Reference.from_loop, Validator.from_loop]
    try:
        for factory in [*kits, *named(ctx.run.config.loop.observer_names)]:
            observer = factory(ctx)
            if observer is not None and not isinstance(observer, Observer):
                raise ConfigError(
                    f"--observers: {factory.__module__}:{factory.__qualname__} returned a "
                    f"{type(observer).__name__}, not an Observer: subclass model_utils.loop.hooks.Observer"
                )
            if observer is not None:
                made.insert(-1, observer)
    except BaseException:
        Hooks(made).on_close()
        raise
    return made
