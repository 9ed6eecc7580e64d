"""Run files (--config RUN.yaml): sections onto the typed config, the embedded DeepSpeed config, YAML 1.1
numbers, flags over the file, strict keys, `dskit config --format yaml` fed back unchanged, the shipped configs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from dskit import cli
from model_utils.assets import CHAT_TEMPLATE_PATH, PREFERENCES_PATH
from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.resolve import resolver, train_settings

REPO = Path(__file__).resolve().parents[3]


def scratch_dirs(tmp_path: Path) -> list[str]:
    """The data cache and checkpoint dirs of a `dskit config` run, under tmp_path."""
    return ["--data_cache_dir", str(tmp_path / "c"), "--checkpoint_dir", str(tmp_path / "ck")]


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_sections_fill_the_config_and_flags_override_them(tmp_path: Path) -> None:
    run = write(
        tmp_path / "run.yaml",
        "model: {model: tiny-qwen3}\ndata: {seq_length: 128, validation_fraction: 0.1}\n"
        "optim: {lr: 1e-4, gradient_accumulation_steps: 4}\nloop: {epochs: 2, seed: null}\n",
    )
    cfg = parse_args(["--config", run])
    assert (cfg.data.seq_length, cfg.data.validation_fraction) == (128, 0.1)
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)  # YAML 1.1 reads 1e-4 as a string
    assert cfg.loop.epochs == 2 and cfg.loop.seed == 42  # null: not given, the default
    assert {"seq_length", "lr", "epochs"} <= cfg.explicit and "seed" not in cfg.explicit
    over = parse_args(["--config", run, "--lr", "3e-4", "--max_steps", "9"])
    # A flag overrides the file; one of a pair (epochs/max_steps) replaces the file's other member.
    assert over.optim.lr == 3e-4 and over.loop.max_steps == 9 and over.loop.epochs is None
    assert over.optim.gradient_accumulation_steps == 4


def test_embedded_deepspeed_config_is_used_with_numbers_as_numbers(tmp_path: Path) -> None:
    run = write(
        tmp_path / "run.yaml",
        "deepspeed:\n  train_micro_batch_size_per_gpu: auto\n  gradient_accumulation_steps: auto\n"
        "  optimizer: {type: AdamW, params: {lr: auto, eps: 1e-8, weight_decay: 0.1}}\n"
        "  zero_optimization: {stage: 3, reduce_bucket_size: 5e8, stage3_param_persistence_threshold: 0}\n"
        "  bf16: {enabled: true}\n",
    )
    cfg = parse_args(["--config", run])
    settings = train_settings.resolve(cfg)
    built = settings.deepspeed_json(micro_batch_size=1, total_steps=10)
    assert settings.zero_stage == 3 and settings.path == f"the run file {run}'s deepspeed section"
    assert built["zero_optimization"]["reduce_bucket_size"] == 500_000_000  # an int, not '5e8'
    assert (
        built["optimizer"]["params"]["eps"] == 1e-8
        and built["optimizer"]["params"]["lr"] == settings.optim.lr
    )
    # --deepspeed_config on the command line replaces the embedded config.
    flagged = parse_args(["--config", run, "--deepspeed_config", "deepspeed/ds_config.json"])
    assert flagged.deepspeed_inline is None and train_settings.resolve(flagged).zero_stage == 2
    named = parse_args(
        ["--config", write(tmp_path / "n.yaml", "deepspeed: deepspeed/ds_config_zero3.json\n")]
    )
    assert named.optim.deepspeed_config == "deepspeed/ds_config_zero3.json"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("optim: {lrr: 1e-4}\n", r"unknown key optim\.lrr: did you mean optim\.lr\?"),
        ("data: {lr: 1e-4}\n", r"data\.lr is not a data key: it belongs in optim \(optim\.lr\)"),
        ("lr: 1e-4\n", r"lr is a key of section optim: write it there \(optim\.lr\)"),
        ("optimm: {lr: 1}\n", r"unknown section 'optimm': did you mean optim\?"),
        ("- model\n- data\n", r"holds a list, not a mapping of sections"),
        ("deepspeed: 3\n", r"deepspeed is a int: give a mapping .* or the path of a DeepSpeed JSON file"),
        ("loop: {max_steps: ten}\n", r"loop\.max_steps: 'ten' is not a valid int"),
        ("loop: {max_steps: 2.5}\n", r"loop\.max_steps: 2\.5 is not a valid int"),
        ("model: {compile: yes please}\n", r"model\.compile: 'yes please' is not a valid bool"),
        ("optim: [1, 2]\n", r"section optim is a list, not a mapping"),
        ("model: {model: x\n", r"run\.yaml:2: run file is not valid YAML: .*: fix: correct the YAML there"),
    ],
)
def test_bad_run_files_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        parse_args(["--config", write(tmp_path / "run.yaml", text)])
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("value", "expected"), [("all", "all"), ("3", 3), ("'4'", 4)])
def test_validation_batches_in_a_run_file_is_a_count_or_all(
    tmp_path: Path, value: str, expected: object
) -> None:
    path = write(tmp_path / "run.yaml", f"loop: {{validation_batches: {value}}}\n")
    assert parse_args(["--config", path]).loop.validation_batches == expected


def test_a_validation_batches_word_other_than_all_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path / "run.yaml", "loop: {validation_batches: most}\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", path])
    assert str(err.value) == (
        f"run file {path}: loop.validation_batches: 'most' is not a valid int or 'all': fix the value"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # The last key would win: a repeated section drops the first (max_steps 5 became 100).
        (
            "loop: {max_steps: 5}\noptim: {lr: 1e-4}\nloop: {seed: 1}\n",
            r"run\.yaml:3: key 'loop' is given twice \(first at line 1; the last would silently win\): fix: keep one",
        ),
        ("optim:\n  lr: 1e-4\n  lr: 2e-4\n", r"run\.yaml:3: key 'lr' is given twice"),
        (
            "deepspeed:\n  bf16: {enabled: true, enabled: false}\n",
            r"run\.yaml:2: key 'enabled' is given twice",
        ),
        ("optim: {lr: .inf}\n", r"run\.yaml:1: '\.inf' is not a finite number: fix: give a finite value"),
        ("optim:\n  lr: .nan\n", r"run\.yaml:2: '\.nan' is not a finite number"),
        ("loop: {max_steps: 1e30}\n", r"run\.yaml:1: 1e30 is past the largest number a run takes \(1e\+15\)"),
        (
            "loop: {max_steps: 10000000000000000000}\n",
            r"run\.yaml:1: 10000000000000000000 is past the largest",
        ),
        (
            "deepspeed:\n  zero_optimization: {reduce_bucket_size: 1.0e400}\n",
            r"run\.yaml:2: .* not a finite number",
        ),
        ("optim: {lr: inf}\n", r"optim\.lr: inf is not a finite number up to 1e\+15: fix the value"),
        ("optim: {lr: 'nan'}\n", r"optim\.lr: nan is not a finite number"),
        ("a: &a [*a]\n", r"run\.yaml:1: an alias refers to itself"),
    ],
)
def test_strict_yaml_is_one_line_with_the_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        parse_args(["--config", write(tmp_path / "run.yaml", text)])
    assert "\n" not in str(raised.value)


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    # Nine levels of ten aliases: 10^9 values if expanded (the run grew to 3 GB and never finished).
    lines = ["deepspeed:", "  a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for level, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[level]
        lines.append(f"  {name}: &{name} [{', '.join(['*' + prev] * 10)}]")
    path = write(tmp_path / "run.yaml", "\n".join(lines) + "\n")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"run\.yaml:6: its aliases expand to more than 100,000 values"):
        parse_args(["--config", path])
    assert time.perf_counter() - started < 5
    # A few aliases, as real files use them, still load.
    fine = write(tmp_path / "ok.yaml", "optim: &o {lr: 1e-4}\n")
    assert parse_args(["--config", fine]).optim.lr == 1e-4


def test_bytes_that_are_not_utf8_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(b"model: {model: tiny-qwen3}\n# caf\xe9\n")
    with pytest.raises(ConfigError) as raised:
        parse_args(["--config", str(path)])
    assert str(raised.value) == f"{path}:2: run file is not UTF-8 text (byte 0xe9): fix: save it as UTF-8"


def test_missing_run_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run file .*nope.yaml not found: check --config"):
        parse_args(["--config", str(tmp_path / "nope.yaml")])


def resolved(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert cli.main(["config", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_config_as_yaml_feeds_back_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = scratch_dirs(tmp_path)
    flags = [
        "--config",
        str(REPO / "configs" / "zero3-offload.yaml"),
        "--seq_length",
        "64",
        "--warmup_ratio",
        "0.1",
    ]
    assert cli.main(["config", "--format", "yaml", *flags, *common]) == 0
    dumped = capsys.readouterr().out
    path = write(tmp_path / "dumped.yaml", dumped)
    original = resolved(capsys, *flags, *common)
    again = resolved(capsys, "--config", path)
    assert again["resolved"] == original["resolved"] and again["deepspeed"] == original["deepspeed"]
    assert cli.main(["config", "--config", path, "--format=yaml"]) == 0  # anywhere, either spelling
    assert capsys.readouterr().out == dumped  # a fixed point


def test_the_sample_flags_feed_back_with_their_prompts_and_are_null_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [*scratch_dirs(tmp_path), "--format", "yaml"]
    prompts = str(REPO / "examples" / "sample_prompts.jsonl")
    assert cli.main(["config", "--sample_prompts", prompts, "--sample_every", "100", *common]) == 0
    dumped = capsys.readouterr().out
    report = parse_args(["--config", write(tmp_path / "with.yaml", dumped)]).report
    assert (report.sample_prompts, report.sample_every, report.sample_max_new_tokens) == (prompts, 100, 32)
    assert cli.main(["config", *common]) == 0
    dumped = yaml.safe_load(capsys.readouterr().out)["report"]
    assert dumped["sample_prompts"] is dumped["sample_every"] is dumped["sample_max_new_tokens"] is None


def test_the_objective_flags_feed_back_with_their_objective_and_are_null_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dskit config shows the settings a preference objective trains with (TRL's defaults included); those another
    objective does not read are null, so the dump feeds back without a refusal."""
    pairs = [
        "--dataset",
        str(PREFERENCES_PATH),
        "--chat_template",
        str(CHAT_TEMPLATE_PATH),
        "--seq_length",
        "64",
    ]
    common = [*scratch_dirs(tmp_path), "--format", "yaml"]
    assert cli.main(["config", *pairs, "--objective", "dpo", "--loss_type", "robust", *common]) == 0
    dumped = capsys.readouterr().out
    assert yaml.safe_load(dumped)["objective"] == {
        "objective": "dpo", "beta": 0.1, "loss_type": "robust", "label_smoothing": 0.0, "simpo_gamma": None,
    }  # fmt: skip
    assert parse_args(["--config", write(tmp_path / "dpo.yaml", dumped)]).objective.loss_type == "robust"
    assert cli.main(["config", *common]) == 0
    dumped = capsys.readouterr().out
    assert set(yaml.safe_load(dumped)["objective"].values()) == {"lm", None}
    assert parse_args(["--config", write(tmp_path / "lm.yaml", dumped)]).objective.objective == "lm"


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_each_backends_dump_feeds_back(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The config each backend reads (fsdp: deepspeed/fsdp.json) is the one embedded; flags only one backend
    reads are null under the other."""
    common = scratch_dirs(tmp_path)
    assert cli.main(["config", "--backend", backend, "--format", "yaml", *common]) == 0  # among the flags
    path = write(tmp_path / "dumped.yaml", capsys.readouterr().out)
    original = resolved(capsys, "--backend", backend, *common)
    again = resolved(capsys, "--config", path)
    assert again["resolved"] == original["resolved"] and again["deepspeed"] == original["deepspeed"]
    assert ("zero_optimization" in again["deepspeed"]) is (backend == "deepspeed")


def test_shipped_run_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = scratch_dirs(tmp_path)
    default = resolved(capsys, "--config", str(REPO / "configs" / "pretrain-default.yaml"), *common)
    plain = resolved(capsys, *common)
    assert default["resolved"] == plain["resolved"] and default["deepspeed"] == plain["deepspeed"]
    zero3 = resolved(capsys, "--config", str(REPO / "configs" / "zero3-offload.yaml"), *common)
    zero = zero3["deepspeed"]["zero_optimization"]
    assert (
        zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    )
    assert zero3["resolved"]["lr"] == 3e-4


def test_the_lora_run_file_resolves_with_local_model_and_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/qwen3-0.6b-lora.yaml as shipped names the hub model and the user's files; with a local
    "pretrained" model and local parquet files (flags override the file) it resolves: LoRA checks, the separate
    validation file, epochs, warm-up ratio, the embedded ZeRO-3 config."""
    import datasets

    from support.pretrained import save_tiny_qwen3

    model = save_tiny_qwen3(tmp_path / "model")
    for name in ("train", "valid"):
        datasets.Dataset.from_dict({"text": [f"{name} document {i} " * 40 for i in range(40)]}).to_parquet(
            str(tmp_path / f"{name}.parquet")
        )
    shipped = parse_args(["--config", str(REPO / "configs" / "qwen3-0.6b-lora.yaml")])
    assert shipped.model.model == "Qwen/Qwen3-0.6B" and shipped.lora.lora_r == 16 and shipped.loop.epochs == 3
    run = resolved(
        capsys,
        "--config", str(REPO / "configs" / "qwen3-0.6b-lora.yaml"),
        "--model", str(model), "--dataset", str(tmp_path / "train.parquet"),
        "--validation_dataset", str(tmp_path / "valid.parquet"), "--seq_length", "64",
        "--report_to", "none", "--data_cache_dir", str(tmp_path / "c"), "--checkpoint_dir", str(tmp_path / "ck"),
    )  # fmt: skip
    assert run["resolved"]["zero_stage"] == 3 and run["resolved"]["validation_blocks"] > 0
    assert run["config"]["lora"]["lora_target_modules"] == "q_proj,k_proj,v_proj,o_proj"


# --- the run file of docs/flags.md, as a reader copies it -------------------------------------------------------

# Only what this machine cannot have: the hub model (no downloads in tests) and its sequence length (the tiny
# stand-in's positions stop at 256).
DOC_STANDINS = {"{model: Qwen/Qwen3-0.6B}": "{model: tiny-qwen3}", "seq_length: 1024": "seq_length: 256"}


def test_the_run_file_of_the_flags_doc_resolves(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "flags.md").read_text()
    section = doc[doc.index("## Run files: `--config RUN.yaml`") :]
    example = section[section.index("```yaml\n") + len("```yaml\n") : section.index("```\n", 1)]
    for shown, standin in DOC_STANDINS.items():
        assert shown in example, f"docs/flags.md's run file no longer has {shown}: update DOC_STANDINS"
        example = example.replace(shown, standin)
    run = write(tmp_path / "run.yaml", example)
    settings = resolver.resolve_settings(parse_args(["--config", run]))
    ts = settings.train
    assert (ts.optim.lr, ts.schedule.warmup_ratio, ts.schedule.kind, ts.zero_stage) == (
        2e-5,
        0.03,
        "cosine",
        3,
    )
    assert ts.gradient_accumulation_steps == 8 and settings.config.loop.epochs == 3
    assert ts.schedule.warmup_for(1000) == 30


# --- every message about a setting says where its value came from ------------------------------------------------

NO_SCHEDULER = "deepspeed:\n  optimizer: {type: AdamW, params: {lr: auto}}\n"


def test_a_run_file_value_is_named_by_its_key_and_file_in_messages(tmp_path: Path) -> None:
    run = write(tmp_path / "run.yaml", "optim: {warmup_ratio: 0.03}\n" + NO_SCHEDULER)
    cfg = parse_args(["--config", run])
    assert cfg.origin_of("warmup_ratio") == f"run file {run}" and cfg.origin_of("lr") == "default"
    with pytest.raises(ConfigError) as err:
        train_settings.resolve(cfg)
    assert str(err.value) == (
        f"optim.warmup_ratio (run file {run}) does not apply to the run file {run}'s deepspeed section, which has "
        "no scheduler (no warm-up): drop it"
    )
    bad = write(tmp_path / "bad.yaml", "model: {liger: maybe}\n")  # a section's own check
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", bad])
    assert str(err.value) == f"model.liger (run file {bad}) 'maybe' is not one of auto, on, off"
    with pytest.raises(ConfigError, match=r"^--liger 'maybe' is not one of"):
        parse_args(["--config", bad, "--liger", "maybe"])
    long = write(tmp_path / "long.yaml", "data: {seq_length: 1024}\n")  # a check deep in resolution
    with pytest.raises(ConfigError) as err:
        resolver.resolve_settings(parse_args(["--config", long]))
    assert str(err.value).startswith(f"data.seq_length (run file {long}) 1024 is above the model's maximum")
    with pytest.raises(ConfigError, match=r"^--seq_length 1024 is above the model's maximum"):
        resolver.resolve_settings(parse_args(["--config", long, "--seq_length", "1024"]))
    both = write(tmp_path / "both.yaml", "optim: {warmup_ratio: 0.03, warmup_steps: 5}\n")
    with pytest.raises(
        ConfigError, match=r"^optim.warmup_steps \(run file .*both.yaml\) and optim.warmup_ratio"
    ):
        parse_args(["--config", both])


def test_a_flag_value_is_named_as_the_flag_even_beside_a_run_file(tmp_path: Path) -> None:
    run = write(tmp_path / "run.yaml", "optim: {warmup_ratio: 0.03}\n" + NO_SCHEDULER)
    cfg = parse_args(["--config", run, "--warmup_ratio", "0.05"])  # the flag overrides the file's value
    assert cfg.origin_of("warmup_ratio") == "flag" and cfg.setting("warmup_ratio") == "--warmup_ratio"
    with pytest.raises(ConfigError) as err:
        train_settings.resolve(cfg)
    assert str(err.value) == (
        f"--warmup_ratio does not apply to the run file {run}'s deepspeed section, which has no scheduler (no "
        "warm-up): drop it"
    )


def test_a_deepspeed_section_without_an_optimizer_is_refused_naming_the_run_file(tmp_path: Path) -> None:
    """The run file docs/flags.md showed before: its lr is the run file's, and the message says so; without
    the lr, the section that cannot train is refused (DeepSpeed would fail at the first step)."""
    body = "deepspeed:\n  zero_optimization: {stage: 3}\n"
    run = write(tmp_path / "run.yaml", "optim: {lr: 2.0e-5}\n" + body)
    with pytest.raises(ConfigError) as err:
        train_settings.resolve(parse_args(["--config", run]))
    assert str(err.value) == (
        f"optim.lr (run file {run}) given but the run file {run}'s deepspeed section has no 'optimizer' section: "
        "add one or drop optim.lr"
    )
    bare = write(tmp_path / "bare.yaml", body)
    with pytest.raises(ConfigError) as err:
        train_settings.resolve(parse_args(["--config", bare]))
    said = str(err.value)
    assert said.startswith(f"the run file {bare}'s deepspeed section has no optimizer section: ")
    assert 'add "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}' in said
