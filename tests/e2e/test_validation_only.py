"""Measure before you train (#43): `--validation_only true` validates the model a run starts from (the checkpoint a
resume would load, else --model as built) as the loop validates and records it, and ends; `--validation_at_start
true` records a fresh run's validation at step 0.

The same number everywhere: a checkpoint's validation-only loss, perplexity, bits per byte and counts equal the
loop's validation at the step that checkpoint was saved, exactly (fp32), under DeepSpeed and FSDP, on one rank (the
real Trainer in this process) and two (the rank pool, through the rank's entry point); and the fresh model's equal
the training run's step 0. The docs' recipe (docs/evaluation.md): the baseline of the shipped LoRA fine-tune, the
fine-tune, and its checkpoint measured through `./train-singlenode.sh` (dskit.api). What cannot work is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dskit import api, cli, plot
from model_utils.checkpoint import lease
from model_utils.config.arguments import parse_args
from model_utils.loop import trainer as training
from model_utils.loop.hooks import Observer, Validation
from model_utils.loop.state import TrainState
from model_utils.observe import step_line, watchdog
from model_utils.observe.ledger_file import LEDGER
from model_utils.resolve import resolver
from support.deepspeed_files import config_with
from support.metrics_file import tensorboard_scalars
from support.pretrained import save_tiny_qwen3
from support.rank_pool import REPO, run_ranks, train
from support.torchrun import ENV

pytestmark = pytest.mark.e2e

ASSETS = REPO / "src" / "model_utils" / "assets"
# What a validation measured and covered: equal to the last bit; its seconds (val_s) are what differs.
MEASURED = ("val_loss", "val_ppl", "val_bpb", "val_blocks", "val_total_blocks", "val_tokens")
# 2 steps of 32-token blocks of the embedded corpus, validated (all 28 held-out blocks) and saved at step 2.
RUN = [
    "--max_steps", "2", "--seq_length", "32", "--validation_freq", "2", "--checkpoint_freq", "2",
    "--validation_batches", "all", "--validation_fraction", "0.003",
]  # fmt: skip


def fp32(tmp_path: Path, backend: str) -> list[str]:
    """The engine's flags, in fp32 (the kit's configs train in bf16): its own config less the bf16 section."""
    if backend == "deepspeed":
        return ["--deepspeed_config", config_with(tmp_path, bf16=None)]
    fsdp = json.loads((REPO / "deepspeed" / "fsdp.json").read_text())
    del fsdp["bf16"]
    (tmp_path / "fsdp-fp32.json").write_text(json.dumps(fsdp))
    return ["--backend", "fsdp", "--deepspeed_config", str(tmp_path / "fsdp-fp32.json")]


def validations(metrics: Path) -> dict[int, dict]:
    """The validation records of a metrics file by step."""
    return {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if "val_loss" in r}


def events(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" in r]


def files_of(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory`: its size and modification time (what a write would change)."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def same_measure(loop: dict, only: dict, what: str) -> str:
    """Equal to the last bit; the numbers and both passes' seconds in one line (the issue's closing note)."""
    assert {k: only[k] for k in MEASURED} == {k: loop[k] for k in MEASURED}, (loop, only)
    return (
        f"{what}: val_loss {only['val_loss']!r} bpb {only['val_bpb']!r} ({only['val_tokens']} tokens, "
        f"{only['val_blocks']} blocks): validation only {only['val_s']:.3f} s, in the loop {loop['val_s']:.3f} s"
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One data cache for the module's runs: the embedded corpus tokenized once."""
    return str(tmp_path_factory.mktemp("cache"))


def fit(dist, *flags: str) -> training.Trainer:
    trainer = training.Trainer(resolver.prepare(parse_args([*RUN, *flags]), world_size=1), dist)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_one_rank_validation_only_equals_the_loops_validation_of_the_same_model(
    tmp_path: Path, cache: str, single_rank, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = fp32(tmp_path, backend)
    data = ["--data_cache_dir", cache, *engine]
    ck = tmp_path / "ck"
    fit(single_rank, *data, "--checkpoint_dir", str(ck), "--metrics_file", str(tmp_path / "run.jsonl"),
        "--validation_at_start", "true", "--run_name", "trained")  # fmt: skip
    loop = validations(tmp_path / "run.jsonl")
    assert sorted(loop) == [0, 2]
    saved = files_of(ck)
    capsys.readouterr()

    # The checkpoint, named by --resume_from_checkpoint, read by a run of its own dir: the same numbers as the loop's
    # validation at step 2, in the loop's records (its own run: metrics file, TensorBoard run), and the checkpoint dir
    # as it was.
    own = tmp_path / "eval-ck"
    only = fit(single_rank, *data, "--checkpoint_dir", str(own), "--resume_from_checkpoint", str(ck),
               "--validation_only", "true", "--metrics_file", str(tmp_path / "only.jsonl"),
               "--report_to", "tensorboard", "--report_dir", str(tmp_path / "logs"))  # fmt: skip
    measured = same_measure(
        loop[2], validations(tmp_path / "only.jsonl")[2], f"{backend}, 1 rank, the step-2 checkpoint"
    )
    out = capsys.readouterr().out
    tag = ck / "tiny_qwen3-2steps"
    assert step_line.validation_only_line(tag, 2) in out and step_line.validated_line(2) in out, out
    assert "| Step 2/2 | Validation Loss " in out and "| Loss " not in out, out  # validated, not trained
    start, end = events(tmp_path / "only.jsonl")
    assert (start["event"], start["step"], start["resumed_from"], start["validation_only"]) == (
        "start", 2, tag.name, True,
    )  # fmt: skip
    assert (end["event"], end["reason"]) == ("end", step_line.VALIDATED)
    assert (
        plot.load_run(tmp_path / "only.jsonl").resumes == ()
    )  # its checkpoint is read, not resumed: no mark
    # A run of its own (a new id: its metrics file and tracker run), not a record in the trained run's curve.
    assert start["run_id"] == only.state.run_id != "trained"
    [tensorboard] = (tmp_path / "logs" / "tensorboard").iterdir()
    assert tensorboard_scalars(tensorboard)["val/loss"] == [(2, pytest.approx(loop[2]["val_loss"]))]
    assert files_of(ck) == saved
    assert sorted(p.name for p in own.iterdir()) == []  # no checkpoint, ledger or lease left in its own dir

    # Other data than the checkpoint trained on is measured as given (nothing trains: no --new_data).
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"Ben counted {i} red blocks and {i + 3} blue ones. " * 4}) + "\n"
                             for i in range(60)))  # fmt: skip
    fit(single_rank, *data, "--checkpoint_dir", str(own), "--resume_from_checkpoint", str(ck), "--validation_only",
        "true", "--dataset", str(other), "--validation_fraction", "0.1", "--metrics_file", str(tmp_path / "other.jsonl.m"))  # fmt: skip
    assert validations(tmp_path / "other.jsonl.m")[2]["val_loss"] != loop[2]["val_loss"]
    assert files_of(ck) == saved

    # The model as built from --model (nothing to resume in its dir): the training run's step 0.
    fit(single_rank, *data, "--checkpoint_dir", str(tmp_path / "fresh"), "--validation_only", "true",
        "--metrics_file", str(tmp_path / "fresh.jsonl"))  # fmt: skip
    measured += "\n" + same_measure(
        loop[0], validations(tmp_path / "fresh.jsonl")[0], f"{backend}, 1 rank, the model at step 0"
    )
    assert step_line.validation_only_line("tiny-qwen3", 0) in capsys.readouterr().out
    with capsys.disabled():
        print(measured)


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_two_rank_validation_only_of_a_checkpoint_equals_the_loops_validation_at_its_step(
    tmp_path: Path, cache: str, backend: str
) -> None:
    """Through the rank's entry point on 2 ranks (the rank pool): the trained run, then its checkpoint measured while
    a live run holds its dir (this test holds the lease): in that dir it is refused, as every launch is; named by
    --resume_from_checkpoint from a dir of its own, the live run's dir is only read."""
    ck = tmp_path / "ck"
    flags = [*RUN, *fp32(tmp_path, backend), "--data_cache_dir", cache]
    train([*flags, "--checkpoint_dir", str(ck), "--metrics_file", str(tmp_path / "run.jsonl")], cwd=tmp_path)
    live = lease.acquire(ck, heartbeat_s=None)
    try:
        trained = files_of(ck)
        only = [*flags, "--validation_only", "true", "--metrics_file", str(tmp_path / "only.jsonl")]
        refused = run_ranks([*only, "--checkpoint_dir", str(ck)], cwd=tmp_path)
        assert (
            refused.returncode != 0
            and f"error: checkpoint dir {ck} is in use by another run" in refused.stderr
        )
        out = train(
            [*only, "--resume_from_checkpoint", str(ck), "--checkpoint_dir", str(tmp_path / "own")],
            cwd=tmp_path,
        )
        # Nothing written there: no checkpoint, lease or record in the trained run's ledger (no attempt of that run).
        assert files_of(ck) == trained and LEDGER in trained
    finally:
        live.release()
    measured = same_measure(
        validations(tmp_path / "run.jsonl")[2],
        validations(tmp_path / "only.jsonl")[2],
        f"{backend}, 2 ranks, the step-2 checkpoint",
    )
    assert step_line.validated_line(2) in out and "Saved checkpoint" not in out, out[-3000:]
    print(measured)


def test_validation_at_start_begins_the_curve_at_step_0_and_a_resume_does_not_repeat_it(
    tmp_path: Path, cache: str, single_rank, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "run.jsonl"
    flags = ["--data_cache_dir", cache, "--checkpoint_dir", str(tmp_path / "ck"),
             "--metrics_file", str(metrics), "--validation_at_start", "true"]  # fmt: skip
    fit(single_rank, *flags)
    assert "| Step 0/2 | Validation Loss " in capsys.readouterr().out
    fit(single_rank, *flags, "--max_steps", "4")  # resumed at step 2
    assert "| Step 0/4 | Validation Loss " not in capsys.readouterr().out
    assert sorted(validations(metrics)) == [0, 2, 4]
    # The plot's validation curve starts at the baseline, from the metrics file and from the log's lines alike.
    assert plot.load_run(metrics).series["val_loss"].steps == (0, 2, 4)
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "start"]
    assert [r["step"] for r in records] == [0, 2]


class Points(Observer):
    """The loop's points a run meets, a validation's progress per batch among them."""

    def __init__(self) -> None:
        self.met: list[tuple[str, int]] = []

    def on_start(self, state: TrainState) -> None:
        self.met.append(("on_start", state.step))

    def on_phase(self, phase: str, step: int) -> None:
        self.met.append((phase, step))

    def after_validation(self, step: int, validation: Validation) -> None:
        self.met.append(("after_validation", step))

    def on_end(self, state: TrainState, reason: str) -> None:
        self.met.append((reason, state.step))


def test_a_validation_only_run_starts_validates_and_ends_each_batch_a_step_of_progress(
    tmp_path: Path, cache: str, single_rank
) -> None:
    """The observers' points of a validation-only run; the watchdog hears of each batch, so a full pass over a large
    set (--validation_batches all) is progress, not a hang, however long it takes."""
    cfg = parse_args([*RUN, "--validation_only", "true", "--data_cache_dir", cache,
                      "--checkpoint_dir", str(tmp_path / "ck"), "--metrics_file", "none"])  # fmt: skip
    trainer = training.Trainer(resolver.prepare(cfg, world_size=1), single_rank)
    points = Points()
    try:
        trainer.hooks.attach([*trainer.hooks.observers, points])
        trainer.fit()
    finally:
        trainer.close()
    batches = len(trainer.run.val_blocks)  # micro batch 1: a block a batch
    assert points.met == [
        ("on_start", 0),
        *[(watchdog.VALIDATION, 0)] * (1 + batches),  # the loop's entering the phase, then each batch
        ("after_validation", 0),
        (step_line.VALIDATED, 0),
    ]


def test_what_cannot_be_validated_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--validation_fraction", "0", "--data_cache_dir", str(tmp_path / "d"),
             "--checkpoint_dir", str(tmp_path / "ck")]  # fmt: skip
    for flag in ("--validation_only", "--validation_at_start"):
        assert cli.main(["prepare", *flags, flag, "true"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: {flag} true: there is no validation data: give --validation_dataset, --validation_split, or a "
            "--validation_fraction above 0 of --dataset"
        )


@pytest.mark.launcher
def test_the_docs_recipe_measures_the_base_then_the_fine_tune_on_the_shipped_conversations(
    tmp_path: Path,
) -> None:
    """docs/evaluation.md: the baseline (`--validation_only true` on the base), the fine-tune (2 steps here of the
    README's 24), and its checkpoint measured through `./train-singlenode.sh` (dskit.api), equal to the fine-tune's
    own validation at that step (the run file's bf16 ZeRO-3 with LoRA's adapters)."""
    base = save_tiny_qwen3(
        tmp_path / "tiny-base"
    )  # what README's `dskit export checkpoints out/tiny-base` gives
    recipe = ["--model", str(base), "--dataset", str(ASSETS / "tiny_conversations.jsonl"),
              "--chat_template", str(ASSETS / "tiny_chat_template.jinja"), "--seq_length", "256",
              "--validation_batches", "all", "--checkpoint_dir", str(tmp_path / "ck"),
              "--data_cache_dir", str(tmp_path / "cache")]  # fmt: skip
    sft = ["--config", str(REPO / "configs" / "qwen3-0.6b-sft-lora.yaml"), *recipe]
    baseline = train(
        [*sft, "--validation_only", "true", "--metrics_file", str(tmp_path / "base.jsonl")], cwd=tmp_path
    )
    assert step_line.validated_line(0) in baseline and not (tmp_path / "ck" / LEDGER).exists()
    train([*sft, "--max_steps", "2", "--metrics_file", str(tmp_path / "sft.jsonl")], cwd=tmp_path)
    tuned = validations(tmp_path / "sft.jsonl")[2]
    assert tuned["val_loss"] < validations(tmp_path / "base.jsonl")[0]["val_loss"]
    job = f"validation-only-test-{os.getpid()}"
    try:
        result = api.train(
            REPO / "configs" / "qwen3-0.6b-sft-lora.yaml",
            flags=[
                *recipe,
                "--max_steps",
                "2",
                "--validation_only",
                "true",
                "--metrics_file",
                str(tmp_path / "m.jsonl"),
            ],
            on_line=None,
            env={**ENV, "JOB_NAME": job, "GPUS_PER_NODE": "0", "CPU_RANKS": "2"},
        )
    finally:
        for log in (REPO / "logs").glob(f"{job}_*"):
            log.unlink()
    assert (result.final_step, result.checkpoint) == (2, None)
    assert result.validation_loss == pytest.approx(tuned["val_loss"], abs=5e-5)  # the log line's 4 decimals
    print(
        same_measure(
            tuned, validations(tmp_path / "m.jsonl")[2], "the shipped LoRA fine-tune (bf16, ZeRO-3), 2 ranks"
        )
    )
