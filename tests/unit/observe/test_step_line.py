"""The log's lines as people read them (tools read the records): the texts that launchers, SLURM tests and users
grep for stay as they were. The step and validation lines come from one table in step_line.py: fields a CPU run
lacks are left out, NaN shows; then the end, saved-checkpoint, run, MLflow and error lines, and the regexes
SageMaker's metric definitions scrape with."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.observe import step_line

RECORD = {
    "step": 10,
    "loss": 7.12345,
    "lr": 3e-3,
    "grad_norm": 1.234,
    "tokens_per_s": 2600.4,
    "tokens_per_s_per_device": 1300.2,
    "trained_tokens_per_s": 2210.7,
    "tflops_per_device": 0.0123,
    "mfu": 0.4215,
    "device_mem_alloc_gib": 1.04,
    "device_mem_peak_gib": 2.01,
    "host_rss_gib": 3.3,
    "data_wait_frac": 0.012,
    "step_time_s": 0.5,
    "skipped_steps": 2,
    "eta_s": 3725,
}


def test_step_line_renders_every_field() -> None:
    line = step_line.step_line(RECORD, 100, time_left=60)
    assert line == (
        "Step 10/100 | Loss 7.1235 | lr 3.00e-03 | grad_norm 1.23 | tokens/s 2600 (1300/device) | "
        "trained tokens/s 2211 | TFLOPs/device 0.0123 | MFU 42.1% | mem 1.0/2.0 GiB | RSS 3.3 GiB | data 1.2% | s/step 0.500 | "
        "skipped 2 | ETA 1:02:05 (job time left 0:01:00)"
    )


def test_cpu_records_leave_out_what_they_do_not_have() -> None:
    record = {**RECORD, "mfu": None, "device_mem_alloc_gib": None, "device_mem_peak_gib": None}
    record["skipped_steps"] = 0
    line = step_line.step_line(record, 100)
    assert "MFU" not in line and "mem " not in line and "skipped" not in line
    assert line.endswith("| ETA 1:02:05")


def test_nan_grad_norm_and_validation_and_start_lines() -> None:
    assert "| grad_norm nan |" in step_line.step_line({**RECORD, "grad_norm": float("nan")}, 100)
    validation = step_line.validation_line({"step": 4, "val_loss": 2.5, "val_ppl": 12.18}, 8)
    assert validation == "Step 4/8 | Validation Loss 2.5000 | Perplexity 12.18"
    resumed = step_line.resumed_line("ck/t-5steps", 5, 0, 40, 1e-3)
    assert resumed == "Resumed from ck/t-5steps at step 5 (epoch 0, block 40, lr 1.00e-03)"
    assert step_line.fresh_line("ck") == "No verified checkpoint in ck: starting fresh"


def test_format_duration() -> None:
    assert step_line.format_duration(3725.9) == "1:02:05"
    assert step_line.format_duration(-3) == "0:00:00"


def test_end_lines() -> None:
    assert step_line.done_line(12, 20, 4096) == "Done: step 12/20, 4096 tokens seen"
    assert step_line.preempted_line(7, "SIGUSR1") == "Preempted: stop requested by SIGUSR1; saved at step 7"
    walltime = step_line.walltime_line(5)
    assert walltime == "Stopped at step 5 before the job's time limit; saved (a requeued job resumes here)"
    why = "step 9 took 41.0 s: 10x the median (--watchdog 10)"
    assert step_line.stopped_line(9, "watchdog", why) == f"Stopped at step 9 (watchdog): {why}; saved"
    validated = step_line.validated_line(24)  # --validation_only: the model measured was the step-24 one
    assert validated == "Validated the model at step 24: nothing trained or saved"


@pytest.mark.parametrize("tag_dir", ["checkpoints/tiny_qwen3-5steps", "/mnt/my runs/ckpt/tiny_qwen3-5steps"])
def test_saved_line_names_any_path(tag_dir: str) -> None:
    line = step_line.saved_line(Path(tag_dir), "0.003 GB in 0.03 s, 0.09 GB/s")
    assert line == f"Saved checkpoint {tag_dir} (0.003 GB in 0.03 s, 0.09 GB/s)"


def test_run_line_with_and_without_a_tracker_or_a_metrics_file() -> None:
    path = Path("logs/job_7.metrics.jsonl")
    bare = step_line.run_line("tiny_qwen3-1", path, "none", "logs")
    assert bare == "Run tiny_qwen3-1: metrics to logs/job_7.metrics.jsonl"
    tracked = step_line.run_line("tiny_qwen3-1", path, "mlflow", "logs")
    assert tracked == "Run tiny_qwen3-1: metrics to logs/job_7.metrics.jsonl, mlflow under logs"
    nowhere = step_line.run_line("r", None, "tensorboard", "/x/logs")
    assert nowhere == "Run r: metrics to nowhere (--metrics_file none), tensorboard under /x/logs"


def test_mlflow_line() -> None:
    run_id, parent = "0123456789abcdef0123456789abcdef", "f" * 32
    line = step_line.mlflow_line(run_id, "dskit", "sqlite:////x/logs/mlflow.db", None)
    assert line == f"MLflow run {run_id} in experiment 'dskit' at sqlite:////x/logs/mlflow.db"
    child = step_line.mlflow_line(run_id, "sweep", "http://mlflow:5000", parent)
    assert child == f"MLflow run {run_id} in experiment 'sweep' at http://mlflow:5000, child of {parent}"


def test_error_line() -> None:
    message = "unknown flag --max_step: did you mean --max_steps?"
    assert step_line.error_line(message) == f"error: {message}"


def test_the_validation_line_says_what_it_covered_and_took() -> None:
    record = {"step": 40, "val_loss": 5.2213, "val_ppl": 185.17, "val_bpb": 2.0345, "val_blocks": 16,
              "val_total_blocks": 1777, "val_tokens": 32752, "val_s": 2.3}  # fmt: skip
    line = step_line.validation_line(record, 40)
    assert line == (
        "Step 40/40 | Validation Loss 5.2213 | Perplexity 185.17 | bits/byte 2.0345 | "
        "16 of 1,777 blocks (32,752 target tokens) | took 2.3 s"
    )
    full = step_line.validation_line({**record, "val_blocks": 1777, "val_tokens": 3_637_519}, 40)
    assert full.endswith("| 1,777 of 1,777 blocks (3,637,519 target tokens) | took 2.3 s")


def test_metric_regexes_capture_each_number_of_a_rendered_line() -> None:
    """The regexes log scrapers get (SageMaker's metric definitions) read the numbers back from the lines rendered
    here; the step's Loss never matches the validation line's Validation Loss."""
    import re

    record = {"step": 3, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.75, "tokens_per_s": 1234.0,
              "tokens_per_s_per_device": 617.0, "mfu": 0.125, "eta_s": 10}  # fmt: skip
    line = "2026-11-26 12:00:00 | " + step_line.step_line(record, 10)
    val = "2026-11-26 12:00:00 | " + step_line.validation_line(
        {"step": 3, "val_loss": 2.25, "val_ppl": 9.49, "val_bpb": 1.0625, "val_s": 0.5}, 10
    )
    read = {
        label: re.findall(step_line.metric_regex(label), line)
        for label in ("Loss", "lr", "grad_norm", "tokens/s", "MFU")
    }
    assert read == {
        "Loss": ["2.5000"],
        "lr": ["1.00e-04"],
        "grad_norm": ["0.75"],
        "tokens/s": ["1234"],
        "MFU": ["12.5"],
    }
    assert re.findall(step_line.metric_regex("Loss"), val) == []
    assert re.findall(step_line.metric_regex("Validation Loss"), val) == ["2.2500"]
    assert re.findall(step_line.metric_regex("Perplexity"), val) == ["9.49"]
    assert re.findall(step_line.metric_regex("bits/byte"), val) == ["1.0625"]


def test_a_mixtures_shares_and_per_source_losses_end_their_lines() -> None:
    record = {**RECORD, "skipped_steps": 0, "share/web": 0.7012, "share/code": 0.2988}
    line = step_line.step_line(record, 100)
    assert line.endswith("| s/step 0.500 | shares web 70.1% code 29.9% | ETA 1:02:05")
    validation = {"step": 4, "val_loss": 2.5, "val_ppl": 12.18,
                  "val_loss/web": 2.25, "val_ppl/web": 9.49, "val_bpb/web": 1.0, "val_tokens/web": 1200,
                  "val_loss/code": 3.0, "val_ppl/code": 20.09, "val_bpb/code": 1.5, "val_tokens/code": 800}  # fmt: skip
    line = step_line.validation_line(validation, 8)
    assert line == (
        "Step 4/8 | Validation Loss 2.5000 | Perplexity 12.18 | per source "
        "web 2.2500 ppl 9.49 bits/byte 1.0000 (1,200 target tokens), "
        "code 3.0000 ppl 20.09 bits/byte 1.5000 (800 target tokens)"
    )


def test_samples_lines_are_brief() -> None:
    long_prompt, long_text = "p" * 70 + " end", "start " + "t" * 80
    lines = step_line.samples_lines(500, [("Once\nupon", " a  time"), (long_prompt, long_text)], 1.25)
    assert lines == [
        "Samples at step 500: 2 prompts in 1.2 s",
        "  [1] 'Once upon' -> 'a time'",
        f"  [2] '...{long_prompt[-60:]}' -> '{long_text[:60]}...'",
    ]


def test_a_preference_objective_adds_its_reward_margin_and_accuracy() -> None:
    """--objective dpo/simpo: the margin and accuracy after the grad norm; validation's over the pairs it read, and
    no perplexity or target tokens (a pair's loss is not per token). The SageMaker regexes read both."""
    line = step_line.step_line({**RECORD, "reward_margin": 0.61234, "reward_accuracy": 0.875}, 100)
    assert "| grad_norm 1.23 | reward margin 0.6123 | reward accuracy 87.5% | tokens/s" in line
    record = {
        "step": 24, "val_loss": 0.36, "val_reward_margin": 0.8358, "val_reward_accuracy": 1.0, "val_pairs": 3,
        "val_total_blocks": 3, "val_s": 0.03,
    }  # fmt: skip
    assert step_line.validation_line(record, 24) == (
        "Step 24/24 | Validation Loss 0.3600 | Validation reward margin 0.8358 | Validation reward accuracy 100.0% | "
        "3 of 3 pairs | took 0.0 s"
    )
    import re

    assert re.search(step_line.metric_regex("reward accuracy"), line).group(1) == "87.5"
