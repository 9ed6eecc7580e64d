"""model_utils.config.accelerate_env without accelerate: a rank torchrun started is not read as one. The mapping
of real `accelerate launch` environments: tests/e2e/test_accelerate_env.py."""

from __future__ import annotations

import os

from model_utils.config import accelerate_env


def test_not_launched_by_accelerate() -> None:
    torchrun_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    assert accelerate_env.from_environment(torchrun_env) is None
    assert accelerate_env.from_environment(os.environ | {"ACCELERATE_USE_FSDP": "true"}) is None  # no marker
