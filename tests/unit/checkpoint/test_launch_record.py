"""The launch record (launch.json) saved with each checkpoint: what it records of the launch, its hash of the
resolved run, and the resume check over every setting a checkpoint fixes (the matrix below: schedule, ZeRO stage,
backend, LoRA, sequence length, model, data, chat template): each difference refused in one line or handled and
said."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from model_utils.checkpoint import launch_record
from model_utils.config.arguments import LoraArgs, parse_args
from model_utils.config.presets import PRESETS
from model_utils.errors import ConfigError
from model_utils.model import lora
from model_utils.optim.schedules import RanSchedule
from model_utils.resolve import train_settings
from support.checkpoint_tags import fake_tag

REPO = Path(__file__).resolve().parents[3]


def _launch_tag(tmp_path: Path, world_size: int = 2, seq_length: int = 64) -> tuple[Path, object]:
    config = PRESETS["tiny-qwen3"].build_config()
    tag = fake_tag(tmp_path, 4)
    config.save_pretrained(tag / "hf_config")
    # As a run with the default --seq_length records it: the user's config says None, the resolved run 64.
    launch = {
        "config": {"data": {"seq_length": None}},
        "resolved": {"seq_length": seq_length},
        "world_size": world_size,
    }
    (tag / "launch.json").write_text(json.dumps(launch))
    return tag, config


def test_launch_manifest_refuses_another_architecture_or_sequence_length(tmp_path: Path) -> None:
    tag, config = _launch_tag(tmp_path)
    assert launch_record.check_resume(tag, config, 64, world_size=2) == launch_record.ResumePlan()
    # Weights only: another world size, or optimizer groups this checkpoint was not saved with.
    plan = launch_record.check_resume(tag, config, 64, world_size=1)
    assert plan.weights_only == "world size changed from 2 to 1"
    plan = launch_record.check_resume(tag, config, 64, world_size=2, optimizer_groups=[[3, 100], [2, 8]])
    assert (
        plan.weights_only
        == "the optimizer's parameter groups changed from one group (a kit before weight-decay groups) to [[3, 100], [2, 8]]"
    )
    wider = PRESETS["tiny-qwen3"].build_config()
    wider.hidden_size = 128
    with pytest.raises(ConfigError, match="has hidden_size=64 but the model now has hidden_size=128"):
        launch_record.check_resume(tag, wider, 64, world_size=2)
    with pytest.raises(ConfigError, match="was trained with --seq_length 64, not 128"):
        launch_record.check_resume(tag, config, 128, world_size=2)
    # A checkpoint of a kit before the resolved run: the resolved length was written into the config.
    (tag / "launch.json").write_text(json.dumps({"config": {"data": {"seq_length": 64}}, "world_size": 2}))
    assert launch_record.check_resume(tag, config, 64, world_size=2) == launch_record.ResumePlan()
    with pytest.raises(ConfigError, match="was trained with --seq_length 64, not 128"):
        launch_record.check_resume(tag, config, 128, world_size=2)


def test_launch_manifest_records_how_the_run_was_launched(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("FI_PROVIDER", "efa")
    monkeypatch.setenv("CUDA_VERSION", "12.9")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    info = launch_record.collect(
        {"a": 1}, {"seq_length": 64}, {"zero_optimization": {"stage": 2}}, world_size=16
    )
    assert (info["config"], info["resolved"]) == ({"a": 1}, {"seq_length": 64})
    assert info["env"] == {"FI_PROVIDER": "efa", "NCCL_DEBUG": "INFO"}
    assert (info["nodes"], info["world_size"], info["cuda_version"]) == ("node[1-2]", 16, "12.9")
    assert info["uv_lock_sha256"] and len(info["uv_lock_sha256"]) == 64
    # The tests run from a git checkout (CI clones the repo): the record names its exact commit.
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert len(head) == 40 and info["git_commit"] == head


def test_launch_record_says_where_a_local_base_model_is(tmp_path: Path, monkeypatch) -> None:
    """A relative --model names a dir of the run's working directory: the record holds its absolute path (where a
    LoRA export finds the base weights the run started from); a preset or a hub id is no dir."""
    (tmp_path / "out" / "base").mkdir(parents=True)
    (tmp_path / "out" / "base" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    info = launch_record.collect({"model": {"model": "out/base"}}, {}, {}, world_size=1)
    assert info[launch_record.MODEL_DIR] == str(tmp_path / "out" / "base")
    for model in ("tiny-qwen3", "Qwen/Qwen3-0.6B"):
        assert launch_record.collect({"model": {"model": model}}, {}, {}, 1)[launch_record.MODEL_DIR] is None


def test_launch_record_holds_no_credentials(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_IB_AUTH", "nccl_secret")  # recorded env: NCCL_*/FI_*, secret-named ones masked
    config = {"report": {"tracking_uri": "https://admin:pw@mlflow.example/x", "run_name": "r"}}
    info = launch_record.collect(config, {"seq_length": 64}, {}, world_size=1)
    assert info["config"]["report"] == {"tracking_uri": "https://mlflow.example/x", "run_name": "r"}
    assert info["env"]["NCCL_IB_AUTH"] == "***"
    assert "pw" not in json.dumps(info) and "nccl_secret" not in json.dumps(info)


def test_launch_manifest_has_no_commit_outside_a_git_checkout(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(launch_record, "REPO_ROOT", tmp_path)  # the kit unpacked from an archive, say
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repo above tmp_path either
    for name in ("GIT_DIR", "GIT_WORK_TREE"):
        monkeypatch.delenv(name, raising=False)
    info = launch_record.collect({}, {}, {}, world_size=1)
    assert info["git_commit"] is None
    assert info["uv_lock_sha256"] is None  # no uv.lock there either


def test_launch_record_hashes_the_resolved_run() -> None:
    one = launch_record.collect({"a": 1}, {"seq": 64}, {"zero": 2}, world_size=2)
    assert one["run_sha256"] == launch_record.collect({"a": 1}, {"seq": 64}, {"zero": 2}, 4)["run_sha256"]
    assert one["run_sha256"] != launch_record.collect({"a": 1}, {"seq": 64}, {"zero": 3}, 2)["run_sha256"]


def test_a_launch_record_says_the_schedule_its_run_trained(tmp_path: Path) -> None:
    tag, _ = _launch_tag(tmp_path)
    assert launch_record.ran_schedule(tag) is None  # a kit before the schedule was recorded: nothing kept
    launch = json.loads((tag / "launch.json").read_text())
    launch["resolved"] |= {"max_steps": 200, "warmup_steps": 61}
    (tag / "launch.json").write_text(json.dumps(launch))
    assert launch_record.ran_schedule(tag) == RanSchedule(61, 200)  # its kind unknown: no switch is seen
    launch["resolved"]["lr_schedule_kind"] = "wsd"
    (tag / "launch.json").write_text(json.dumps(launch))
    assert launch_record.ran_schedule(tag) == RanSchedule(61, 200, "wsd")


@pytest.mark.parametrize(
    ("deepspeed_config", "optim", "kind"),
    [
        ({"scheduler": {"type": "WarmupCosineLR"}}, {"lr_schedule": "cosine"}, "cosine"),
        ({"scheduler": {"type": "WarmupLR"}}, {"lr_schedule": "constant"}, "constant"),
        (
            {"scheduler": {"type": "WarmupDecayLR"}},
            {"lr_schedule": "cosine"},
            "WarmupDecayLR",
        ),  # the config's own
        ({}, {"lr_schedule": "wsd"}, "wsd"),  # the kit's LambdaLR: no section in DeepSpeed's dict
        ({}, {"lr_schedule": "cosine"}, "none"),  # a config without a scheduler
    ],
)
def test_the_schedule_kind_of_a_record_before_it_was_written_comes_from_the_deepspeed_dict(
    tmp_path: Path, deepspeed_config: dict, optim: dict, kind: str
) -> None:
    """Checkpoints of kits before `lr_schedule_kind` (the issue's cosine checkpoint) still say what they ran, so
    a resume onto another --lr_schedule does not load their scheduler's state."""
    tag, _ = _launch_tag(tmp_path)
    launch = json.loads((tag / "launch.json").read_text())
    launch["resolved"] |= {"max_steps": 200, "warmup_steps": 61}
    launch |= {"deepspeed_config": deepspeed_config, "config": {**launch["config"], "optim": optim}}
    (tag / "launch.json").write_text(json.dumps(launch))
    assert launch_record.ran_schedule(tag) == RanSchedule(61, 200, kind)


# --- a resume with each setting changed -------------------------------------------------------------------

FINGERPRINT = "6284e9ae0dcd0e0d"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _saved_run(tmp_path: Path, lora_args: LoraArgs | None = None) -> tuple[Path, object]:
    """A ZeRO-2 DeepSpeed tag of a cosine run on data of FINGERPRINT, as this kit records it."""
    tag, config = _launch_tag(tmp_path)
    launch = json.loads((tag / "launch.json").read_text())
    launch["config"] |= {
        "data": {"seq_length": None, "dataset": "embedded", "chat_template": "chat.jinja"},
        "lora": dataclasses.asdict(lora_args or LoraArgs()),
    }
    launch[launch_record.CHAT_TEMPLATE] = TEMPLATE
    launch["resolved"] |= {
        "max_steps": 8,
        "warmup_steps": 2,
        "lr_schedule_kind": "cosine",
        "zero_stage": 2,
        "backend": "deepspeed",
        "precision": "bf16",
        "data_fingerprint": FINGERPRINT,
    }
    (tag / "launch.json").write_text(json.dumps(launch))
    return tag, config


def _resume(tag: Path, config: object, **changed: object) -> str:
    """What the preflight makes of a resume of `tag` with these settings changed: "same", what it handles (a
    schedule switch, weights only, a data reset) or "refused: <the line>". Anything else would be a traceback."""
    model = changed.pop("model", config)
    flags = ["--lr_schedule", str(changed.pop("lr_schedule", "cosine"))]
    schedule = train_settings.resolve(parse_args(flags)).schedule
    try:
        lora.check_resume(tag, launch_record.read(tag), changed.pop("lora", LoraArgs()))  # type: ignore[arg-type]
        plan = launch_record.check_resume(
            tag,
            model,
            changed.pop("seq_length", 64),  # type: ignore[arg-type]
            world_size=2,
            backend=changed.pop("backend", "deepspeed"),  # type: ignore[arg-type]
            zero_stage=changed.pop("zero_stage", 2),  # type: ignore[arg-type]
            data_fingerprint=changed.pop("data", FINGERPRINT),  # type: ignore[arg-type]
            new_data=bool(changed.pop("new_data", False)),
            dataset="/data/other",
            precision=changed.pop("precision", "bf16"),  # type: ignore[arg-type]
            chat_template=changed.pop("chat_template", TEMPLATE),
        )
    except ConfigError as e:
        return f"refused: {e}"
    assert not changed, changed
    ran = launch_record.ran_schedule(tag)
    assert ran is not None
    said = [schedule.resume_line(ran, 1.0, 4, 8)] if schedule.switches_from(ran) else []
    said += [why for why in (plan.weights_only, plan.data_reset) if why is not None]
    return " | ".join(said) or "same"


def _wider() -> object:
    config = PRESETS["tiny-qwen3"].build_config()
    config.num_hidden_layers += 1
    return config


# setting -> (the change, what the preflight makes of it)
MATRIX = {
    "nothing": ({}, "same"),
    "schedule": ({"lr_schedule": "wsd"}, "lr schedule: --lr_schedule wsd (was cosine) from step 5"),
    "ZeRO stage 2 -> 3": ({"zero_stage": 3}, "ZeRO stage changed from 2 to 3"),
    "ZeRO stage 2 -> 1": ({"zero_stage": 1}, "ZeRO stage changed from 2 to 1"),
    "backend": ({"backend": "fsdp", "zero_stage": 0}, "refused: checkpoint {tag} was saved by --backend deepspeed"),
    "LoRA on": ({"lora": LoraArgs(lora_r=4)}, "refused: checkpoint {tag} was trained without LoRA, not with"),
    "sequence length": ({"seq_length": 128}, "refused: checkpoint {tag} was trained with --seq_length 64, not 128"),
    "model": ({"model": _wider()}, "refused: checkpoint {tag} has num_hidden_layers=2 but the model now has"),
    "data": ({"data": "0123456789abcdef"}, "refused: checkpoint {tag} was trained on other data (embedded, content"),
    "data, with --new_data": (
        {"data": "0123456789abcdef", "new_data": True},
        "--new_data: the data changed from embedded (content 6284e9ae0dcd0e0d) to /data/other (content "
        "0123456789abcdef): its position starts over at epoch 0, block 0",
    ),
    "same data, --new_data": ({"new_data": True}, "same"),
    "precision": ({"precision": "fp16"}, "refused: checkpoint {tag} was trained in bf16, not fp16: resume with its"),  # nothing to reset: a requeue with the flag continues
    "chat template": (
        {"chat_template": TEMPLATE + "{{ eos_token }}"},
        "refused: checkpoint {tag} was trained with another chat template (--chat_template chat.jinja), which its "
        "hf_config/ holds, not this run's: resume with the template it trained with, or start a new "
        "--checkpoint_dir from its weights (dskit export, then --model)",
    ),
    "no chat template": ({"chat_template": None}, "refused: checkpoint {tag} was trained with another chat template (--chat_template chat.jinja), which its hf_config/ holds, not this run's (none): "),
}  # fmt: skip


@pytest.mark.parametrize("cell", list(MATRIX))
def test_each_setting_a_checkpoint_fixes_is_refused_or_handled_in_one_line(tmp_path: Path, cell: str) -> None:
    tag, config = _saved_run(tmp_path)
    change, expected = MATRIX[cell]
    outcome = _resume(tag, config, **dict(change))
    assert outcome.startswith(expected.format(tag=tag)), outcome
    assert "\n" not in outcome  # one line each


def test_a_resume_onto_or_from_a_mixture_names_its_sources(tmp_path: Path) -> None:
    tag, config = _saved_run(tmp_path)
    mixed = "web=data/web@0.7,code=data/code@0.3"
    with pytest.raises(ConfigError) as caught:
        launch_record.check_resume(tag, config, 64, None, data_fingerprint="0" * 16, sources=mixed)
    assert (
        f"was trained on other data (embedded, content {FINGERPRINT}) than --sources {mixed} (content"
        in str(caught.value)
    )
    launch = json.loads((tag / "launch.json").read_text())
    launch["config"]["data"]["sources"] = mixed
    (tag / "launch.json").write_text(json.dumps(launch))
    plan = launch_record.check_resume(
        tag, config, 64, None, data_fingerprint="0" * 16, new_data=True, dataset="x"
    )
    assert plan.data_reset is not None
    assert plan.data_reset.startswith(
        f"--new_data: the data changed from {mixed} (content {FINGERPRINT}) to x ("
    )


def test_lora_changes_are_refused_whichever_way(tmp_path: Path) -> None:
    tag, config = _saved_run(tmp_path, LoraArgs(lora_r=4))
    assert _resume(tag, config, lora=LoraArgs(lora_r=4)) == "same"
    assert _resume(tag, config, lora=LoraArgs()).startswith(
        f"refused: checkpoint {tag} was trained with --lora_r 4"
    )
    assert _resume(tag, config, lora=LoraArgs(lora_r=8)).startswith("refused: ")


def test_the_zero_stage_is_compared_only_where_the_backend_shards_by_stage(tmp_path: Path) -> None:
    """FSDP has no ZeRO stage (0 in its record); a record without the resolved stage reads DeepSpeed's dict."""
    tag, config = _saved_run(tmp_path)
    plan = launch_record.check_resume(tag, config, 64, world_size=2, zero_stage=3)
    assert plan.weights_only is None  # no --backend given: nothing known of stages
    launch = json.loads((tag / "launch.json").read_text())
    del launch["resolved"]["zero_stage"]
    launch["deepspeed_config"] = {"zero_optimization": {"stage": 3}}
    (tag / "launch.json").write_text(json.dumps(launch))
    plan = launch_record.check_resume(tag, config, 64, world_size=2, backend="deepspeed", zero_stage=2)
    assert plan.weights_only == "ZeRO stage changed from 3 to 2"
    # The stage is said before another world size: the stage is why the optimizer state cannot come along.
    plan = launch_record.check_resume(tag, config, 64, world_size=1, backend="deepspeed", zero_stage=2)
    assert plan.weights_only == "ZeRO stage changed from 3 to 2"


def test_the_precision_of_a_record_before_it_was_resolved_comes_from_the_deepspeed_dict(
    tmp_path: Path,
) -> None:
    tag, config = _saved_run(tmp_path)
    launch = json.loads((tag / "launch.json").read_text())
    del launch["resolved"]["precision"]
    launch["deepspeed_config"] = {"fp16": {"enabled": True}}
    (tag / "launch.json").write_text(json.dumps(launch))
    assert _resume(tag, config, precision="fp16") == "same"
    assert _resume(tag, config, precision="fp32").startswith(
        f"refused: checkpoint {tag} was trained in fp16, not"
    )


def test_data_of_a_kit_before_the_fingerprint_or_not_known_yet_is_not_compared(tmp_path: Path) -> None:
    tag, config = _saved_run(tmp_path)
    assert launch_record.check_resume(tag, config, 64, None).data_reset is None  # before the data is prepared
    launch = json.loads((tag / "launch.json").read_text())
    del launch["resolved"]["data_fingerprint"]
    (tag / "launch.json").write_text(json.dumps(launch))
    assert (
        launch_record.check_resume(tag, config, 64, None, data_fingerprint="0" * 16)
        == launch_record.ResumePlan()
    )


def test_a_chat_template_is_compared_once_known_and_where_the_checkpoint_records_one(tmp_path: Path) -> None:
    tag, config = _saved_run(tmp_path)
    assert launch_record.check_resume(tag, config, 64, None) == launch_record.ResumePlan()  # not known yet
    launch = json.loads((tag / "launch.json").read_text())
    launch[launch_record.CHAT_TEMPLATE] = None
    (tag / "launch.json").write_text(json.dumps(launch))
    with pytest.raises(ConfigError, match="was trained with no chat template, not this run's: resume with"):
        launch_record.check_resume(tag, config, 64, None, chat_template=TEMPLATE)
    assert launch_record.check_resume(tag, config, 64, None, chat_template=None) == launch_record.ResumePlan()
    del launch[launch_record.CHAT_TEMPLATE]  # a kit before the record: its hf_config/ may lack the template
    (tag / "launch.json").write_text(json.dumps(launch))
    plan = launch_record.check_resume(tag, config, 64, None, chat_template=TEMPLATE)
    assert plan == launch_record.ResumePlan()
