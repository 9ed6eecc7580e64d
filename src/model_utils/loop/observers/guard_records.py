"""The spike guard's events as records: each skip, grad-norm spike and rollback a line in the metrics file (what
`dskit plot` marks) and a point on the tracker's spike_guard/ curves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model_utils.loop.hooks import GuardEvent, Observer

if TYPE_CHECKING:
    from model_utils.observe.reporter import Reporter


def record(event: GuardEvent) -> dict[str, Any]:
    """The metrics file's record of an event (docs/spike-guard.md)."""
    out: dict[str, Any] = {"event": event.kind, "step": event.step}
    if event.spike is not None:
        out.update(event.spike.to_dict())
    if event.rollback is not None:
        back = event.rollback
        out.update(
            {
                "from_step": back.from_step,
                "tag": back.tag,
                "reason": back.reason,
                "skip_from": back.skip_from.to_dict(),
                "skip_to": back.skip_to.to_dict(),
            }
        )
    return out


class GuardRecords(Observer):
    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter

    def on_guard_event(self, event: GuardEvent) -> None:
        self.reporter.guard_event(record(event), event.counters)
