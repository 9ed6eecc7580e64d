"""dskit.api.train and dskit.api.evaluate as pipeline nodes: the Kedro example end to end (SequentialRunner, one
whole launch, the exported model, a child MLflow run of the orchestrator's that the evaluation records into too),
and a failed launch or evaluation as the kit's one-line message."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dskit import api

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.launcher]


def cleanup_logs(job: str) -> None:
    for path in (REPO / "logs").glob(f"{job}_*"):
        path.unlink()


def test_kedro_example_trains_as_one_node_and_returns_a_serialisable_result(tmp_path: Path) -> None:
    job = f"kedro-test-{os.getpid()}"
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "examples" / "kedro" / "run.py"), "--work_dir", str(tmp_path),
             "--max_steps", "10", "--job_name", job, "--mlflow"],
            cwd=REPO, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    finally:
        cleanup_logs(job)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 10 and math.isfinite(summary["validation_perplexity"])
    assert summary["validation_perplexity"] < 2048  # below chance for the 2,048-token vocabulary: it trained
    model = Path(summary["model"])
    assert (model / "config.json").is_file() and any(model.glob("*.safetensors"))
    assert "Completed node: train" in proc.stdout + proc.stderr  # the run was one Kedro node
    # The training's lines reach Kedro's log while the train node runs, each whole on one line.
    kedro_log = proc.stdout.splitlines()
    started = next(i for i, line in enumerate(kedro_log) if "Running node: train" in line)
    ended = next(i for i, line in enumerate(kedro_log) if "Completed node: train" in line)
    steps = [
        re.search(r" INFO training: .*\| Step (\d+)/10 \| Loss ", line) for line in kedro_log[started:ended]
    ]
    assert [int(m.group(1)) for m in steps if m] == [5, 10], kedro_log[started:ended]
    # Nested: the training logged into a child of the orchestrator's own MLflow run (the real store, read back).
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    child = client.get_run(summary["mlflow_run_id"])
    assert child.data.tags["mlflow.parentRunId"] == summary["parent_run_id"] != summary["mlflow_run_id"]
    assert [m.step for m in client.get_metric_history(child.info.run_id, "train/loss")][-1] == 10
    # The evaluate node: lm-eval on the final checkpoint, its results in the same child run at the same step.
    acc = summary["eval"]["dskit_tiny_mc"]["acc"]
    assert 0 <= acc <= 1 and "Completed node: evaluate" in proc.stdout + proc.stderr
    eval_history = client.get_metric_history(child.info.run_id, "eval/dskit_tiny_mc/acc")
    assert [(m.step, m.value) for m in eval_history] == [(10, acc)]
    print(f"Kedro example, 10 steps: {seconds:.1f} s")


def test_api_result_and_a_failed_launch(tmp_path: Path) -> None:
    job = f"api-test-{os.getpid()}"
    lines: list[str] = []
    try:
        with pytest.raises(api.TrainingFailed) as failed:
            api.train(flags=["--max_step", "5"], on_line=lines.append, env={"JOB_NAME": job})
        assert str(failed.value) == "unknown flag --max_step: did you mean --max_steps?"
        assert any("unknown flag --max_step" in line for line in lines)  # streamed as it came
    finally:
        cleanup_logs(job)
    with pytest.raises(api.EvaluationFailed) as failed:
        api.evaluate(tmp_path / "nope", ["dskit_tiny_mc"], on_line=None)
    assert str(failed.value).startswith(f"{tmp_path / 'nope'} does not exist: pass a run's checkpoint dir")
