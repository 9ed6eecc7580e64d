"""Fixtures shared by unit tests in several folders."""

from __future__ import annotations

import pytest

from model_utils.assets import TOKENIZER_DIR
from model_utils.config.presets import PRESETS
from model_utils.resolve import memory_estimate


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded tiny-qwen3 tokenizer (the data tests prepare their datasets with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def shapes() -> dict[str, memory_estimate.ModelShape]:
    """The memory model's shape of each preset (counted on the meta device)."""
    return {name: memory_estimate.model_shape(PRESETS[name].build_config(), name, True) for name in PRESETS}
