"""A training rank imports nothing it does not use: no tools package, plotting, templating, AWS or MLflow
client, S3 mock or compiler backend unless that feature is on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.torchrun import ENV, REPO

pytestmark = pytest.mark.e2e

NEVER_ON_A_DEFAULT_RANK = (
    "dskit",
    "matplotlib",
    "jinja2",
    "moto",
    "mlflow",
    "boto3",
    "botocore",
    "s3transfer",
    "scipy",
)


def rank_modules(tmp_path: Path, *flags: str) -> set[str]:
    out = tmp_path / "modules.json"
    proc = subprocess.run(
        [
            sys.executable, str(REPO / "tests" / "support" / "rank_modules.py"), str(out),
            "--max_steps", "1", "--seq_length", "64", "--validation_fraction", "0", "--metrics_file", "none",
            "--checkpoint_dir", str(tmp_path / "ck"), "--data_cache_dir", str(tmp_path / "cache"), *flags,
        ],
        env=ENV, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return set(json.loads(out.read_text()))


def test_a_default_rank_imports_only_what_it_uses(tmp_path: Path) -> None:
    modules = rank_modules(tmp_path)
    tops = {name.split(".")[0] for name in modules}
    assert not tops & set(NEVER_ON_A_DEFAULT_RANK), sorted(tops & set(NEVER_ON_A_DEFAULT_RANK))
    assert "torch._inductor.compile_fx" not in modules  # no compiler backend without --compile
    assert {"deepspeed", "transformers", "model_utils.loop.trainer"} <= modules  # it did train
    assert "model_utils.engines.fsdp_engine" not in modules  # the other engine stays out


def test_an_fsdp_rank_does_not_import_deepspeeds_engine(tmp_path: Path) -> None:
    modules = rank_modules(tmp_path, "--backend", "fsdp")
    assert {"model_utils.engines.fsdp_engine", "torch.distributed.checkpoint"} <= modules
    # DeepSpeed itself is imported (its config checker and scheduler classes serve both engines: one config
    # format, one schedule), the kit's DeepSpeed engine is not.
    assert "model_utils.engines.deepspeed_engine" not in modules


def test_a_feature_that_is_on_brings_its_imports(tmp_path: Path) -> None:
    modules = rank_modules(tmp_path, "--report_to", "mlflow", "--report_dir", str(tmp_path / "logs"))
    assert "mlflow" in modules and "dskit" not in {name.split(".")[0] for name in modules}
