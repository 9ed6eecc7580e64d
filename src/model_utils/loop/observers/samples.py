"""--sample_prompts: every --sample_every trained steps, and after the last, every rank generates from the fixed
prompts (resolved once: data/prompts.py) through its engine (engines/generation.py: greedy, a fixed number of
tokens, so the ranks of a sharded model run their forwards in step), and rank 0's reporter prints them briefly
and records them in the metrics file and the trackers. It runs at the loop's evaluation point, whose time the
throughput leaves out, like validation's."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from model_utils.data.prompts import Prompt
from model_utils.loop.hooks import Observer
from model_utils.observe import watchdog

if TYPE_CHECKING:
    from model_utils.engines.base import Engine
    from model_utils.loop.observers.context import LoopContext
    from model_utils.loop.reporter import Reporter


class Samples(Observer):
    def __init__(
        self,
        engine: Engine,
        reporter: Reporter,
        tokenizer: Any,
        prompts: tuple[Prompt, ...],
        every: int,
        new_tokens: int,
    ) -> None:
        self.engine, self.reporter, self.tokenizer = engine, reporter, tokenizer
        self.prompts, self.every, self.new_tokens = prompts, every, new_tokens

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Samples | None:
        if not ctx.run.sample_prompts:
            return None
        report = ctx.run.config.report
        return cls(
            ctx.engine,
            ctx.reporter,
            ctx.run.tokenizer,
            ctx.run.sample_prompts,
            report.sample_every,
            report.sample_max_new_tokens,
        )

    def evaluation_due(self, step: int, last: bool, start: bool = False) -> str | None:
        return watchdog.SAMPLES if not start and (step % self.every == 0 or last) else None

    def evaluate(self, step: int) -> None:
        started = time.perf_counter()
        texts = self.generate()
        seconds = time.perf_counter() - started
        self.reporter.log_samples(
            step, [(p.text, t) for p, t in zip(self.prompts, texts, strict=True)], seconds
        )

    def generate(self) -> list[str]:
        """What the model now writes after each prompt, up to its first end-of-text."""
        self.engine.eval()
        try:
            generated = self.engine.generate([p.ids for p in self.prompts], self.new_tokens)
        finally:
            self.engine.train()
        eos = self.tokenizer.eos_token_id
        return [
            self.tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids, skip_special_tokens=True)
            for ids in generated
        ]
