"""--lr_schedule cosine|wsd|linear|constant: the shapes, what DeepSpeed gets, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.optim import schedules
from model_utils.resolve import train_settings

W0 = schedules.WARMUP_MIN_RATIO


def settings(*flags: str) -> train_settings.TrainSettings:
    return train_settings.resolve(parse_args(["--lr", "1.0", *flags]))


def client_schedule(
    kind: str,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float,
    decay_fraction: float,
    decay_type: str,
    decay_from_step: int | None,
) -> schedules.Schedule:
    """The kit's own schedule of a spec with these values, over total_steps."""
    spec = schedules.ScheduleSpec(
        kind, "test", warmup_steps, None, min_lr_ratio, decay_fraction, decay_type, decay_from_step
    )
    client = spec.client(total_steps)
    assert client is not None
    return client


def test_wsd_warms_up_holds_then_decays_to_the_floor() -> None:
    s = client_schedule("wsd", 100, 10, 0.1, 0.2, "linear", None)
    assert s.decay_start == 80
    assert s.ratio(0) == W0 and s.ratio(5) == pytest.approx(W0 + (1 - W0) * 0.5)
    assert [s.ratio(i) for i in (10, 50, 79)] == [1.0, 1.0, 1.0]
    assert s.ratio(80) == pytest.approx(1 - 0.9 / 20)  # the first decay step
    assert s.ratio(89) == pytest.approx(1 - 0.9 * 0.5)
    assert s.ratio(99) == pytest.approx(0.1) and s.ratio(150) == pytest.approx(0.1)  # stays at the floor
    assert (
        s.describe()
        == "lr schedule wsd: warm-up 10 steps, stable to step 80, linear decay to 0.1 x peak by step 100"
    )


@pytest.mark.parametrize(
    ("decay_type", "halfway"), [("linear", 0.5), ("cosine", 0.5), ("sqrt", math.sqrt(0.5))]
)
def test_wsd_decay_shapes(decay_type: str, halfway: float) -> None:
    s = client_schedule("wsd", 100, 0, 0.0, 0.5, decay_type, None)
    assert s.ratio(49) == 1.0 and s.ratio(99) == pytest.approx(0.0)
    assert s.ratio(74) == pytest.approx(1 - halfway)  # progress 25/50
    if decay_type == "cosine":
        assert s.ratio(51) > 1 - (52 - 50) / 50  # slower than linear at the start


def test_decay_from_step_cools_down_from_there_and_linear_decays_after_warm_up() -> None:
    s = client_schedule("wsd", 1000, 10, 0.1, 0.2, "linear", decay_from_step=300)
    assert s.decay_start == 300 and s.ratio(299) == 1.0 and s.ratio(999) == pytest.approx(0.1)
    linear = client_schedule("linear", 110, 10, 0.0, 0.2, "linear", None)
    assert linear.ratio(9) < 1 and linear.ratio(59) == pytest.approx(0.5) and linear.ratio(109) == 0.0


def test_what_deepspeed_gets_per_schedule() -> None:
    cosine = settings("--min_lr_ratio", "0.05").deepspeed_json(1, 100)["scheduler"]
    assert cosine["type"] == "WarmupCosineLR" and cosine["params"]["cos_min_ratio"] == 0.05
    constant = settings("--lr_schedule", "constant").deepspeed_json(1, 100)["scheduler"]
    assert constant == {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": W0,
            "warmup_max_lr": 1.0,
            "warmup_num_steps": 10,
            "warmup_type": "linear",
        },
    }
    for kind in ("wsd", "linear"):  # DeepSpeed has no such scheduler: a torch LambdaLR runs it
        s = settings("--lr_schedule", kind)
        assert "scheduler" not in s.deepspeed_json(1, 100) and s.schedule.client(100) is not None
    assert settings().schedule.client(100) is None


def test_lr_at_is_what_the_scheduler_that_trains_gives() -> None:
    steps = [1, 5, 10, 11, 55, 100]
    cos = settings("--warmup_steps", "10").lr_at(100, steps)
    assert cos[0] == pytest.approx(W0) and cos[-1] == pytest.approx(0.1)  # DeepSpeed's WarmupCosineLR
    assert cos[3] == pytest.approx(1.0, abs=1e-3)
    const = settings("--lr_schedule", "constant").lr_at(100, steps)
    assert const[0] == pytest.approx(W0) and const[3:] == [1.0, 1.0, 1.0]
    wsd = settings("--lr_schedule", "wsd").lr_at(100, steps)
    assert wsd[:3] == pytest.approx(cos[:3]) and wsd[3] == 1.0  # one warm-up for every schedule
    assert wsd[4] == 1.0 and wsd[-1] == pytest.approx(0.1)


def test_warmup_ratio_and_a_warmup_longer_than_the_run() -> None:
    s = settings("--warmup_ratio", "0.05")
    assert (
        s.schedule.warmup_for(1000) == 50
        and s.deepspeed_json(1, 1000)["scheduler"]["params"]["warmup_num_steps"] == 50
    )
    short = settings()  # warm-up 10
    assert (
        short.schedule.warmup_for(3) == 3
        and short.deepspeed_json(1, 3)["scheduler"]["params"]["warmup_num_steps"] == 3
    )


def test_a_one_step_run_gets_no_warning_from_deepspeeds_scheduler(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed warms up over 2 steps at least and warned "total_num_steps 1 is less than warmup_num_steps 1" from
    every rank of a 1-step run; the kit's warm-up never outlasts the run (its own line says it shortened it)."""
    import torch

    section = settings().deepspeed_json(1, 1)["scheduler"]
    assert section["params"]["warmup_num_steps"] == section["params"]["total_num_steps"] == 1
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    from deepspeed.utils import logger

    logger.propagate, propagated = True, logger.propagate  # into caplog's handler
    try:
        with caplog.at_level("WARNING"):
            schedules.deepspeed_scheduler(section, optimizer)
            assert caplog.messages == []
            from deepspeed.runtime import lr_schedules

            deepspeeds_own = getattr(lr_schedules, section["type"])  # not through the kit
            deepspeeds_own(optimizer, **section["params"])
    finally:
        logger.propagate = propagated
    assert any("total_num_steps 1 is less than warmup_num_steps 1" in m for m in caplog.messages)


def test_config_prints_the_schedule_and_the_lr_at_a_few_steps(tmp_path: Path, capsys) -> None:
    from dskit import cli

    flags = ["--lr_schedule", "wsd", "--max_steps", "100", "--lr", "1e-3", "--data_cache_dir", str(tmp_path)]
    assert cli.main(["config", *flags, "--checkpoint_dir", str(tmp_path / "ck")]) == 0
    resolved = json.loads(capsys.readouterr().out)["resolved"]
    assert resolved["lr_schedule"].startswith("lr schedule wsd: warm-up 10 steps, stable to step 80")
    lrs = {int(step): lr for step, lr in resolved["lr_at_step"].items()}
    assert (
        lrs[1] == pytest.approx(1e-3 * W0)
        and lrs[50] == pytest.approx(1e-3)
        and lrs[100] == pytest.approx(1e-4)
    )


def test_plot_of_the_four_schedules(tmp_path: Path, capsys) -> None:
    from dskit import cli
    from dskit.plot.schedule_plot import curves

    out = tmp_path / "s.png"
    flags = ["--max_steps", "40", "--warmup_steps", "4", "--decay_fraction", "0.5"]
    assert cli.main(["plot", "--schedules", *flags, "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    total, lrs = curves(flags)
    assert total == 40 and list(lrs) == ["cosine", "wsd", "linear", "constant"]
    assert (
        lrs["wsd"][19] == lrs["constant"][19] and lrs["wsd"][-1] < lrs["wsd"][19]
    )  # decays over the last 20


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr_schedule", "wds"], "--lr_schedule 'wds' is not a schedule: did you mean wsd?"),
        (["--lr_schedule", "wsd", "--decay_fraction", "0"], "--decay_fraction 0.0 is outside (0, 1]"),
        (["--lr_schedule", "wsd", "--decay_fraction", "1.5"], "is outside (0, 1]"),
        (
            ["--lr_schedule", "wsd", "--decay_type", "exp"],
            "--decay_type 'exp' is not one of linear, cosine, sqrt",
        ),
        (["--decay_fraction", "0.3"], "--decay_fraction apply to --lr_schedule wsd only"),
        (["--warmup_steps", "5", "--warmup_ratio", "0.1"], "--warmup_steps and --warmup_ratio both given"),
        (["--min_lr_ratio", "1.5"], "--min_lr_ratio 1.5 is outside [0, 1]"),
        (["--lr_schedule", "wsd", "--decay_from_step", "-1"], "must be zero or positive"),
    ],
)
def test_bad_schedule_flags_are_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(flags)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_schedule_combinations_found_when_resolving(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not apply to --lr_schedule constant"):
        settings("--lr_schedule", "constant", "--min_lr_ratio", "0.2")
    own = tmp_path / "ds.json"
    own.write_text(
        json.dumps(
            {
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
            }
        )
    )
    with pytest.raises(
        ConfigError, match="has its own scheduler WarmupLR: drop --lr_schedule or the scheduler section"
    ):
        settings("--deepspeed_config", str(own), "--lr_schedule", "wsd")
    assert (
        settings("--deepspeed_config", str(own)).schedule.kind == "WarmupLR"
    )  # the file's own, without the flag
    s = settings("--lr_schedule", "wsd", "--decay_from_step", "150")
    with pytest.raises(ConfigError, match="--decay_from_step 150 is beyond the run's 100 steps"):
        s.schedule.client(100)


def test_schedule_flags_a_config_without_a_scheduler_would_ignore_are_errors(tmp_path: Path) -> None:
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    assert settings("--deepspeed_config", str(bare)).schedule.kind == "none"
    for flag, value in (("--min_lr_ratio", "0.2"), ("--warmup_ratio", "0.1")):
        with pytest.raises(
            ConfigError, match=f"{flag} does not apply to .*bare.json, which has no scheduler"
        ):
            settings("--deepspeed_config", str(bare), flag, value)


def test_a_zero_warmup_under_deepspeeds_scheduler_is_one_line() -> None:
    """DeepSpeed's WarmupCosineLR raises on a 0-step warm-up inside deepspeed.initialize; the kit says so first.
    Its own schedules need none."""
    with pytest.raises(
        ConfigError, match="a warm-up of 0 steps: DeepSpeed's WarmupCosineLR needs at least 1"
    ):
        settings("--warmup_steps", "0").deepspeed_json(1, 100)
    assert settings("--lr_schedule", "wsd", "--warmup_steps", "0").lr_at(10, [1]) == [1.0]


def test_a_warmup_ratio_rounds_up_as_hugging_face_does() -> None:
    """Any ratio above 0 warms up for at least one step (configs/qwen3-0.6b-lora.yaml's 0.03 of a 6-step smoke
    run is 1 step, not a refusal); a product that floating point puts a hair above an integer is that integer."""
    for ratio, total, warmup in (
        ("0.03", 6, 1),
        ("0.001", 100, 1),
        ("0.07", 100, 7),
        ("0.03", 127, 4),
        ("0", 9, 0),
    ):
        assert settings("--warmup_ratio", ratio).schedule.warmup_for(total) == warmup, (ratio, total)
    assert (
        settings("--warmup_ratio", "0.03").deepspeed_json(1, 6)["scheduler"]["params"]["warmup_num_steps"]
        == 1
    )


@pytest.mark.parametrize(
    ("flags", "runs"),
    [
        ([], "DeepSpeed's WarmupCosineLR, stepped by the DeepSpeed engine"),
        (["--backend", "fsdp"], "DeepSpeed's WarmupCosineLR over torch AdamW, stepped by the FSDP engine"),
        (["--lr_schedule", "wsd"], "the kit's LambdaLR, stepped by the DeepSpeed engine"),
        (["--lr_schedule", "linear", "--backend", "fsdp"], "the kit's LambdaLR over torch AdamW, stepped by the FSDP engine"),
        (["--lr_schedule", "constant", "--backend", "fsdp"], "DeepSpeed's WarmupLR over torch AdamW, stepped by the FSDP engine"),
    ],
)  # fmt: skip
def test_the_schedule_line_says_which_class_runs_it_and_which_engine_steps_it(
    flags: list[str], runs: str
) -> None:
    from model_utils import engines

    ts = settings(*flags)
    line = ts.schedule.describe(100, engines.engine_class(ts.backend).runs_schedule)
    assert line.startswith(f"lr schedule {ts.schedule.kind}: warm-up 10 steps") and line.endswith(
        f" ({runs})"
    )
    assert line.count("DeepSpeed") == runs.count("DeepSpeed")  # no DeepSpeed engine claimed under fsdp


# --- a resume keeps the warm-up it ran; another --max_steps reshapes the decay alone, said in one line ---------

RESUME_KINDS = {
    "cosine": ["--warmup_ratio", "0.305"],
    "wsd": ["--lr_schedule", "wsd", "--warmup_ratio", "0.305"],
    "linear": ["--lr_schedule", "linear", "--warmup_ratio", "0.305"],
    "constant": ["--lr_schedule", "constant", "--warmup_steps", "61"],
}


@pytest.mark.parametrize("kind", list(RESUME_KINDS))
def test_a_resume_with_the_same_flags_trains_exactly_the_uninterrupted_schedule(kind: str) -> None:
    spec = settings(*RESUME_KINDS[kind]).schedule
    ran = schedules.RanSchedule(spec.warmup_for(200), 200)
    assert ran.warmup_steps == 61
    steps = list(range(1, 201))
    assert spec.resumed(ran).lr_at(1.0, 200, steps) == spec.lr_at(1.0, 200, steps)
    assert spec.resume_line(ran, 1.0, 127, 200) is None


@pytest.mark.parametrize("kind", list(RESUME_KINDS))
def test_another_max_steps_keeps_the_warmup_and_reshapes_only_the_decay(kind: str) -> None:
    spec = settings(*RESUME_KINDS[kind]).schedule
    ran = schedules.RanSchedule(61, 200)
    kept = spec.resumed(ran)
    assert kept.warmup_for(140) == 61  # never 43, the ratio of the new horizon
    warmup = list(range(1, 62))
    assert kept.lr_at(1.0, 140, warmup) == spec.lr_at(1.0, 200, warmup)  # the warm-up run so far, unchanged
    (before,) = spec.lr_at(1.0, 200, [128])
    (after,) = kept.lr_at(1.0, 140, [128])
    line = spec.resume_line(ran, 1.0, 127, 140)
    assert line is not None
    head = "lr schedule: --max_steps 140 (was 200): warm-up kept at 61 steps"
    if kind == "constant":
        assert after == before == 1.0 and line == f"{head}; lr at step 128 1 -> 1"
    else:
        assert after < before and kept.lr_at(1.0, 140, [140]) == pytest.approx([0.1], abs=1e-6)
        assert line == (
            f"{head} (the flags now give 43); the decay now ends at step 140; "
            f"lr at step 128 {before:.3g} -> {after:.3g}"
        )


def test_the_cosine_example_of_the_issue_keeps_its_warmup_and_says_the_lr_before_and_after() -> None:
    spec = train_settings.resolve(parse_args(["--lr", "2e-5", "--warmup_ratio", "0.305"])).schedule
    line = spec.resume_line(schedules.RanSchedule(61, 200), 2e-5, 127, 140)
    assert line == (
        "lr schedule: --max_steps 140 (was 200): warm-up kept at 61 steps (the flags now give 43); the decay now "
        "ends at step 140; lr at step 128 1.15e-05 -> 3.01e-06"
    )


def test_a_changed_warmup_flag_on_resume_is_kept_and_said_and_a_new_decay_from_step_is_allowed() -> None:
    spec = settings("--lr_schedule", "wsd", "--warmup_steps", "10").schedule
    ran = schedules.RanSchedule(20, 100)
    assert spec.resumed(ran).warmup_for(100) == 20
    line = spec.resume_line(ran, 1.0, 50, 100)
    assert line == "lr schedule: warm-up kept at 20 steps (the flags now give 10); lr at step 51 1 -> 1"
    # A cool-down from step 300 of a run extended from 100 steps: the run resumed had no decay from there.
    cool = settings("--lr_schedule", "wsd", "--decay_from_step", "300").schedule
    line = cool.resume_line(schedules.RanSchedule(10, 100), 1.0, 90, 1000)
    assert line is not None and line.endswith("lr at step 91 0.505 -> 1")  # 11 of 20 decay steps
    # A run without a warm-up (a config without a scheduler) keeps none.
    assert spec.resumed(schedules.RanSchedule(None, 100)) is spec


@pytest.mark.parametrize(("ran_kind", "kind"), [("cosine", "wsd"), ("wsd", "cosine"), ("linear", "constant")])
def test_another_schedule_on_resume_continues_from_the_loaded_step_and_says_so(
    ran_kind: str, kind: str
) -> None:
    """The issue's `--lr_schedule wsd` on a cosine checkpoint: the new schedule (its warm-up as the checkpoint ran
    it) from the next step, the old scheduler's state not loaded, said in one line."""
    spec = settings(*RESUME_KINDS[kind]).schedule
    ran = schedules.RanSchedule(61, 200, ran_kind)
    assert spec.switches_from(ran)
    (after,) = spec.resumed(ran).lr_at(1.0, 200, [128])
    line = spec.resume_line(ran, 1.0, 127, 200)
    assert line == (
        f"lr schedule: --lr_schedule {kind} (was {ran_kind}) from step 128 ({ran_kind}'s scheduler state not "
        f"loaded); warm-up kept at 61 steps; lr at step 128 {after:.3g}"
    )
    # The same kind, or a checkpoint that did not record its kind: no switch, the state loads as before.
    assert not spec.switches_from(schedules.RanSchedule(61, 200, kind))
    assert not spec.switches_from(schedules.RanSchedule(61, 200))


def test_positioning_a_loaded_torch_scheduler_sets_the_lr_of_the_schedule_it_was_loaded_into() -> None:
    import torch

    def scheduler(total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        client = client_schedule("linear", total_steps, 2, 0.0, 0.0, "linear", None)
        return client.lambda_lr(optimizer)

    saved = scheduler(10)
    for _ in range(5):
        saved.optimizer.step()
        saved.step()
    resumed = scheduler(20)
    resumed.optimizer.load_state_dict(saved.optimizer.state_dict())  # the saved run's lr for step 6
    resumed.load_state_dict(saved.state_dict())
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # 4 of 8
    schedules.start_at(resumed, 5)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1 - 4 / 18)  # 4 of 18 decay steps
