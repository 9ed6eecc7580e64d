"""One validation, and one round of samples when --sample_prompts is given, of a freshly built Trainer, nothing
trained (the weights are the seed's at any world size and under any engine):

    torchrun --nproc_per_node=N tests/support/validation_loss.py OUT.json TRAINING_FLAGS...

Rank 0 writes the metrics.Validation as JSON to OUT.json ({"score": {"nats", "targets", "bytes"}, "blocks",
"total_blocks", "seconds", "sources"}), and the texts the samples observer generates ("samples"): what a full
pass (--validation_batches all) measures on N ranks, against a plain forward over the same blocks in the test
(tests/e2e/test_validation.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from model_utils.config.arguments import parse_args
from model_utils.launch import distributed
from model_utils.loop import trainer as training
from model_utils.loop.observers.samples import Samples
from model_utils.loop.observers.validation import Validator
from model_utils.resolve import resolver
from support.observers import find


def main() -> None:
    out, flags = Path(sys.argv[1]), sys.argv[2:]
    dist = distributed.init_distributed()
    run = resolver.prepare_on_ranks(parse_args(flags), dist)  # as the rank's entry prepares
    trainer = training.Trainer(run, dist)
    try:
        validation = find(trainer, Validator).evaluate(trainer.state.step)
        samplers = [o for o in trainer.hooks.observers if isinstance(o, Samples)]
        samples = [text for sampler in samplers for text in sampler.generate()]
    finally:
        trainer.close()
    if dist.is_main:
        out.write_text(json.dumps({**dataclasses.asdict(validation), "samples": samples}))


if __name__ == "__main__":
    main()
