"""The optimizer and schedule settings: resolved once from flags > run file > DeepSpeed-format config, the
refusals, each schedule's lr equal to DeepSpeed's own scheduler class, and the FSDP engine's torch objects."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.launch import startup
from model_utils.optim import schedules
from model_utils.optim.settings import OptimSettings
from model_utils.resolve import train_settings
from model_utils.resolve.train_settings import TrainSettings

W0 = schedules.WARMUP_MIN_RATIO
TOTAL = 40


def write(path: Path, content: dict | str) -> str:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def resolve(*flags: str) -> TrainSettings:
    return train_settings.resolve(parse_args(list(flags)))


def explicit_ds(tmp_path: Path) -> str:
    """A DeepSpeed config that sets the optimizer's lr and the warm-up itself."""
    return write(
        tmp_path / "ds.json",
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "betas": [0.8, 0.9], "eps": 1e-6}},
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"warmup_num_steps": 7, "total_num_steps": "auto", "cos_min_ratio": 0.2},
            },
            "gradient_clipping": 0.5,
            "bf16": {"enabled": True},
        },
    )


# --- precedence: flags > run file > DeepSpeed config -----------------------------------------------------------


def test_the_deepspeed_configs_explicit_keys_train_when_nothing_else_is_given(tmp_path: Path) -> None:
    ts = resolve("--deepspeed_config", explicit_ds(tmp_path))
    assert ts.optim == OptimSettings(
        type="AdamW", lr=5e-5, betas=(0.8, 0.9), eps=1e-6, weight_decay=None, gradient_clipping=0.5
    )
    assert (ts.schedule.kind, ts.schedule.warmup_steps, ts.schedule.min_lr_ratio) == ("cosine", 7, 0.2)
    # What DeepSpeed gets is what the settings say.
    ds = ts.deepspeed_json(1, TOTAL)
    assert ds["optimizer"]["params"]["lr"] == 5e-5
    assert ds["scheduler"]["params"] == {
        "warmup_num_steps": 7,
        "total_num_steps": TOTAL,
        "cos_min_ratio": 0.2,
    }


def test_auto_keys_take_the_run_file_and_flags_override_the_run_file(tmp_path: Path) -> None:
    run = write(tmp_path / "run.yaml", "optim: {lr: 2e-4, warmup_steps: 4, min_lr_ratio: 0.3}\n")
    from_file = resolve("--config", run)  # the kit's default config: every key "auto"
    assert (from_file.optim.lr, from_file.schedule.warmup_steps, from_file.schedule.min_lr_ratio) == (
        2e-4,
        4,
        0.3,
    )
    flagged = resolve("--config", run, "--lr", "1e-3", "--warmup_steps", "6")
    assert (flagged.optim.lr, flagged.schedule.warmup_steps, flagged.schedule.min_lr_ratio) == (1e-3, 6, 0.3)
    params = flagged.deepspeed_json(1, TOTAL)["scheduler"]["params"]
    assert (params["warmup_num_steps"], params["cos_min_ratio"]) == (6, 0.3)
    # Neither given: the flags' defaults (the tiny preset's lr).
    assert (resolve().optim.lr, resolve().schedule.warmup_steps) == (3e-3, 10)


def test_a_run_file_value_is_given_too_and_must_agree_with_an_explicit_key(tmp_path: Path) -> None:
    run = write(tmp_path / "run.yaml", "optim: {lr: 2e-4}\n")
    with pytest.raises(ConfigError) as err:
        resolve("--config", run, "--deepspeed_config", explicit_ds(tmp_path))
    assert str(err.value) == (  # the value is the run file's, and the message says so
        f"optim.lr (run file {run}) 0.0002 disagrees with optimizer.params.lr = 5e-05 in {tmp_path / 'ds.json'}: "
        'drop optim.lr or set the key to "auto"'
    )


def test_the_run_files_embedded_config_is_read_like_a_file(tmp_path: Path) -> None:
    run = write(
        tmp_path / "run.yaml",
        "optim: {warmup_steps: 3}\ndeepspeed:\n  optimizer: {type: AdamW, params: {lr: 4e-4, weight_decay: 0.05}}\n"
        "  scheduler: {type: WarmupCosineLR, params: {warmup_num_steps: auto, total_num_steps: auto}}\n",
    )
    ts = resolve("--config", run)
    assert (ts.optim.lr, ts.optim.weight_decay, ts.schedule.warmup_steps) == (4e-4, 0.05, 3)
    assert ts.path == f"the run file {run}'s deepspeed section"


# --- refusals: one line each, as before -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "content", "message"),
    [
        (["--lr", "1e-3"], "explicit", "--lr 0.001 disagrees with optimizer.params.lr = 5e-05 in"),
        (
            ["--warmup_steps", "3"],
            "explicit",
            "--warmup_steps 3 disagrees with scheduler.params.warmup_num_steps = 7",
        ),
        (
            ["--min_lr_ratio", "0.5"],
            "explicit",
            "--min_lr_ratio 0.5 disagrees with scheduler.params.cos_min_ratio",
        ),
        (["--lr", "1e-3"], {"zero_optimization": {"stage": 1}}, "--lr given but"),
        (
            ["--lr_schedule", "wsd"],
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
            "--lr_schedule wsd given but",
        ),
        (
            [],
            {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 0}}},
            "scheduler.params.total_num_steps = 0 in",
        ),
        (["--lr_schedule", "constant", "--min_lr_ratio", "0.2"], None, "--min_lr_ratio does not apply to"),
        (["--warmup_ratio", "0.1"], {"optimizer": {"type": "AdamW"}}, "--warmup_ratio does not apply to"),
        ([], {"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "optimizer.params.betas = 0.9 in"),
    ],
)
def test_what_is_refused(tmp_path: Path, flags: list[str], content: dict | str | None, message: str) -> None:
    if content == "explicit":
        flags = [*flags, "--deepspeed_config", explicit_ds(tmp_path)]
    elif content is not None:
        flags = [*flags, "--deepspeed_config", write(tmp_path / "ds.json", content)]
    with pytest.raises(ConfigError) as err:
        resolve(*flags)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_fsdp_engine_refuses_what_it_would_not_honour(tmp_path: Path) -> None:
    """FsdpEngine.check_config, through the settings resolution of --backend fsdp."""
    cases = {
        "no optimizer": (
            {"bf16": {"enabled": True}},
            "has no optimizer section: --backend fsdp trains with torch",
        ),
        "amsgrad": (
            {"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}},
            "optimizer.params.amsgrad in",
        ),
        "lamb": ({"optimizer": {"type": "Lamb"}}, "optimizer type 'Lamb' in"),
    }
    for content, message in cases.values():
        with pytest.raises(ConfigError, match=message):
            resolve("--backend", "fsdp", "--deepspeed_config", write(tmp_path / "ds.json", content))
    with pytest.raises(ConfigError, match="--fsdp_cpu_offload applies to --backend fsdp only"):
        resolve("--fsdp_cpu_offload", "true")


# --- each schedule: DeepSpeed's own class for the same spec -----------------------------------------------------


def deepspeed_class_lrs(cls_name: str, peak: float, steps: list[int], **params: object) -> list[float]:
    """The lr of each optimizer step (1-based) as DeepSpeed's scheduler class gives it, constructed here
    directly, stepped as deepspeed.initialize and the engine step it (iteration k-1 for step k)."""
    startup.import_deepspeed()
    from deepspeed.runtime import lr_schedules

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    scheduler = getattr(lr_schedules, cls_name)(optimizer, **params)
    out = []
    for step in steps:
        scheduler.step(step - 1)
        out.append(optimizer.param_groups[0]["lr"])
    return out


STEPS = list(range(1, TOTAL + 1))


def test_cosine_is_deepspeeds_warmup_cosine_lr() -> None:
    ts = resolve("--lr", "0.5", "--warmup_steps", "5", "--min_lr_ratio", "0.2")
    expected = deepspeed_class_lrs(
        "WarmupCosineLR", 0.5, STEPS, total_num_steps=TOTAL, warmup_min_ratio=W0, warmup_num_steps=5,
        cos_min_ratio=0.2, warmup_type="linear",
    )  # fmt: skip
    assert ts.lr_at(TOTAL, STEPS) == pytest.approx(expected)
    assert expected[0] == pytest.approx(0.5 * W0) and expected[-1] == pytest.approx(0.1)


def test_constant_is_deepspeeds_warmup_lr() -> None:
    ts = resolve("--lr", "0.5", "--warmup_steps", "5", "--lr_schedule", "constant")
    expected = deepspeed_class_lrs(
        "WarmupLR",
        0.5,
        STEPS,
        warmup_min_lr=0.5 * W0,
        warmup_max_lr=0.5,
        warmup_num_steps=5,
        warmup_type="linear",
    )
    assert ts.lr_at(TOTAL, STEPS) == pytest.approx(expected)
    assert expected[5:] == [0.5] * (TOTAL - 5)


def test_a_configs_own_scheduler_is_its_deepspeed_class(tmp_path: Path) -> None:
    own = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_max_lr": 0.25},
        },
    }
    ts = resolve("--lr", "0.5", "--warmup_steps", "4", "--deepspeed_config", write(tmp_path / "ds.json", own))
    assert ts.schedule.kind == "WarmupDecayLR"
    expected = deepspeed_class_lrs(
        "WarmupDecayLR", 0.5, STEPS, total_num_steps=TOTAL, warmup_num_steps=4, warmup_max_lr=0.25
    )
    assert ts.lr_at(TOTAL, STEPS) == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["wsd", "linear"])
def test_wsd_and_linear_are_the_kits_lambda_lr(kind: str) -> None:
    """DeepSpeed has no class for them: the kit's LambdaLR, the same one for both engines."""
    ts = resolve("--lr", "0.5", "--warmup_steps", "5", "--min_lr_ratio", "0.1", "--lr_schedule", kind)
    assert "scheduler" not in ts.deepspeed_json(1, TOTAL)  # handed to deepspeed.initialize instead
    decay_start = 5 if kind == "linear" else TOTAL - round(0.2 * TOTAL)

    def ratio(i: int) -> float:  # the closed form for iteration i (step i + 1)
        if i < 5:
            return W0 + (1 - W0) * i / 5
        progress = min(1.0, (i - decay_start + 1) / (TOTAL - decay_start)) if i >= decay_start else 0.0
        return 1 - 0.9 * progress

    assert ts.lr_at(TOTAL, STEPS) == pytest.approx([0.5 * ratio(s - 1) for s in STEPS])
    assert ts.lr_at(TOTAL, [TOTAL]) == pytest.approx([0.05])


def test_no_scheduler_section_is_a_constant_lr(tmp_path: Path) -> None:
    bare = write(tmp_path / "ds.json", {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    ts = resolve("--lr", "0.5", "--deepspeed_config", bare)
    assert ts.schedule.kind == schedules.NONE and ts.lr_at(TOTAL, STEPS) == [0.5] * TOTAL
    assert ts.schedule.warmup_for(TOTAL) is None and "scheduler" not in ts.deepspeed_json(1, TOTAL)


# --- the FSDP engine: torch objects from the same settings -------------------------------------------------------


def deepspeed_engine_lrs(ts: TrainSettings, steps: list[int]) -> list[float]:
    """The lr per step of the scheduler the DeepSpeed engine is given: its JSON's scheduler section as
    deepspeed.initialize builds it, else the kit's LambdaLR (trainer.create_engine)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=ts.optim.lr)
    section = ts.deepspeed_json(1, TOTAL).get("scheduler")
    client = ts.schedule.client(TOTAL)
    if client is not None:
        scheduler = client.lambda_lr(optimizer)
    else:
        startup.import_deepspeed()
        from deepspeed.runtime import lr_schedules

        scheduler = getattr(lr_schedules, section["type"])(optimizer, **section["params"])
    out = []
    for step in steps:
        schedules.start_at(scheduler, step - 1)
        out.append(optimizer.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("kind", ["cosine", "wsd", "linear", "constant"])
def test_the_fsdp_engine_builds_torch_adamw_and_the_same_schedule(kind: str) -> None:
    from model_utils.engines.fsdp_engine import FsdpEngine

    ts = resolve("--backend", "fsdp", "--lr", "0.5", "--warmup_steps", "5", "--lr_schedule", kind)
    model = torch.nn.Linear(4, 4)
    engine = FsdpEngine(
        model, ts.optim, ts.schedule, TOTAL, [{"params": list(model.parameters())}], torch.device("cpu")
    )
    optimizer = engine._optimizer
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    # deepspeed/fsdp.json's optimizer and clipping
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.95), 1e-8, 0.1)
    assert engine._clip == ts.optim.gradient_clipping == 1.0
    lrs = []
    for step in STEPS:
        engine.start_schedule_at(step - 1)  # positions the schedule for this step, as a resume does
        lrs.append(engine.lr())
    assert lrs == pytest.approx(deepspeed_engine_lrs(ts, STEPS))
    assert lrs == pytest.approx(ts.lr_at(TOTAL, STEPS))  # what `dskit config` and `dskit plot` show
    assert not math.isclose(lrs[0], lrs[-1])  # a schedule, not a constant


def test_the_fsdp_engine_uses_torch_defaults_for_what_the_config_leaves_out(tmp_path: Path) -> None:
    from model_utils.engines.fsdp_engine import FsdpEngine

    plain = write(tmp_path / "ds.json", {"optimizer": {"type": "Adam", "params": {"lr": "auto"}}})
    ts = resolve("--backend", "fsdp", "--deepspeed_config", plain)
    model = torch.nn.Linear(4, 4)
    engine = FsdpEngine(
        model, ts.optim, ts.schedule, TOTAL, [{"params": list(model.parameters())}], torch.device("cpu")
    )
    group = engine._optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-3,
        (0.9, 0.999),
        1e-8,
        0.01,
    )
    assert engine._clip == 0.0 and engine._scheduler is None  # no clipping, no scheduler: a constant lr
