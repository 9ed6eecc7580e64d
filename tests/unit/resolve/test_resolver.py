"""Bad input: one clear line, a non-zero exit, and nothing on disk touched.

Run through `dskit prepare`, the check the launchers run before any rank starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dskit import cli
from model_utils.assets import CHAT_TEMPLATE_PATH, PREFERENCES_PATH
from support.deepspeed_files import config_with

REPO = Path(__file__).resolve().parents[3]
DS = str(REPO / "deepspeed" / "ds_config.json")
PAIRS = ["--dataset", str(PREFERENCES_PATH), "--chat_template", str(CHAT_TEMPLATE_PATH)]  # the shipped pairs


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def checkpoint_with(
    t: Path,
    hidden_size: int = 64,
    seq_length: int = 256,
    fsdp: bool = False,
    data_fingerprint: str | None = None,
) -> str:
    """A verified checkpoint dir whose saved model config / launch manifest differ from the defaults (fsdp: as
    the FSDP engine saves it; data_fingerprint: trained on data of that content)."""
    from model_utils.config.presets import PRESETS
    from model_utils.storage import file_manifest

    tag = t / "old-run" / "tiny_qwen3-5steps"
    tag.mkdir(parents=True)
    (tag / ("fsdp_client_state.pt" if fsdp else "mp_rank_00_model_states.pt")).write_bytes(b"weights")
    config = PRESETS["tiny-qwen3"].build_config()
    config.hidden_size = hidden_size
    config.save_pretrained(tag / "hf_config")
    launch = {"config": {"data": {"seq_length": seq_length, "dataset": "corpus.jsonl"}}, "world_size": 2}
    if data_fingerprint is not None:
        launch["resolved"] = {"seq_length": seq_length, "data_fingerprint": data_fingerprint}
    (tag / "launch.json").write_text(json.dumps(launch))
    file_manifest.write(tag, file_manifest.build(tag, {"tag": tag.name, "step": 5}))
    return str(tag.parent)


CASES = {
    "missing dataset path": (lambda t: ["--dataset", str(t / "nope")], "does not exist"),
    "no text field": (
        lambda t: ["--dataset", jsonl(t / "d.jsonl", [{"body": "x"}] * 3)],
        "has no field 'text'",
    ),
    "chat messages as the text field": (  # read as conversations (auto), which need a chat template
        lambda t: [
            "--dataset",
            jsonl(t / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3),
            "--text_field",
            "messages",
        ],
        "d.jsonl holds conversations and the tokenizer has no chat template: pass --chat_template FILE",
    ),
    "chat messages as text": (
        lambda t: [
            "--dataset",
            jsonl(t / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3),
            "--text_field",
            "messages",
            "--data_format",
            "text",
        ],
        "d.jsonl holds list values, not text (3 of the first 3 rows): pass --text_field naming a field of plain",
    ),
    "empty dataset": (lambda t: ["--dataset", jsonl(t / "d.jsonl", [])], "is empty"),
    "unknown packing": (
        lambda t: ["--packing", "document"],
        "--packing 'document' is not a packing: did you mean",
    ),
    "fewer tokens than a block": (
        lambda t: ["--dataset", jsonl(t / "d.jsonl", [{"text": "hi"}] * 3), "--validation_fraction", "0"],
        "fewer than one block",
    ),
    # The validation data's own name and fix, not the training file's (#29).
    "an empty validation dataset": (
        lambda t: [
            "--dataset",
            jsonl(t / "train.jsonl", [{"text": "hello " * 4000}]),
            "--validation_dataset",
            jsonl(t / "val.jsonl", [{"text": ""}]),
        ],
        "error: validation data of --validation_dataset {t}/val.jsonl has 0 tokens, fewer than one block of",
    ),
    "a held-out fraction under one block": (
        lambda t: [
            "--dataset",
            jsonl(t / "train.jsonl", [{"text": "hello " * 400}] * 3),
            "--validation_fraction",
            "0.01",
        ],
        "validation data held out of {t}/train.jsonl (--validation_fraction 0.01) has 0 tokens",
    ),
    "invalid json config": (
        lambda t: ["--deepspeed_config", str((t / "ds.json").write_text("{") and t / "ds.json")],
        "not valid JSON",
    ),
    "unknown deepspeed key": (
        lambda t: [
            "--deepspeed_config",
            str((t / "ds.json").write_text('{"zero_optimisation": {}}') and t / "ds.json"),
        ],
        "unknown key 'zero_optimisation'",
    ),
    "unknown preset": (lambda t: ["--model", "tiny-qwen9"], "unknown model 'tiny-qwen9'"),
    "missing model path": (lambda t: ["--model", str(t / "model")], "does not exist"),
    "seq_length too long": (lambda t: ["--seq_length", "4096"], "above the model's maximum positions (256)"),
    "checkpoint dir not writable": (
        lambda t: ["--checkpoint_dir", str((t / "file").write_text("x") and t / "file")],
        "is not writable",
    ),
    "resume from a dir without checkpoints": (
        lambda t: ["--resume_from_checkpoint", str(t)],
        "holds no verified checkpoint",
    ),
    "unknown flag": (lambda t: ["--checkpoint_frequency", "5"], "did you mean --checkpoint_freq?"),
    "zero frequency": (lambda t: ["--checkpoint_freq", "0"], "must be at least 1"),
    "negative frequency": (lambda t: ["--validation_freq", "-5"], "--validation_freq -5 must be at least 1"),
    "keep no checkpoints": (lambda t: ["--keep_checkpoints", "0"], "--keep_checkpoints 0 must be at least 1"),
    "negative time interval": (lambda t: ["--checkpoint_interval_minutes", "-1"], "must be positive"),
    "malformed s3 uri": (lambda t: ["--s3_checkpoint_uri", "http://bucket/x"], "is not an S3 URI"),
    "s3 uri without bucket": (lambda t: ["--s3_checkpoint_uri", "s3:///x"], "is not an S3 URI"),
    "model config mismatch": (
        lambda t: ["--checkpoint_dir", checkpoint_with(t, hidden_size=128)],
        "has hidden_size=128 but the model now has hidden_size=64",
    ),
    "sequence length mismatch": (
        lambda t: ["--checkpoint_dir", checkpoint_with(t, seq_length=128)],
        "was trained with --seq_length 128, not 256",
    ),
    "profile steps backwards": (lambda t: ["--profile_steps", "5:3"], "must be A:B with 1 <= A <= B"),
    "profile steps from 0": (lambda t: ["--profile_steps", "0:3"], "must be A:B with 1 <= A <= B"),
    "profile steps not numbers": (lambda t: ["--profile_steps", "a:b"], "is not A:B"),
    "profile steps one number": (lambda t: ["--profile_steps", "5"], "is not A:B"),
    "profile steps beyond the run": (
        lambda t: ["--profile_steps", "8:12", "--max_steps", "10"],
        "ends after the run's last step 10",
    ),
    "sample prompts file missing": (
        lambda t: ["--sample_prompts", str(t / "prompts.txt")],
        "prompts.txt: cannot read it (No such file or directory): fix: name a prompts file",
    ),
    "sample prompts file empty": (
        lambda t: ["--sample_prompts", str((t / "p.jsonl").write_text("\n") and t / "p.jsonl")],
        "p.jsonl holds no prompts: fix: give at least one prompt, or drop --sample_prompts",
    ),
    "sample prompt too long": (
        lambda t: ["--sample_prompts", '["Once upon a time"]', "--sample_max_new_tokens", "253"],
        "prompt 1 has 4 tokens, and with --sample_max_new_tokens 253 it must fit the sequence length 256",
    ),
    "unknown backend": (
        lambda t: ["--backend", "fsdp2"],
        "--backend 'fsdp2' is not a training engine: did you mean fsdp?",
    ),
    "ZeRO section under fsdp": (
        lambda t: [
            "--backend",
            "fsdp",
        ],  # the test adds --deepspeed_config: the kit's ZeRO-2 + offload config
        "zero_optimization in",
    ),
    "fp16 under fsdp": (
        lambda t: [
            "--backend",
            "fsdp",
            "--deepspeed_config",
            config_with(t, zero_optimization=None, bf16=None, fp16={"enabled": True}),
        ],
        "--backend fsdp has no loss scaler",
    ),
    "DeepSpeed-only key under fsdp": (
        lambda t: [
            "--backend",
            "fsdp",
            "--deepspeed_config",
            config_with(t, zero_optimization=None, activation_checkpointing={"partition_activations": True}),
        ],
        "activation_checkpointing in",
    ),
    "fsdp offload under deepspeed": (
        lambda t: ["--fsdp_cpu_offload", "true"],
        "--fsdp_cpu_offload applies to --backend fsdp only",
    ),
    "fsdp checkpoint resumed under deepspeed": (
        lambda t: ["--checkpoint_dir", checkpoint_with(t, seq_length=256, fsdp=True)],
        "was saved by --backend fsdp, not deepspeed",
    ),
    "resume on other data": (
        lambda t: ["--checkpoint_dir", checkpoint_with(t, data_fingerprint="0" * 16)],
        "tiny_qwen3-5steps was trained on other data (corpus.jsonl, content 0000000000000000) than --dataset "
        "embedded (content ",
    ),
    "unknown spike guard mode": (lambda t: ["--spike_guard", "rollbak"], "did you mean rollback?"),
    "spike sigma zero": (lambda t: ["--spike_sigma", "0"], "--spike_sigma 0.0 must be positive"),
    "spike window of one step": (lambda t: ["--spike_window", "1"], "must be at least 2 steps"),
    "no rollbacks allowed": (lambda t: ["--max_rollbacks", "0", "--spike_guard", "rollback"], "at least 1"),
    "guard flags with the guard off": (
        lambda t: ["--spike_guard", "off", "--spike_sigma", "4"],
        "--spike_sigma do not apply to --spike_guard off: drop them",
    ),
    "rollback flags without rollback": (
        lambda t: ["--rollback_skip_steps", "5"],
        "--rollback_skip_steps do not apply to --spike_guard skip: drop them or use --spike_guard rollback",
    ),
    "spike guard where DeepSpeed cannot discard": (
        lambda t: [
            "--deepspeed_config",
            config_with(t, bf16=None, zero_optimization={"stage": 0}),
            "--spike_guard",
            "skip",
        ],
        "DeepSpeed applies non-finite gradients in fp32 without ZeRO",
    ),
    "load_universal in the DeepSpeed config": (
        lambda t: ["--deepspeed_config", config_with(t, checkpoint={"load_universal": True})],
        "checkpoint.load_universal in",
    ),
    "a preference objective on text": (
        lambda t: ["--objective", "dpo"],
        "--objective dpo trains on preference pairs, and embedded is not (rows with 'chosen' and 'rejected'",
    ),
    "preference pairs under the next-token loss": (
        lambda t: [*PAIRS],  # a copy: the test adds to it
        "tiny_preferences.jsonl holds preference pairs and --objective is lm (the next-token loss): pass --objective "
        "dpo or simpo",
    ),
    "preference pairs split across ranks": (
        lambda t: [
            *PAIRS,
            "--objective",
            "dpo",
            "--sequence_parallel",
            "2",
            "--seq_length",
            "64",
        ],
        "preference pairs are not split across ranks: drop --sequence_parallel",
    ),
    "parent run without mlflow": (
        lambda t: ["--mlflow_parent_run_id", "0" * 32, "--report_to", "tensorboard"],
        "--mlflow_parent_run_id is for MLflow",
    ),
    "parent run without a store": (
        lambda t: [
            "--mlflow_parent_run_id",
            "0" * 32,
            "--report_to",
            "mlflow",
            "--report_dir",
            str(t / "logs"),
        ],
        "there is no MLflow store at sqlite:///",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_flags, message = CASES[case]
    flags = make_flags(tmp_path)
    ckpt = tmp_path / "ckpts"
    ckpt.mkdir()
    (ckpt / "keep.txt").write_text("precious")
    if "--checkpoint_dir" not in flags:
        flags += ["--checkpoint_dir", str(ckpt)]
    if "--deepspeed_config" not in flags:
        flags += ["--deepspeed_config", DS]
    before = snapshot(tmp_path)
    assert cli.main(["prepare", "--data_cache_dir", str(tmp_path / "cache"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ") and message.replace("{t}", str(tmp_path)) in err[0], err[0]
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if "/cache/" not in k} == before  # nothing on disk touched


@pytest.mark.parametrize(("max_steps", "where"), [("5", "at"), ("3", "past")])
def test_a_run_whose_checkpoint_is_at_max_steps_is_complete_not_an_error(
    tmp_path: Path, capsys, monkeypatch, max_steps: str, where: str
) -> None:
    """A resume at or past --max_steps trains nothing: the run is complete (a relaunch of a finished run, a SLURM
    requeue after its final save), said in one line, not an error: the preflight exits COMPLETE (the launchers
    then start no rank, exit 0) and `dskit config` shows the run it would resume."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flags = [
        "--checkpoint_dir",
        checkpoint_with(tmp_path),
        "--max_steps",
        max_steps,
        "--deepspeed_config",
        DS,
    ]
    flags += ["--data_cache_dir", str(tmp_path / "cache")]
    line = (
        f"run complete: {tmp_path}/old-run/tiny_qwen3-5steps is at step 5, {where} --max_steps {max_steps}: "
        "nothing to train (raise --max_steps to continue it, or pass a new --checkpoint_dir to start another run)"
    )
    assert cli.main(["prepare", *flags]) == 0
    assert line in capsys.readouterr().out.splitlines()
    assert cli.main(["config", *flags]) == 0
    printed = capsys.readouterr()
    assert line in printed.err.splitlines() and json.loads(printed.out)["config"]["loop"]["max_steps"] == int(
        max_steps
    )


def test_a_resume_on_other_data_goes_ahead_with_new_data_and_the_same_data_anywhere_is_no_change(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """--new_data true lets the preflight through (the ranks reset the data position and say so); the embedded
    data's own fingerprint, recorded as a run of it would, is no change at all."""
    from model_utils.data import token_shards

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = ["--data_cache_dir", str(tmp_path / "cache"), "--deepspeed_config", DS, "--max_steps", "8"]
    other = checkpoint_with(tmp_path / "other", data_fingerprint="0" * 16)
    assert cli.main(["prepare", *cache, "--checkpoint_dir", other, "--new_data", "true"]) == 0
    capsys.readouterr()
    assert cli.main(["config", *cache, "--checkpoint_dir", other, "--new_data", "true"]) == 0
    fingerprint = json.loads(capsys.readouterr().out)["resolved"]["data_fingerprint"]
    manifest = next((tmp_path / "cache" / "prepared").glob("*/manifest.json"))
    assert fingerprint == token_shards.content_fingerprint(json.loads(manifest.read_text()))
    same = checkpoint_with(tmp_path / "same", data_fingerprint=fingerprint)
    assert cli.main(["prepare", *cache, "--checkpoint_dir", same]) == 0


def test_bad_input_from_the_real_command(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dskit.cli", "prepare", "--model", "tiny-qwen9"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown model 'tiny-qwen9': not a preset (tiny-qwen3, qwen3-0.6b), not a local directory, "
        "and not a hub id of the form org/name"
    ]


S3_CASES = {
    "missing bucket": (
        "s3",
        "--s3_checkpoint_uri",
        "s3://no-such-bucket/run",
        "S3 bucket no-such-bucket does not exist",
    ),
    "access denied": (
        "s3_denied",
        "--s3_checkpoint_uri",
        "s3://dskit-locked/run",
        "no access to S3 bucket dskit-locked",
    ),
    "empty s3 dataset": ("s3", "--dataset", "{bucket}/nothing-here", "no objects"),
}


@pytest.mark.parametrize("case", list(S3_CASES))
def test_bad_s3_input(case: str, tmp_path: Path, capsys, monkeypatch, request) -> None:
    """Against a real S3 endpoint on loopback (moto's server): one line, exit 2, nothing touched."""
    fixture, flag, value, message = S3_CASES[case]
    env = request.getfixturevalue(fixture)
    if "{bucket}" in value:
        value = value.format(bucket=env.uri())
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpts"
    ckpt.mkdir()
    (ckpt / "keep.txt").write_text("precious")
    before = snapshot(tmp_path)
    flags = [flag, value, "--checkpoint_dir", str(ckpt), "--data_cache_dir", str(tmp_path / "cache")]
    assert cli.main(["prepare", "--deepspeed_config", DS, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert {k: v for k, v in snapshot(tmp_path).items() if "/cache/" not in k} == before


def test_config_of_a_resume_with_another_max_steps_keeps_the_warmup_and_says_what_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint ran 8 steps warming up over 4 (--warmup_ratio 0.5); `dskit config` of its resume with
    --max_steps 12 keeps that warm-up (not 6) and shows the line the ranks print."""
    from model_utils.storage import file_manifest
    from support.checkpoint_tags import fake_tag

    tag = fake_tag(tmp_path / "ckpt", 4, with_manifest=False)
    resolved = {"seq_length": 64, "max_steps": 8, "warmup_steps": 4}
    launch = {"config": {"data": {"seq_length": 64}}, "resolved": resolved, "world_size": 1}
    (tag / "launch.json").write_text(json.dumps(launch))
    file_manifest.write(tag, file_manifest.build(tag, {"tag": tag.name, "step": 4}))
    flags = ["--lr_schedule", "linear", "--warmup_ratio", "0.5", "--lr", "1.0", "--seq_length", "64"]
    places = ["--checkpoint_dir", str(tmp_path / "ckpt"), "--data_cache_dir", str(tmp_path / "cache")]
    assert cli.main(["config", *flags, *places, "--max_steps", "12"]) == 0
    shown = json.loads(capsys.readouterr().out)["resolved"]
    assert shown["warmup_steps"] == 4 and shown["resume_from"] == str(tag)
    # Step 5, the first of the linear decay to 0.1 x peak: 1 of 4 decay steps before, 1 of 8 now.
    assert shown["schedule_change"] == (
        "lr schedule: --max_steps 12 (was 8): warm-up kept at 4 steps (the flags now give 6); the decay now ends "
        "at step 12; lr at step 5 0.775 -> 0.887"
    )


def test_packing_documents_gives_rows_whose_documents_end_at_the_tokenizers_eos(
    tmp_path: Path, monkeypatch
) -> None:
    """--packing documents (a run-file key too): the resolved run keeps documents apart, its blocks restart the
    positions after each EOS the preparation appended; the default stream answers tokens only."""
    import numpy as np

    from model_utils.config.arguments import parse_args
    from model_utils.resolve import resolver

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_file = tmp_path / "run.yaml"
    run_file.write_text("data: {packing: documents, seq_length: 64}\n")
    common = ["--data_cache_dir", str(tmp_path / "cache"), "--deepspeed_config", DS, "--max_steps", "2"]
    documents = resolver.prepare(parse_args(["--config", str(run_file), *common]), world_size=1)
    stream = resolver.prepare(parse_args([*common, "--seq_length", "64"]), world_size=1)
    assert documents.documents_apart and not stream.documents_apart
    assert documents.to_dict()["resolved"]["documents_apart"] is True
    eos = documents.tokenizer.eos_token_id
    rows = documents.train_blocks.rows(np.arange(4))
    assert rows.positions is not None and rows.targets is not None
    ends = np.argwhere(rows.tokens[:, :-1] == eos)
    assert len(ends) > 0, "the embedded corpus's documents are shorter than 4 blocks"
    for row, column in ends:
        assert rows.positions[row, column + 1] == 0 and not rows.targets[row, column + 1]
    assert np.array_equal(stream.train_blocks.rows(np.arange(4)).tokens, rows.tokens)
    assert stream.train_blocks.rows(np.arange(4)).positions is None


def test_only_a_run_that_may_prepare_chat_data_keeps_chat_templates_importable(tmp_path: Path) -> None:
    from model_utils.config.arguments import parse_args
    from model_utils.resolve.resolver import may_render_chat_templates

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    assert not may_render_chat_templates(parse_args([]))  # the embedded corpus: a lean rank
    assert not may_render_chat_templates(parse_args(["--dataset", str(chats), "--data_format", "text"]))
    assert may_render_chat_templates(parse_args(["--dataset", str(chats)]))  # auto: it may hold conversations
    assert may_render_chat_templates(parse_args(["--data_format", "messages", "--dataset", str(chats)]))


def test_the_shipped_sft_run_file_serves_prepared_conversations(tmp_path: Path, capsys, monkeypatch) -> None:
    """configs/qwen3-0.6b-sft-lora.yaml on a dataset prepared with `dskit prepare-data`: the run file's data
    settings that the preparation fixed are ignored with one line (no flag could drop a run-file key), and the run
    resolves with the preparation's template."""
    from dskit import prepare_data
    from model_utils.assets import ASSETS_DIR
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import resolver
    from support.pretrained import save_tiny_qwen3

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = save_tiny_qwen3(tmp_path / "tiny-base")
    chats, template = ASSETS_DIR / "tiny_conversations.jsonl", ASSETS_DIR / "tiny_chat_template.jinja"
    prepared = tmp_path / "chats"
    args = [
        "--dataset",
        str(chats),
        "--chat_template",
        str(template),
        "--model",
        str(base),
        "--num_proc",
        "1",
    ]
    assert prepare_data.main([str(prepared), *args]) == 0
    capsys.readouterr()
    sft = str(REPO / "configs" / "qwen3-0.6b-sft-lora.yaml")
    cfg = parse_args(["--config", sft, "--model", str(base), "--dataset", str(prepared), "--seq_length", "256",
                      "--checkpoint_dir", str(tmp_path / "ck"), "--data_cache_dir", str(tmp_path / "cache")])  # fmt: skip
    run = resolver.prepare(cfg)
    assert run.tokenizer.chat_template == template.read_text()
    said = capsys.readouterr().out
    assert (
        f"Data: data.validation_fraction (run file {sft}) and data.data_format (run file {sft}) apply when data is "
        f"prepared, and {prepared} is prepared already: ignored (it keeps the settings `dskit prepare-data` gave it)"
    ) in said, said


def test_a_dpo_run_counts_both_sequences_of_each_pair(tmp_path: Path, capsys, monkeypatch) -> None:
    """Pairs: the micro batch counts pairs, each two rows of seq_length (tokens per step, the layout line); the
    split's line says how many pairs were cut or dropped; micro batch auto is 1 pair."""
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import resolver

    monkeypatch.chdir(tmp_path)
    flags = [*PAIRS, "--objective", "dpo"]
    flags += ["--seq_length", "32", "--micro_batch_size", "auto", "--gradient_accumulation_steps", "3"]
    flags += ["--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ck")]
    run = resolver.prepare(parse_args([*flags, "--max_steps", "2"]), world_size=2)
    assert run.paired and run.micro_batch_size == 1 and run.tokens_per_step == 1 * 3 * 2 * 2 * 32
    said = capsys.readouterr().out
    assert (
        "--micro_batch_size auto: 1 pair (its chosen and rejected sequences) under a preference objective"
        in said
    )
    assert (
        "batch layout (micro batch of pairs x accumulation x ranks x 2 sequences x seq = tokens/step): 1 x 3 x 2 x 2 x 32 = 384"
        in said
    )
    assert re.search(
        r"Data: \d+ pairs \(train\); \d+ truncated to --seq_length 32 \(keep_start\), \d+ dropped", said
    ), said
