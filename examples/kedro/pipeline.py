"""A Kedro pipeline whose training node is one whole distributed dskit run (the seed's practice: the run as
ONE node that calls the launcher once and gets back a serialisable result).

    write_run_file(params)          -> run_file      a run file (YAML) from the pipeline's parameters
    train(run_file, params)         -> training      dskit.api.train: the launcher, its log streamed line by line
                                                     to the `training` logger at INFO (conf/logging.yml shows
                                                     it), the result as a dict (step, losses, checkpoint,
                                                     metrics file, MLflow run, exported model)
    evaluate(training, params)      -> evaluation    dskit.api.evaluate: lm-eval on the final checkpoint (the
                                                     shipped task), its results into the training's MLflow run
    summarize(training, evaluation) -> summary       what a downstream node would use
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import yaml
from kedro.pipeline import Pipeline, node, pipeline

from dskit import api

# The launcher's log lines (steps, validations, checkpoints) while the train node runs; conf/logging.yml sets it
# to INFO, as a Kedro project's conf/logging.yml would.
training_log = logging.getLogger("training")


def write_run_file(params: dict[str, Any]) -> str:
    work = Path(params["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    run = {
        "model": {"model": params["model"]},
        "data": {"dataset": params["dataset"], "seq_length": params["seq_length"]},
        "loop": {"max_steps": params["max_steps"], "logging_freq": 5, "validation_freq": params["max_steps"]},
        "checkpoint": {"checkpoint_dir": str(work / "checkpoints"), "checkpoint_freq": params["max_steps"]},
        "report": {"metrics_file": str(work / "metrics.jsonl"), "tracking_uri": params.get("tracking_uri")},
        "deepspeed": "deepspeed/ds_config.json",
    }
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return str(path)


def train(run_file: str, params: dict[str, Any]) -> dict[str, Any]:
    result = api.train(
        run_file,
        export_dir=str(Path(params["work_dir"]) / "model"),
        mlflow_parent_run_id=params.get("mlflow_parent_run_id"),
        on_line=training_log.info,
        env=params.get("env"),
    )
    return result.to_dict()


def evaluate(training: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    result = api.evaluate(
        training["checkpoint"], params["eval_tasks"], on_line=training_log.info, env=params.get("env")
    )
    return result.to_dict()


def summarize(training: dict[str, Any], evaluation: dict[str, Any]) -> dict[str, Any]:
    return {
        "steps": training["final_step"],
        "validation_perplexity": math.exp(training["validation_loss"]),
        "model": training["exported"],
        "mlflow_run_id": training["mlflow_run_id"],
        "eval": evaluation["metrics"],  # task -> metric -> value
    }


def create_pipeline() -> Pipeline:
    return pipeline(
        [
            node(write_run_file, "params:training", "run_file", name="write_run_file"),
            node(train, ["run_file", "params:training"], "training", name="train"),
            node(evaluate, ["training", "params:training"], "evaluation", name="evaluate"),
            node(summarize, ["training", "evaluation"], "summary", name="summarize"),
        ]
    )
