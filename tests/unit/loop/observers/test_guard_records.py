"""The spike guard's events as the metrics file's records: a spike's signal, value and threshold; a rollback's
steps, tag, reason and the data it skips, in that order (docs/spike-guard.md)."""

from __future__ import annotations

from model_utils.data.sampler import DataPosition
from model_utils.loop import hooks
from model_utils.loop.hooks import GuardEvent
from model_utils.loop.observers import guard_records
from model_utils.loop.spike_guard import Spike


def test_guard_records_are_the_metrics_files_guard_events() -> None:
    spike = Spike("grad norm", 41.5, 3.2)
    skip = GuardEvent("spike_grad_norm", 7, {"spike_guard/rollbacks": 0}, spike=spike)
    assert guard_records.record(skip) == {
        "event": "spike_grad_norm",
        "step": 7,
        "signal": "grad norm",
        "value": 41.5,
        "threshold": 3.2,
    }
    back = hooks.Rollback(9, "t-5steps", "2 loss spikes in a row", DataPosition(0, 10), DataPosition(0, 18))
    record = guard_records.record(GuardEvent("rollback", 5, {}, rollback=back))
    assert record == {
        "event": "rollback",
        "step": 5,
        "from_step": 9,
        "tag": "t-5steps",
        "reason": "2 loss spikes in a row",
        "skip_from": DataPosition(0, 10).to_dict(),
        "skip_to": DataPosition(0, 18).to_dict(),
    }
    assert list(record) == ["event", "step", "from_step", "tag", "reason", "skip_from", "skip_to"]
