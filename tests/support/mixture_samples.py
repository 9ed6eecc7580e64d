"""A real Trainer on each rank that records the samples every step reads: for tests of a mixture's resume.

    (ranks) tests/support/mixture_samples.py OUT_DIR KILL_AT_STEP TRAINING_FLAGS...

Each rank writes OUT_DIR/rank<R>.json: per step it fetched, the data position, the block ids this rank read (its
micro-batches in order) and a digest of each block's tokens as the engine got them. KILL_AT_STEP > 0: that step
ends the process on every rank after its first micro-batch went through forward and backward (a kill
mid-accumulation: the step is never applied, nothing of it saved); 0: the run trains to the end.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from model_utils.config.arguments import parse_args
from model_utils.launch import distributed
from model_utils.loop import trainer as training
from model_utils.resolve import resolver


class KilledMidAccumulation(RuntimeError):
    pass


class FirstMicroBatchOnly(list):
    """The step's micro-batches, ending the step after the first one was trained on."""

    def __iter__(self):
        yield self[0]
        raise KilledMidAccumulation("killed after the first micro-batch of the step")


def main() -> None:
    out, kill_at, flags = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    dist = distributed.init_distributed()
    run = resolver.prepare_on_ranks(parse_args(flags), dist)  # as the rank's entry prepares
    trainer = training.Trainer(run, dist)
    assert trainer.batches is not None
    steps: list[dict] = []
    fetch = trainer.batches.at
    train_step = trainer.engine.train_step

    def recorded_fetch(position):
        micro_batches = fetch(position)
        ids = trainer.sampler.step_indices(position).reshape(-1).tolist()
        digests = [
            hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:12]
            for b in micro_batches
            for row in b.input_ids
        ]
        steps.append(
            {"step": trainer.state.step + 1, "position": position.to_dict(), "ids": ids, "rows": digests}
        )
        return micro_batches

    def killing_step(micro_batches, keep=None, targets=None):
        if trainer.state.step + 1 == kill_at:
            micro_batches = FirstMicroBatchOnly(micro_batches)
        return train_step(micro_batches, keep, targets)

    trainer.batches.at = recorded_fetch
    trainer.engine.train_step = killing_step
    try:
        trainer.fit()
    finally:
        (out / f"rank{dist.rank}.json").write_text(json.dumps(steps))
        trainer.close()


if __name__ == "__main__":
    main()
