"""Fixtures shared by unit tests in several folders."""

from __future__ import annotations

import pytest

from model_utils.assets import TOKENIZER_DIR


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded tiny-qwen3 tokenizer (the data tests prepare their datasets with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
