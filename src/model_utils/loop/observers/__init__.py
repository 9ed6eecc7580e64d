"""The run's observers (loop/hooks.py), one file each, built once the loop is set up.

A new one (an evaluator, a watchdog) is a file here and a line in `build`; the Trainer does not change.
"""

from __future__ import annotations

from model_utils.loop.hooks import Observer
from model_utils.loop.observers.context import LoopContext
from model_utils.loop.observers.guard_records import GuardRecords
from model_utils.loop.observers.hub_push import HubPush
from model_utils.loop.observers.ledger import Ledger
from model_utils.loop.observers.profiler import Profiler
from model_utils.loop.observers.reporting import Reporting
from model_utils.loop.observers.s3_uploads import S3Uploads
from model_utils.loop.observers.samples import Samples
from model_utils.loop.observers.stragglers import Stragglers
from model_utils.loop.observers.watchdog import Watchdog


def build(ctx: LoopContext) -> list[Observer]:
    """The observers this run has, in calling order; the reporter's output last (see loop/hooks.py)."""
    found = [
        Watchdog.from_loop(ctx),
        S3Uploads.from_loop(ctx),
        HubPush.from_loop(ctx),
        Profiler.from_loop(ctx),
        GuardRecords(ctx.reporter),
        Stragglers.from_loop(ctx),
        Ledger.from_loop(ctx),
        Samples.from_loop(ctx),
        Reporting.from_loop(ctx),
    ]
    return [observer for observer in found if observer is not None]
