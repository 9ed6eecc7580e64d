"""Validation and samples as a run reports them. `--validation_batches all` reads every validation block once,
shared out over the ranks, and its summed loss, target tokens and text bytes (a sum over all ranks) equal a plain
forward over the same blocks with the same masks in this process, under ZeRO-2 (with LoRA, on masked and padded
conversations), ZeRO-3 and FSDP (2 ranks of the rank pool, nothing trained: the seed's or the base model's
weights, which LoRA's zero-initialised adapters leave as they are). The ZeRO-3 and FSDP launches also generate
from --sample_prompts: greedy texts equal to those of ZeRO-2 (the real Trainer in this process), which also logs
and records what a validation covered and took, and its samples, in the metrics file and TensorBoard. The
sharding and the lines alone: tests/unit/data/test_sampler.py, tests/unit/observe/test_step_line.py; the byte
table against decoding: tests/unit/data/test_token_bytes.py; the prompts: tests/unit/data/test_prompts.py. And a
validation dataset too small for one batch per rank is refused naming it and its fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dskit import cost
from model_utils.config.arguments import parse_args
from model_utils.data import token_bytes
from model_utils.loop import trainer as training
from model_utils.loop.observers.samples import Samples
from model_utils.loop.observers.validation import Validator
from model_utils.model.models import build_model
from model_utils.observe import step_line
from model_utils.observe.ledger_file import LEDGER
from model_utils.resolve import resolver
from support.metrics_file import sample_records, tensorboard_scalars, tensorboard_texts
from support.observers import find
from support.pretrained import save_tiny_qwen3
from support.rank_pool import REPO, train
from support.small_trainer import make_trainer

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "support" / "validation_loss.py"
ASSETS = REPO / "src" / "model_utils" / "assets"
FULL_PASS = ["--validation_batches", "all", "--metrics_file", "none"]
# The prompts the docs show (docs/metrics-and-trackers.md#samples); 8 new tokens fit the in-process run's 32-token
# blocks.
PROMPTS_FILE = REPO / "examples" / "sample_prompts.jsonl"
SAMPLE_FLAGS = ["--sample_prompts", str(PROMPTS_FILE), "--sample_max_new_tokens", "8"]
# 64-token blocks of the embedded corpus with 0.3% held out (14 validation blocks), in micro-batches of 8: one for
# each of 2 ranks. A rank one batch short, which repeats a batch that counts for nothing: tests/unit/data/
# test_sampler.py.
STREAM = ["--seq_length", "64", "--micro_batch_size", "8", "--validation_fraction", "0.003"]
# Conversations packed whole into 256-token blocks: prompts masked, blocks padded; LoRA on a saved tiny model.
CHAT = ["--dataset", str(ASSETS / "tiny_conversations.jsonl"), "--chat_template", str(ASSETS / "tiny_chat_template.jinja"),
        "--seq_length", "256", "--micro_batch_size", "2", "--validation_fraction", "0.1",
        "--lora_r", "4", "--lora_alpha", "8"]  # fmt: skip
# ZeRO-3 and FSDP gather the weights in every forward (each rank must run as many); ZeRO-2 runs LoRA's wrapped
# model on masked data.
ENGINES = {
    "zero2-lora": CHAT,
    "zero3": [*STREAM, *SAMPLE_FLAGS, "--deepspeed_config", str(REPO / "deepspeed" / "ds_config_zero3.json")],
    "fsdp": [*STREAM, *SAMPLE_FLAGS, "--backend", "fsdp"],
}


def direct(flags: list[str]) -> tuple[float, int, int, int]:
    """The summed loss, target tokens and their text bytes of every validation block, one row per forward of the
    model as built from the seed (or loaded), and the number of blocks."""
    run = resolver.prepare(parse_args(flags), world_size=1)
    assert run.val_blocks is not None
    model = build_model(run.source, run.model_config, run.config.loop.seed, run.settings.train.model_dtype())
    model.eval()
    rows = run.val_blocks.rows(np.arange(len(run.val_blocks)))
    tokens = np.asarray(rows.tokens, dtype=np.int64)
    targets = (
        np.ones(tokens.shape, dtype=bool) if rows.targets is None else np.array(rows.targets, dtype=bool)
    )
    targets[:, 0] = False  # nothing in a row predicts its first token
    nats = 0.0
    with torch.no_grad():
        for i in range(len(tokens)):
            inputs = {"input_ids": torch.from_numpy(tokens[i : i + 1])}
            if rows.positions is not None:
                inputs["position_ids"] = torch.from_numpy(
                    np.asarray(rows.positions[i : i + 1], dtype=np.int64)
                )
            logits = model(**inputs, use_cache=False).logits[0, :-1].float()
            scored = torch.from_numpy(targets[i, 1:])
            labels = torch.from_numpy(tokens[i, 1:])
            nats += torch.nn.functional.cross_entropy(logits[scored], labels[scored], reduction="sum").item()
    text_bytes = int(token_bytes.byte_lengths(run.tokenizer)[tokens[targets]].sum())
    return nats, int(targets.sum()), text_bytes, len(tokens)


@pytest.fixture(scope="module")
def full_passes(tmp_path_factory: pytest.TempPathFactory):
    """full_pass(engine): (what validation_loss.py measured on 2 ranks, its flags), each launch run once for the
    module's tests."""
    tmp_path = tmp_path_factory.mktemp("full-passes")
    done: dict[str, tuple[dict, list[str]]] = {}

    def full_pass(engine: str) -> tuple[dict, list[str]]:
        if engine not in done:
            flags = [*ENGINES[engine], *FULL_PASS, "--data_cache_dir", str(tmp_path / f"cache-{engine}"),
                     "--checkpoint_dir", str(tmp_path / f"ck-{engine}")]  # fmt: skip
            if "--lora_r" in flags:  # LoRA needs pretrained weights: the tiny model saved as a model dir
                flags += ["--model", str(save_tiny_qwen3(tmp_path / "base"))]
            out = tmp_path / f"{engine}.json"
            train([str(out), *flags], script=SCRIPT, nproc=2)
            done[engine] = (json.loads(out.read_text()), flags)
        return done[engine]

    return full_pass


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_full_pass_on_two_ranks_equals_a_plain_forward_over_the_same_blocks(
    full_passes, engine: str
) -> None:
    measured, flags = full_passes(engine)
    nats, targets, text_bytes, blocks = direct(flags)
    assert measured["blocks"] == measured["total_blocks"] == blocks >= 4, measured
    score = measured["score"]
    assert (score["targets"], score["bytes"]) == (targets, text_bytes), (score, targets, text_bytes)
    assert score["nats"] == pytest.approx(nats, rel=1e-5), (score, nats)
    seq = int(flags[flags.index("--seq_length") + 1])
    if engine == "zero2-lora":  # prompts and padding are not scored: far fewer targets than tokens
        assert targets < 0.8 * blocks * seq, (targets, blocks)
    else:  # the plain stream: every token but a row's first
        assert targets == blocks * (seq - 1)
    # Bits per byte of the embedded English text: a few bytes per token, so well under the loss in bits.
    assert 2 < text_bytes / targets < 6 and 0 < nats / math.log(2) / text_bytes < nats / math.log(2) / targets
    assert measured["seconds"] > 0


def test_the_trainer_logs_and_records_its_validation_and_samples_the_same_under_every_engine(
    tmp_path: Path, single_rank, full_passes, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    trainer = make_trainer(
        tmp_path, single_rank, "--max_steps", "3", "--validation_fraction", "0.003", "--validation_batches", "all",
        "--validation_freq", "3", "--metrics_file", str(metrics), *SAMPLE_FLAGS, "--sample_every", "2",
        "--report_to", "tensorboard", "--report_dir", str(tmp_path / "logs"),
    )  # fmt: skip
    try:
        sampler = find(trainer, Samples)
        seed_samples = (
            sampler.generate()
        )  # the seed's weights under ZeRO-2 (the default config), as the pool's
        trainer.fit()
    finally:
        trainer.close()
    assert len(seed_samples) == 2 and all(seed_samples), seed_samples
    for engine in ("zero3", "fsdp"):  # 2 ranks each, gathering the weights in every forward
        assert full_passes(engine)[0]["samples"] == seed_samples, engine

    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "Validation Loss" in line]
    assert len(lines) == 1, lines
    blocks = len(trainer.run.val_blocks)
    targets = blocks * 31  # 32-token blocks of the plain stream: a row's first token is not a target
    assert f"| {blocks:,} of {blocks:,} blocks ({targets:,} target tokens) | took " in lines[0], lines
    [record] = [json.loads(r) for r in metrics.read_text().splitlines() if "val_loss" in r]
    assert (record["val_blocks"], record["val_total_blocks"], record["val_tokens"]) == (
        blocks,
        blocks,
        targets,
    )
    assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]))
    assert 0 < record["val_bpb"] < record["val_loss"] / math.log(2) and record["val_s"] > 0
    assert lines[0].endswith(step_line.validation_line(record, trainer.run.max_steps)), lines[0]

    # Samples after step 2 (--sample_every) and after the last, step 3: in the log, the metrics file, TensorBoard.
    assert "Samples at step 2: 2 prompts in " in out and "Samples at step 3: 2 prompts in " in out
    samples = sample_records(metrics)
    assert sorted(samples) == [2, 3]
    for sampled in samples.values():
        assert [s["prompt"] for s in sampled["samples"]] == [
            "Once upon a time",
            "Tom and his dog went to the park. They",
        ]
        assert all(s["text"] for s in sampled["samples"]) and sampled["sample_s"] > 0
    [run_dir] = (tmp_path / "logs" / "tensorboard").iterdir()
    texts = tensorboard_texts(run_dir, "samples")
    assert sorted(texts) == [2, 3]
    for step, text in texts.items():
        for sample in samples[step]["samples"]:
            assert f"| {sample['prompt']} | {sample['text']} |" in text, text
    assert [step for step, _ in tensorboard_scalars(run_dir)["samples/seconds"]] == [2, 3]
    # And in the goodput ledger, where `dskit cost` charges their time to "samples".
    ledger = [json.loads(line) for line in (tmp_path / "ckpt" / LEDGER).read_text().splitlines()]
    evaluations = [(r["step"], r["phase"], r["seconds"]) for r in ledger if r["event"] == "evaluation"]
    assert [(step, phase) for step, phase, _ in evaluations] == [(2, "samples"), (3, "samples")]
    for step, _, seconds in evaluations:
        assert samples[step]["sample_s"] <= seconds < samples[step]["sample_s"] + 0.5
    assert cost.account(ledger).attempts[0].seconds["samples"] == pytest.approx(
        sum(e[2] for e in evaluations)
    )


def test_a_validation_dataset_smaller_than_one_batch_per_rank_is_read_whole_and_said(
    tmp_path: Path, single_rank, capsys
) -> None:
    """Too little validation data for micro batch x ranks: the ranks validate on what there is, said in one line
    (it was refused only once the ranks ran, with fixes that did not work: #39)."""
    validation = tmp_path / "val.jsonl"
    validation.write_text(json.dumps({"text": "Tom and Ben built a nest out of blocks. " * 12}) + "\n")
    cfg = parse_args(["--max_steps", "3", "--seq_length", "32", "--micro_batch_size", "64",
                      "--validation_dataset", str(validation), "--metrics_file", "none",
                      "--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ck")])  # fmt: skip
    run = resolver.prepare(cfg, world_size=1)
    trainer = training.Trainer(run, single_rank)
    try:
        validated = find(trainer, Validator).evaluate(0)
    finally:
        trainer.close()
    assert (validated.blocks, validated.total_blocks) == (3, 3) and validated.score.targets > 0
    assert (
        f"Validation: validation data of --validation_dataset {validation} has 3 blocks, fewer than micro batch 64 "
        "x 1 ranks: each validation reads all 3 (a rank without one repeats one, uncounted)"
    ) in capsys.readouterr().out
