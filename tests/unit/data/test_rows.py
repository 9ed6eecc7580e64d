import numpy as np

from model_utils.data.rows import BlockSource, Rows
from model_utils.data.token_shards import TokenBlocks


def test_the_text_stream_answers_rows_with_tokens_only_across_shards() -> None:
    shards = [np.arange(10, dtype=np.uint16), np.arange(10, 20, dtype=np.uint16)]
    blocks: BlockSource = TokenBlocks(shards, seq_length=4)
    rows = blocks.rows(np.array([2, 0]))
    assert isinstance(rows, Rows) and rows.tokens.dtype == np.int64
    assert rows.tokens.tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]  # block 2 runs across the two shards
    assert rows.targets is None and rows.positions is None  # every token but the first trained, one sequence
