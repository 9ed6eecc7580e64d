"""Shared fixtures and hooks for tests/unit, tests/e2e and tests/slurm.

- `single_rank`: one in-process gloo process group of one rank, for tests that drive the real Trainer.
- `rank_pool` (session, autouse): ends the rank servers of tests/support/rank_pool.py that the session's runs
  started (each starts on its first run: a session without multi-rank runs starts none).
- `moto_endpoint`, `s3`, `denied_server`, `s3_denied`: a real S3 API (moto server) on loopback, and
  `no_secret_in_output` (tests/support/s3_server.py).
- Tests marked `gpu` are skipped, with the reason, where torch sees no CUDA GPU (one hook, not a skipif each).
- Under `make test`, every test holds the tiers' shared lock and a test marked `quiet` an exclusive one
  (tests/support/tier_lock.py); the quiet tests run first; torch computes on one thread in the pytest process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from model_utils.launch import startup
from support import rank_pool as pool
from support import tier_lock
from support.ports import free_port
from support.s3_server import (  # noqa: F401  (fixtures)
    denied_server,
    moto_endpoint,
    no_secret_in_output,
    s3,
    s3_denied,
)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def pytest_sessionstart(session: pytest.Session) -> None:
    # As in the kit's processes (launch/startup.py): this one comes to hold about 700,000 objects and each full
    # collection walked them all (on tests/unit/data and tests/unit/loop, 11 full collections took 1.3 s of 21 s).
    startup.fewer_full_collections()
    # This process renders chat templates (the chat, export and eval tests) and also runs the in-process Trainer,
    # whose resolver imports transformers without jinja2 for a run without chat data: the first import decides for
    # the whole session, so it is made here, with them, not by whichever test comes first.
    startup.import_transformers(chat_templates=True)
    if tier_lock.side_by_side():
        # Beside the other tier both cores are busy: torch's second thread in this process (its in-process models)
        # mostly spins waiting for a core. Measured on a torch-heavy file beside two busy cores: 14 CPU-s with one
        # thread, 18 with two, and a quarter less wall time. The ranks have one thread each already (torchrun's).
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Quiet tests first: at the start the other tier is still collecting, so neither tier waits for the other's
    # running test (tests/support/tier_lock.py). A stable sort keeps the order within each group.
    items.sort(key=lambda item: item.get_closest_marker("quiet") is None)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    # The stop signals' handlers as they were: an in-process trainer or SageMaker entry installs its own, and
    # a SIGTERM handler left behind is inherited by every pool worker forked later (lm-eval's bootstrap), which
    # then survives its pool's terminate: the suite hung there.
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        with tier_lock.holding(quiet=item.get_closest_marker("quiet") is not None):
            return (yield)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.fixture(scope="session", autouse=True)
def rank_pool() -> Iterator[pool.RankPool]:
    """The rank pool multi-rank runs fork their ranks from (support.rank_pool.run_ranks uses this one)."""
    try:
        yield pool.POOL
    finally:
        pool.POOL.close()


@pytest.fixture(scope="session")
def single_rank():
    """A real gloo process group of one rank in this pytest process (as torchrun would set it up)."""
    port = free_port()
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
    from model_utils.launch import distributed

    return distributed.init_distributed()
