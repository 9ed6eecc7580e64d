"""Fixtures shared by unit tests in several folders."""

from __future__ import annotations

import pytest
import torch

from model_utils.assets import TOKENIZER_DIR
from model_utils.config.presets import PRESETS
from model_utils.launch.distributed import DistInfo
from model_utils.resolve import memory_estimate
from support.ports import free_port


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded tiny-qwen3 tokenizer (the data tests prepare their datasets with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def shapes() -> dict[str, memory_estimate.ModelShape]:
    """The memory model's shape of each preset (counted on the meta device)."""
    return {name: memory_estimate.model_shape(PRESETS[name].build_config(), name, True) for name in PRESETS}


@pytest.fixture(scope="session")
def gloo_rank() -> DistInfo:
    """A real gloo process group of one rank in this process, set up by torch alone: DeepSpeed's communication
    backend (tests/conftest.py's single_rank, for the engines and the Trainer) JIT-builds its shared-memory op, and
    the unit tier needs no DeepSpeed op build. An existing group (single_rank's, earlier in the session) is reused."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    return DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
