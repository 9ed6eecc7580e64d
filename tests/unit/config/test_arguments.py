"""The config tree and strict flag parsing."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from model_utils.config.arguments import CONFIG, HF_NAMES, TrainConfig, flag_fields, parse_args
from model_utils.errors import ConfigError
from model_utils.resolve import train_settings
from support.deepspeed_files import ds_dict

SRC = Path(__file__).resolve().parents[3] / "src"
DEFAULT_DS = str(SRC.parent / "deepspeed" / "ds_config.json")
DOCS = SRC.parent / "docs"


def parse(*flags: str) -> TrainConfig:
    return parse_args(["--deepspeed_config", DEFAULT_DS, *flags])


def test_defaults_are_the_documented_ones() -> None:
    cfg = parse()
    assert cfg.model.model == "tiny-qwen3"
    assert cfg.data.dataset == "embedded"
    assert cfg.loop.max_steps == 100 and cfg.checkpoint.checkpoint_freq == 50
    assert cfg.checkpoint.checkpoint_dir == "checkpoints"
    assert cfg.optim.lr is None  # not given: the resolved settings pick the model's default
    assert train_settings.resolve(cfg).optim.lr == 3e-3  # the tiny preset's own lr
    assert train_settings.resolve(parse("--model", "org/some-model")).optim.lr == 5e-5
    ds = ds_dict(cfg, total_steps=100)
    # The kit's config leaves these "auto": the flags' defaults fill them.
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_accumulation_steps"] == 1
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["params"] | {"lr": 0} == {
        "lr": 0,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    sched = ds["scheduler"]
    assert sched["type"] == "WarmupCosineLR"
    assert sched["params"]["warmup_num_steps"] == 10 and sched["params"]["total_num_steps"] == 100
    assert sched["params"]["warmup_min_ratio"] > 0  # no step at lr 0
    assert ds["gradient_clipping"] == 1.0
    assert "train_batch_size" not in ds


def test_the_parsed_config_is_frozen() -> None:
    cfg = parse("--seq_length", "64")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.seq_length = 128  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim = cfg.optim  # type: ignore[misc]


def test_user_flag_names_keep_working() -> None:
    cfg = parse(
        "--dataset", "allenai/c4", "--dataset_config_name", "en", "--local_dataset", "false",
        "--max_steps", "7", "--checkpoint_freq", "3", "--checkpoint_dir", "/tmp/ck",
        "--resume_from_checkpoint", "/tmp/other", "--validation_freq", "2",
    )  # fmt: skip
    assert (cfg.data.dataset, cfg.data.dataset_config_name, cfg.data.local_dataset) == (
        "allenai/c4",
        "en",
        False,
    )
    assert (cfg.loop.max_steps, cfg.loop.validation_freq) == (7, 2)
    assert (cfg.checkpoint.checkpoint_freq, cfg.checkpoint.checkpoint_dir) == (3, "/tmp/ck")
    assert cfg.checkpoint.resume_from_checkpoint == "/tmp/other"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lrr", "1"], "unknown flag --lrr: did you mean --lr?"),
        (["--max_step", "5"], "did you mean --max_steps?"),
        (["--checkpoint-freq", "5"], "did you mean --checkpoint_freq?"),
        (["--max_steps", "0"], "--max_steps 0 must be at least 1"),
        (["--checkpoint_freq", "-3"], "--checkpoint_freq -3 must be at least 1"),
        (["--logging_freq", "0"], "--logging_freq 0 must be at least 1"),
        (["--validation_freq", "0"], "--validation_freq 0 must be at least 1"),
        (["--max_steps", "ten"], "invalid int value: 'ten'"),
        (["--local_dataset", "maybe"], "expected true or false"),
        (["--epochs", "2", "--max_steps", "5"], "--epochs and --max_steps both given"),
        (["--validation_fraction", "1.5"], "--validation_fraction 1.5 is outside [0, 1)"),
        (["--validation_split", "validation", "--validation_fraction", "0.1"], "both given"),
        (["--lr", "-1"], "must be positive"),
        (["--micro_batch_size", "0"], "--micro_batch_size 0 must be at least 1"),
        (["--validation_batches", "0"], "--validation_batches 0 must be at least 1"),
        (["--validation_batches", "every"], "expected an integer or 'all', got 'every'"),
        (["--micro_batch_size", "all"], "expected an integer or 'auto', got 'all'"),
        (["--hang_timeout", "-5"], "--hang_timeout -5.0 must be 0 (off) or at least 1 second, e.g. 300"),
        (["--hang_timeout", "0.5"], "--hang_timeout 0.5 must be 0 (off) or at least 1 second"),
        (["--straggler_every", "-1"], "--straggler_every -1 must be 0 (off) or more"),
        (["--straggler_threshold", "0"], "--straggler_threshold 0.0 must be positive, e.g. 0.1"),
        (["--observers", " , "], "--observers is empty: name MODULE:NAME observers, or drop the flag"),
        (
            ["--observers", "a.b:C,my-observers.py"],
            "--observers: 'my-observers.py' is not MODULE:NAME: give a",
        ),
        (["--observers", "a.b"], "--observers: 'a.b' is not MODULE:NAME"),
    ],
)
def test_bad_flags_are_one_clear_error(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(*flags)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_validation_batches_is_a_count_or_all() -> None:
    assert parse().loop.validation_batches == 8
    assert parse("--validation_batches", "3").loop.validation_batches == 3
    assert parse("--validation_batches", "all").loop.validation_batches == "all"
    assert parse("--validation_batches", "ALL").loop.validation_batches == "all"


def test_abbreviations_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown flag --max_ste"):
        parse("--max_ste", "5")


def test_no_flag_is_a_prefix_of_a_torchrun_option() -> None:
    """torchrun's parser abbreviates: a script flag that prefixes one of its options is swallowed by it."""
    from torch.distributed.run import get_args_parser

    torchrun_options = {s for a in get_args_parser()._actions for s in a.option_strings if s.startswith("--")}
    ours = {f"--{name}" for name in flag_fields()}
    clashes = {(o, t) for o in ours for t in torchrun_options if t.startswith(o)}
    assert not clashes


def _attribute_reads(path: Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


def test_every_flag_is_read_by_the_training_code() -> None:
    """A flag that exists is used: each config field is read somewhere outside its own definition."""
    reads: set[str] = set()
    for path in [SRC / "train_deepspeed.py", *SRC.joinpath("model_utils").rglob("*.py")]:
        if path.name != "arguments.py":
            reads |= _attribute_reads(path)
    unread = sorted(set(flag_fields()) - reads)
    assert not unread, f"flags parsed but never read: {unread}"


def test_every_field_has_help_and_one_default() -> None:
    for _, (section, f) in flag_fields().items():
        assert f.metadata.get("help"), f"--{f.name} has no help"
        assert f.default is not dataclasses.MISSING, f"--{f.name} ({section}) has no default"


def test_flag_table_matches_the_parser() -> None:
    """docs/flags.md documents exactly the flags that exist (no config the code does not have)."""
    table = set(re.findall(r"^\| `--([a-z0-9_]+)` \|", (DOCS / "flags.md").read_text(), flags=re.M))
    assert table == set(flag_fields())


def test_readme_and_docs_show_only_options_that_exist() -> None:
    """Every `--option` README.md and docs/*.md show is a training flag, another dskit command's or a tool's."""
    pages = [SRC.parent / "README.md", *sorted(DOCS.glob("*.md"))]
    assert DOCS / "flags.md" in pages
    config_format = {"format"}  # `dskit config --format yaml` (parsed in cli.py, before the training flags)
    known = set(flag_fields()) | {CONFIG} | config_format | _other_commands_options() | OTHER_TOOLS_OPTIONS
    for page in pages:
        mentioned = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9_]+)", page.read_text()))
        assert mentioned - known == set(), f"{page.name} shows options that do not exist"


# Options of tools the README and docs/ show that are not dskit's: uv's, tensorboard's, mlflow's, SLURM's
# (sbatch, srun, scancel), and one misspelling docs/flags.md gives as an example of the error message.
OTHER_TOOLS_OPTIONS = {"frozen", "check", "offline", "logdir", "backend"} | {
    "batch", "kill", "signal", "output", "open", "requeue", "max_step", "dependency", "parsable", "array", "cpus",
    "wait", "mlflow", "job_name",  # sbatch --wait; examples/kedro/run.py's own options
    "dry_run",  # dskit sagemaker submit's (read by hand before the training flags, like --values and --wait)
    # accelerate launch's (docs/launchers.md); srun's --auto-resume (HyperPod) and --gpus-per-node, read up to "-"
    "config_file", "multi_gpu", "num_processes", "num_machines", "machine_rank", "main_process_ip",
    "main_process_port", "rdzv_backend", "deepspeed_multinode_launcher", "mixed_precision", "dynamo_backend",
    "cpu", "auto", "gpus", "overlap",  # srun --overlap (docs/launchers.md: a step beside the job's)
    "revision",  # `hf download --revision` (docs/launchers.md: pre-filling the HF cache)
    "corpus", "set",  # tools/spike_guard_replay.py's (docs/spike-guard.md)
    "with_collective", "one_group", "split", "threads", "block", "rounds",  # tools/loop_overhead.py's (docs/hangs.md)
    "rows", "turn_chars",  # tools/chat_bench_data.py's (docs/data.md)
}  # fmt: skip


def _other_commands_options() -> set[str]:
    """The options of the other `dskit` commands, read from their own parsers."""
    from dskit import bench, cost, estimate, export, plot, prepare_data, render
    from dskit import eval as dskit_eval
    from dskit.bench import data_bench, gpu_check, sequence_bench

    commands = (bench, cost, data_bench, dskit_eval, estimate, export, gpu_check, plot, prepare_data, render)
    commands += (sequence_bench,)
    parsers = [module.build_parser() for module in commands]
    return {
        option[2:].split("=")[0]
        for parser in parsers
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def test_report_to_takes_several_trackers_and_wandb_project_only_with_wandb() -> None:
    assert parse_args(["--report_to", "tensorboard, wandb"]).report.trackers == ("tensorboard", "wandb")
    assert parse_args([]).report.trackers == ()
    assert parse_args(["--report_to", "wandb", "--wandb_project", "p"]).report.wandb_project == "p"
    with pytest.raises(ConfigError, match="--wandb_project is for W&B: add wandb to --report_to"):
        parse_args(["--report_to", "tensorboard", "--wandb_project", "p"])
    with pytest.raises(ConfigError, match="--tracking_uri is for MLflow"):
        parse_args(["--report_to", "tensorboard,wandb", "--tracking_uri", "http://h:5000"])
    with pytest.raises(ConfigError, match="'tensorbord' is not a tracker"):
        parse_args(["--report_to", "tensorbord"])


def test_the_sample_flags_need_prompts_and_a_run_files_list_is_kept_as_json(tmp_path: Path) -> None:
    report = parse_args(["--sample_prompts", "p.txt", "--sample_every", "100"]).report
    assert (report.sample_prompts, report.sample_every, report.sample_max_new_tokens) == ("p.txt", 100, 32)
    with pytest.raises(
        ConfigError, match=r"^--sample_every and --sample_max_new_tokens apply to samples, .* fix"
    ):
        parse_args(["--sample_every", "100", "--sample_max_new_tokens", "8"])
    with pytest.raises(ConfigError, match=r"^--sample_every 0 must be at least 1: fix"):
        parse_args(["--sample_prompts", "p.txt", "--sample_every", "0"])
    with pytest.raises(ConfigError, match=r"^--sample_prompts is empty: fix"):
        parse_args(["--sample_prompts", " "])
    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        "report:\n  sample_prompts:\n    - Once upon a time\n    - {messages: [{role: user, content: Hi}]}\n"
    )
    given = parse_args(["--config", str(run_file)]).report.sample_prompts
    assert given is not None
    assert json.loads(given) == ["Once upon a time", {"messages": [{"role": "user", "content": "Hi"}]}]


def test_the_hub_flags_need_a_repo_and_a_known_visibility() -> None:
    ckpt = parse_args(["--push_to_hub", "me/run", "--hub_visibility", "private"]).checkpoint
    assert (ckpt.push_to_hub, ckpt.hub_visibility) == ("me/run", "private")
    with pytest.raises(
        ConfigError, match=r"the hub flags \(--hub_revision, --hub_visibility\) need --push_to_hub"
    ):
        parse_args(["--hub_revision", "v1"])
    with pytest.raises(ConfigError, match="'me' is not a hub repo: give user/name"):
        parse_args(["--push_to_hub", "me"])
    with pytest.raises(ConfigError, match="hub_visibility"):
        parse_args(["--push_to_hub", "me/run", "--hub_visibility", "secret"])


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--learning_rate", "unknown flag --learning_rate (a Hugging Face Trainer name): use --lr"),
        ("--learning-rate", "unknown flag --learning-rate (a Hugging Face Trainer name): use --lr"),
        ("--output_dir", "use --checkpoint_dir (checkpoints) and --report_dir (logs and trackers)"),
        ("--per_device_train_batch_size", "use --micro_batch_size"),
        ("--num_train_epochs", "use --epochs"),
        ("--save_steps", "use --checkpoint_freq"),
        ("--logging_steps", "use --logging_freq"),
        ("--max_seq_length", "use --seq_length"),
        (
            "--bf16",
            "in the DeepSpeed config (--deepspeed_config, or the run file's deepspeed section): bf16 {\"enabled",
        ),
        ("--weight_decay", "set optimizer.params.weight_decay in the DeepSpeed config"),
    ],
)
def test_a_hugging_face_trainer_name_names_the_kits_setting(flag: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(flag, "1")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_hugging_face_names_table_points_at_real_flags() -> None:
    """Each Hugging Face name is none of the kit's flags, and each flag its fix names exists; the names the kit
    shares with the Trainer are its own flags."""
    flags = set(flag_fields())
    assert not set(HF_NAMES) & flags
    named = {name for fix in HF_NAMES.values() for name in re.findall(r"--(\w+)", fix)}
    assert named and named <= flags
    shared = {"max_steps", "warmup_steps", "warmup_ratio", "gradient_accumulation_steps", "seed", "report_to"}
    shared |= {"resume_from_checkpoint", "run_name", "push_to_hub", "lora_r", "lora_alpha", "lora_dropout"}
    assert shared <= flags
    # The DeepSpeed keys a fix names are the kit's config's own.
    ds = json.loads(Path(DEFAULT_DS).read_text())
    for fix in HF_NAMES.values():
        for key in re.findall(r"set ([\w.]+) in the DeepSpeed config", fix):
            section = ds
            for part in key.split("."):
                section = section[part]


def test_relative_paths_typed_at_a_launcher_are_taken_from_where_they_were_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dskit/train-singlenode.sh --model dskit/out/tiny-base` from the parent dir: the launcher changes to the kit's
    root and names the caller's dir (DSKIT_CALLER_DIR); inputs found there and outputs are the caller's, a hub id
    or a path found nowhere stays as typed, and a run file's own paths stay the kit root's."""
    caller, kit = tmp_path / "work", tmp_path / "kit"
    (caller / "dskit" / "out" / "tiny-base").mkdir(parents=True)
    kit.mkdir()
    (caller / "run.yaml").write_text("checkpoint:\n  checkpoint_dir: checkpoints/x\n")
    monkeypatch.chdir(kit)
    monkeypatch.setenv("DSKIT_CALLER_DIR", str(caller))
    cfg = parse(
        "--model", "dskit/out/tiny-base", "--dataset", "allenai/c4", "--data_cache_dir", "cache",
        "--report_dir", "~/dskit-logs", "--metrics_file", "auto", "--config", "run.yaml",
    )  # fmt: skip
    assert cfg.model.model == str(caller / "dskit" / "out" / "tiny-base")
    assert cfg.data.dataset == "allenai/c4" and cfg.data.data_cache_dir == str(caller / "cache")
    assert (
        cfg.report.report_dir == str(Path("~/dskit-logs").expanduser()) and cfg.report.metrics_file == "auto"
    )
    assert cfg.run_file == str(caller / "run.yaml") and cfg.checkpoint.checkpoint_dir == "checkpoints/x"
    monkeypatch.setenv("DSKIT_CALLER_DIR", str(kit))  # typed in the kit's root: nothing to take elsewhere
    assert parse("--data_cache_dir", "cache").data.data_cache_dir == "cache"
    monkeypatch.delenv("DSKIT_CALLER_DIR")  # not through a launcher: the current dir is the caller's
    assert parse("--model", "dskit/out/tiny-base").model.model == "dskit/out/tiny-base"


def test_validation_only_and_at_start_are_loop_flags_of_the_command_line_and_the_run_file(
    tmp_path: Path,
) -> None:
    """#43: measure a model without training it (--validation_only), and a run's baseline at step 0."""
    cfg = parse("--validation_only", "true", "--validation_at_start", "true")
    assert (cfg.loop.validation_only, cfg.loop.validation_at_start) == (True, True)
    assert (parse().loop.validation_only, parse().loop.validation_at_start) == (False, False)
    run = tmp_path / "run.yaml"
    run.write_text("loop:\n  validation_only: true\n")
    cfg = parse("--config", str(run))
    assert (
        cfg.loop.validation_only
        and cfg.setting("validation_only") == f"loop.validation_only (run file {run})"
    )
    with pytest.raises(ConfigError, match="--validation_only"):
        parse("--validation_only", "maybe")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--beta", "0.2"], "--beta does not apply to --objective lm: drop it"),
        (
            ["--objective", "dpo", "--simpo_gamma", "1"],
            "--simpo_gamma does not apply to --objective dpo: drop it",
        ),
        (
            ["--objective", "dpo", "--label_smoothing", "0.1"],
            "--label_smoothing does not apply to --objective dpo (TRL's sigmoid DPO loss has no label smoothing: "
            "--loss_type robust has): drop it",
        ),
        (["--objective", "simpo", "--loss_type", "ipo"], "--loss_type does not apply to --objective simpo"),
        (["--objective", "dop"], "--objective 'dop' is not an objective: did you mean dpo?"),
        (["--objective", "dpo", "--loss_type", "sigmoid_norm"], "is not a DPO loss type"),
        (["--objective", "dpo", "--beta", "0"], "--beta 0.0 must be positive"),
        (["--objective", "simpo", "--label_smoothing", "0.5"], "--label_smoothing 0.5 is outside [0, 0.5)"),
    ],
)
def test_a_preference_setting_the_objective_does_not_read_is_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


def test_the_objective_settings_resolve_to_trls_defaults() -> None:
    from model_utils.engines import preference

    dpo = preference.Settings.of(parse_args(["--objective", "dpo"]).objective)
    assert (dpo.beta, dpo.loss_type, dpo.label_smoothing, dpo.uses_reference) == (0.1, "sigmoid", 0.0, True)
    robust = parse_args(["--objective", "dpo", "--loss_type", "robust", "--label_smoothing", "0.1"]).objective
    assert preference.Settings.of(robust).label_smoothing == 0.1
    simpo = preference.Settings.of(parse_args(["--objective", "simpo", "--beta", "2"]).objective)
    assert (simpo.beta, simpo.simpo_gamma, simpo.uses_reference) == (2.0, 0.5, False)
