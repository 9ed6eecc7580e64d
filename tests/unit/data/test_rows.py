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


def test_documents_apart_restart_positions_after_each_end_and_at_each_row() -> None:
    eos = 0
    stream = np.array([5, 6, eos, 7, 8, 9, eos, 3, 4, 1, 2, eos, eos, 6], dtype=np.uint16)
    blocks: BlockSource = TokenBlocks([stream[:5], stream[5:]], seq_length=7, document_end=eos)
    rows = blocks.rows(np.array([0, 1]))
    assert rows.tokens.tolist() == [[5, 6, eos, 7, 8, 9, eos], [3, 4, 1, 2, eos, eos, 6]]
    # A row starts a document (the rest of one cut by the row's start is a document of its own), and so does
    # the token after each end; an empty document (eos right after eos) is its end token alone.
    assert rows.positions is not None and rows.targets is not None
    assert rows.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 0]]
    assert rows.targets.tolist() == [
        [False, True, True, False, True, True, True],
        [False, True, True, True, True, False, False],
    ]
    stream_rows = TokenBlocks([stream], seq_length=7).rows(np.array([0, 1]))
    assert stream_rows.targets is None and stream_rows.positions is None
