"""--sample_prompts at the loop's evaluation point, with a stand-in engine and reporter: built only when the run
has prompts; due every --sample_every trained steps and after the last; each round generates in eval mode (back
to train mode after, an error too) and hands the reporter each prompt's text up to its first end-of-text, with
the seconds it took; The real engines:
tests/e2e/test_validation.py."""

from __future__ import annotations

import types
from typing import Any

import pytest

from model_utils.data.prompts import Prompt
from model_utils.loop.observers.samples import Samples
from model_utils.observe import watchdog

EOS = 0
PROMPTS = (Prompt("Once", (11, 12)), Prompt("Twice", (13,)))


class Engine:
    def __init__(self, answers: list[list[int]]) -> None:
        self.answers, self.modes, self.asked = answers, [], []

    def eval(self) -> None:
        self.modes.append("eval")

    def train(self) -> None:
        self.modes.append("train")

    def generate(self, prompts: list[tuple[int, ...]], new_tokens: int) -> list[list[int]]:
        self.asked.append((prompts, new_tokens))
        if not self.answers:
            raise RuntimeError("a forward failed")
        return self.answers


class Tokenizer:
    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return " ".join(f"t{i}" for i in ids)


class Reporter:
    def __init__(self) -> None:
        self.logged: list[tuple[int, list[tuple[str, str]], float]] = []

    def log_samples(self, step: int, samples: list[tuple[str, str]], seconds: float) -> None:
        self.logged.append((step, samples, seconds))


def context(prompts: tuple[Prompt, ...], engine: Any, reporter: Reporter) -> Any:
    report = types.SimpleNamespace(sample_every=3, sample_max_new_tokens=4)
    run = types.SimpleNamespace(
        sample_prompts=prompts, tokenizer=Tokenizer(), config=types.SimpleNamespace(report=report)
    )
    return types.SimpleNamespace(run=run, engine=engine, reporter=reporter)


def test_built_only_for_a_run_with_prompts() -> None:
    assert Samples.from_loop(context((), Engine([]), Reporter())) is None
    assert Samples.from_loop(context(PROMPTS, Engine([]), Reporter())) is not None


def test_due_every_n_steps_and_after_the_last() -> None:
    samples = Samples.from_loop(context(PROMPTS, Engine([]), Reporter()))
    assert samples is not None
    due = [step for step in range(1, 8) if samples.evaluation_due(step, last=step == 7)]
    assert due == [3, 6, 7]
    assert samples.evaluation_due(3, last=False) == watchdog.SAMPLES


def test_each_round_hands_the_reporter_the_texts_up_to_end_of_text() -> None:
    engine, reporter = Engine([[5, 6, EOS, 7], [8, 9, 10, 11]]), Reporter()
    samples = Samples.from_loop(context(PROMPTS, engine, reporter))
    assert samples is not None
    samples.evaluate(3)
    assert engine.asked == [([(11, 12), (13,)], 4)] and engine.modes == ["eval", "train"]
    [(step, texts, seconds)] = reporter.logged
    assert step == 3 and texts == [("Once", "t5 t6"), ("Twice", "t8 t9 t10 t11")] and seconds >= 0


def test_a_failed_round_leaves_the_model_training() -> None:
    engine = Engine([])
    samples = Samples.from_loop(context(PROMPTS, engine, Reporter()))
    assert samples is not None
    with pytest.raises(RuntimeError, match="a forward failed"):
        samples.evaluate(3)
    assert engine.modes == ["eval", "train"]
