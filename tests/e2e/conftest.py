"""Session-scoped reference runs shared by the e2e tests (tests/support/reference_runs.py)."""

from __future__ import annotations

import pytest

from support import reference_runs
from support.reference_runs import Reference


@pytest.fixture(scope="session")
def deepspeed_reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """ZeRO-2 on 2 ranks: 8 steps with tags 2, 4, 6 and 8, and its twin resumed from tag 4."""
    return reference_runs.train_deepspeed_reference(tmp_path_factory.mktemp("deepspeed-reference"))


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """--backend fsdp on 2 ranks: 8 steps with tags 4 and 8, and its twin resumed past a corrupt tag 8."""
    return reference_runs.train_fsdp_reference(tmp_path_factory.mktemp("fsdp-reference"))
