"""A weighted mixture trained by the real Trainer on real ranks (gloo on CPU; the data order is the sampler's and the
mixture's, the same under either engine): a run killed mid-accumulation and resumed on another world size with the
same global batch reads exactly the samples of the uninterrupted run (FSDP's), under FSDP and under DeepSpeed (its
checkpoint resharded through convert_universal); the log and the metrics file carry the planned and realised shares
and each source's validation loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.metrics_file import step_records
from support.prepared_data import write_jsonl
from support.rank_pool import run_ranks, train
from support.torchrun import REPO

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "support" / "mixture_samples.py"


def flags(tmp: Path, ckpt: str, ranks: int, metrics: str, backend: str = "fsdp") -> list[str]:
    sources = [
        {"name": "stories", "dataset": str(tmp / "stories.jsonl"), "share": 0.7},
        {
            "name": "lists",
            "dataset": str(tmp / "lists.jsonl"),
            "share": 0.3,
            "max_repeat": 2,
            "validation_fraction": 0.1,
        },
    ]
    return [
        "--backend", backend, "--sources", json.dumps(sources), "--seq_length", "32",
        "--max_steps", "8", "--logging_freq", "2", "--checkpoint_freq", "4", "--validation_freq", "4",
        "--validation_batches", "2", "--micro_batch_size", "1", "--gradient_accumulation_steps", str(4 // ranks),
        "--data_cache_dir", str(tmp / "cache"), "--checkpoint_dir", str(tmp / ckpt),
        "--metrics_file", str(tmp / metrics),
    ]  # fmt: skip


def samples(out: Path, ranks: int) -> dict[int, tuple[dict, list[int], list[str]]]:
    """Per step: the position and the block ids and row digests of every rank, in rank order."""
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    steps = {}
    for records in zip(*per_rank, strict=True):
        assert len({json.dumps(r["position"]) for r in records}) == 1  # every rank at one position
        steps[records[0]["step"]] = (
            records[0]["position"],
            [i for r in records for i in r["ids"]],
            [d for r in records for d in r["rows"]],
        )
    return steps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """The data and the uninterrupted FSDP run on 2 ranks, once for every resumed run: (the data dir, its samples
    per step, its metrics records per step)."""
    tmp_path = tmp_path_factory.mktemp("mixture")
    write_jsonl(
        tmp_path / "stories.jsonl", [f"Story {i}: the fox ran " + "far " * (i % 9) for i in range(300)]
    )
    write_jsonl(
        tmp_path / "lists.jsonl",
        [f"List {i}: " + ", ".join(["eggs", "milk"] * (1 + i % 4)) for i in range(60)],
    )
    straight = tmp_path / "straight"
    straight.mkdir()
    out = train([str(straight), "0", *flags(tmp_path, "ckpt-straight", 2, "straight.jsonl")], script=SCRIPT)
    assert "Mixture: stories 70.0% planned" in out and "capped by lists (max_repeat 2)" in out
    assert "| shares stories 7" in out and "| per source stories " in out
    full = samples(straight, 2)
    assert sorted(full) == list(range(1, 9))
    records = step_records(tmp_path / "straight.jsonl")
    assert {round(records[8]["share/stories"] + records[8]["share/lists"], 9)} == {1.0}
    validations = [json.loads(line) for line in (tmp_path / "straight.jsonl").read_text().splitlines()]
    validations = [r for r in validations if "val_loss" in r]
    per_source = {
        f"{key}/{name}"
        for key in ("val_loss", "val_ppl", "val_bpb", "val_tokens")
        for name in ("stories", "lists")
    }
    assert validations and all(per_source <= set(r) for r in validations)
    return tmp_path, full, records


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_a_killed_mixture_run_resumed_on_another_world_size_reads_the_same_samples(
    backend: str, uninterrupted: tuple[Path, dict, dict]
) -> None:
    tmp_path, full, records = uninterrupted
    killed = tmp_path / f"killed-{backend}"
    killed.mkdir()
    ckpt = f"ckpt-killed-{backend}"
    crashed = run_ranks(
        [str(killed), "6", *flags(tmp_path, ckpt, 2, f"killed-{backend}.jsonl", backend)], script=SCRIPT
    )
    assert crashed.returncode != 0 and "killed after the first micro-batch of the step" in crashed.stderr
    assert sorted(samples(killed, 2)) == list(range(1, 7))  # step 6 was read, then killed mid-accumulation
    assert (tmp_path / ckpt / "tiny_qwen3-4steps").is_dir()
    assert not (tmp_path / ckpt / "tiny_qwen3-6steps").exists()

    resumed = tmp_path / f"resumed-{backend}"
    resumed.mkdir()
    out = train(
        [str(resumed), "0", *flags(tmp_path, ckpt, 1, f"resumed-{backend}.jsonl", backend)],
        script=SCRIPT,
        nproc=1,
    )
    assert "world size changed from 2 to 1" in out and "at step 4 (epoch 0, block 16" in out
    again = samples(resumed, 1)
    assert sorted(again) == [5, 6, 7, 8]
    for step, seen in again.items():
        assert seen == full[step], step  # the same positions, block ids and tokens, in the same order
    resumed_records = step_records(tmp_path / f"resumed-{backend}.jsonl")
    for step in (6, 8):
        assert resumed_records[step]["share/lists"] == records[step]["share/lists"]


def test_each_sources_validation_loss_is_its_own_datasets_and_the_overall_covers_all(tmp_path: Path) -> None:
    """A full validation pass of the mixture on 2 ranks, nothing trained (the seed's weights at any world size):
    each source's summed loss, target tokens and text bytes (its loss, perplexity and bits per byte) equal a
    one-rank pass over that source alone as the run's only dataset, and the overall score covers both."""
    write_jsonl(
        tmp_path / "stories.jsonl", [f"Story {i}: the fox ran " + "far " * (i % 9) for i in range(300)]
    )
    write_jsonl(
        tmp_path / "lists.jsonl",
        [f"List {i}: " + ", ".join(["eggs", "milk"] * (1 + i % 4)) for i in range(150)],
    )
    script = REPO / "tests" / "support" / "validation_loss.py"
    mixed = [*flags(tmp_path, "ckpt", 2, "m.jsonl"), "--validation_batches", "all"]
    train([str(tmp_path / "mixed.json"), *mixed], script=script)
    whole = json.loads((tmp_path / "mixed.json").read_text())
    scores = dict(whole["sources"])  # name -> {"nats", "targets", "bytes"}
    assert set(scores) == {"stories", "lists"}
    for name, own in (("stories", []), ("lists", ["--validation_fraction", "0.1"])):
        alone = [*flags(tmp_path, "ckpt", 1, "m.jsonl"), "--validation_batches", "all", *own]
        at = alone.index("--sources")
        alone[at : at + 2] = ["--dataset", str(tmp_path / f"{name}.jsonl")]
        train([str(tmp_path / f"{name}.json"), *alone], script=script, nproc=1)
        single = json.loads((tmp_path / f"{name}.json").read_text())
        assert single["sources"] == [], name
        score = single["score"]  # its loss, perplexity and bits per byte follow from these
        assert (score["targets"], score["bytes"]) == (scores[name]["targets"], scores[name]["bytes"]), name
        assert score["nats"] == pytest.approx(scores[name]["nats"], rel=1e-5), name
    overall = whole["score"]
    assert whole["blocks"] == whole["total_blocks"]
    assert overall["targets"] == sum(s["targets"] for s in scores.values())
    assert overall["bytes"] == sum(s["bytes"] for s in scores.values())
    assert overall["nats"] == pytest.approx(sum(s["nats"] for s in scores.values()), rel=1e-12)
