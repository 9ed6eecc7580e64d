"""Run the example pipeline with Kedro's SequentialRunner and print its summary as JSON.

    .venv/bin/python examples/kedro/run.py --work_dir /tmp/kedro-run [--max_steps 20] [--mlflow]

--mlflow: the orchestrator opens its own MLflow run (a local store in the work dir) and the training logs into
a child of it (nested runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Before Kedro is imported (it configures logging then): the example's logging config, which shows the training's
# lines (see conf/logging.yml); a config of your own in KEDRO_LOGGING_CONFIG wins.
os.environ.setdefault("KEDRO_LOGGING_CONFIG", str(Path(__file__).parent / "conf" / "logging.yml"))

from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

sys.path.insert(0, str(Path(__file__).parent))
from pipeline import create_pipeline


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--mlflow", action="store_true")
    parser.add_argument(
        "--job_name", default="kedro-example", help="the launcher's JOB_NAME (its log's name)"
    )
    args = parser.parse_args()
    work = Path(args.work_dir).resolve()
    params = {
        "work_dir": str(work),
        "model": "tiny-qwen3",
        "dataset": "embedded",
        "seq_length": 128,
        "max_steps": args.max_steps,
        "eval_tasks": ["dskit_tiny_mc"],
        "env": {"JOB_NAME": args.job_name},
    }
    parent = None
    if args.mlflow:
        import mlflow

        uri = f"sqlite:///{work / 'mlflow.db'}"
        mlflow.set_tracking_uri(uri)
        parent = mlflow.start_run(run_name="kedro-pipeline")
        params |= {"mlflow_parent_run_id": parent.info.run_id, "tracking_uri": uri}
    catalog = DataCatalog({"params:training": MemoryDataset(params)})
    started = time.monotonic()
    try:
        outputs = SequentialRunner().run(create_pipeline(), catalog)
    finally:
        if parent is not None:
            import mlflow

            mlflow.end_run()
    summary = outputs["summary"]
    summary = summary.load() if hasattr(summary, "load") else summary
    print(json.dumps({**summary, "parent_run_id": parent.info.run_id if parent else None,
                      "seconds": round(time.monotonic() - started, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
