"""Shared fixtures: one in-process, single-rank process group for tests that drive the real Trainer."""

from __future__ import annotations

import os
import socket

import pytest


@pytest.fixture(scope="session")
def single_rank():
    """A real gloo process group of one rank in this pytest process (as torchrun would set it up)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    # Left set, as inside torchrun: DeepSpeed reads LOCAL_RANK when it builds an engine. Subprocesses the
    # tests start (torchrun, sbatch) set their own.
    os.environ.update(env)
    from model_utils import distributed

    return distributed.init_distributed()
