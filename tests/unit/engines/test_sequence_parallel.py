"""What DeepSpeed's Ulysses cannot split is one line before any rank trains (engines/sequence_parallel.check), from
the ranks, `dskit config` and the doctor's row in `dskit preflight`; the flags it excludes are refused when
parsed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dskit import cli
from model_utils.config.arguments import parse_args
from model_utils.engines import sequence_parallel
from model_utils.errors import ConfigError
from model_utils.resolve import resolver


def model(heads: int, kv_heads: int) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)


@pytest.mark.parametrize(
    ("n", "heads", "kv", "seq", "ranks", "message"),
    [
        (3, 6, 6, 96, 4, "--sequence_parallel 3 does not divide the 4 ranks into groups: use one of 1, 2, 4"),
        (2, 4, 2, 63, 2, "sequence length 63 does not split into 2 equal slices (--sequence_parallel 2): set "
         "--seq_length to a multiple of 2, e.g. 62"),
        (4, 6, 2, 64, 4, "--sequence_parallel 4: the model's 6 attention heads do not split 4 ways: use a divisor of 6"),
        (4, 8, 3, 64, 8, "--sequence_parallel 4: the model's 3 key/value heads neither split 4 ways nor replicate to "
         "4: use a divisor or a multiple of 3"),
    ],
)  # fmt: skip
def test_what_cannot_be_split_is_one_line(n, heads, kv, seq, ranks, message) -> None:
    cfg = parse_args(["--sequence_parallel", str(n)])
    with pytest.raises(ConfigError) as refused:
        sequence_parallel.check(cfg, model(heads, kv), seq, ranks)
    assert str(refused.value) == message


def test_what_splits_passes_and_fewer_kv_heads_than_ranks_are_replicated() -> None:
    cfg = parse_args(["--sequence_parallel", "4"])
    sequence_parallel.check(cfg, model(16, 8), 4096, 8)
    sequence_parallel.check(cfg, model(16, 2), 4096, None)  # 2 key/value heads, each on 2 ranks
    sequence_parallel.check(parse_args([]), model(3, 3), 7, 5)  # nothing to split


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sample_prompts", "p.txt"], "--sample_prompts and --sequence_parallel 2: samples are not generated under "
         "sequence parallelism: drop one of them (sample the exported model instead)"),
        (["--sequence_parallel", "0"], "--sequence_parallel 0 must be at least 1"),
    ],
)  # fmt: skip
def test_what_it_excludes_is_refused_when_parsed(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        resolver.resolve_settings(parse_args(["--sequence_parallel", "2", *flags]))
    assert str(refused.value) == message


def test_dskit_config_counts_each_sequence_once(capsys) -> None:
    """2 CPU ranks sharing each sequence: one data-parallel group, its batch in tokens the sequence's."""
    assert cli.main(["config", "--sequence_parallel", "2", "--max_steps", "3"]) == 0
    resolved = json.loads(capsys.readouterr().out)["resolved"]
    assert resolved["batch_layout"] == (
        "batch layout (micro batch x accumulation x groups of 2 ranks x seq = tokens/step): 1 x 1 x 1 x 256 = 256"
    )
    assert resolved["steps_per_epoch"] == 2464  # twice the data-parallel run's 1,232: one sequence a step
    assert resolved["world_size"] == 2


def test_preflight_refuses_groups_that_do_not_divide_the_ranks(tmp_path: Path, monkeypatch, capsys) -> None:
    """The doctor's row, against the ranks the launch starts (CPU_RANKS here): the preflight stops before prepare."""
    monkeypatch.setenv("CPU_RANKS", "2")
    assert cli.main(["preflight", "--sequence_parallel", "4", "--checkpoint_dir", str(tmp_path / "ck")]) == 1
    table = capsys.readouterr().out
    (row,) = [line for line in table.splitlines() if line.startswith("sequence parallel")]
    assert (
        "FAIL" in row and "--sequence_parallel 4 does not divide the 2" in row and "use one of 1, 2" in row
    ), row
    assert "ranks into groups" in table  # the found column wraps
    assert cli.main(["doctor", "--sequence_parallel", "2"]) in (0, 1)
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sequence parallel")]
    assert "PASS" in row and "1 group(s) of 2 of the 2" in row, row


def test_the_core_attention_keeps_documents_apart_with_one_mask_for_every_layer(monkeypatch) -> None:
    """After DeepSpeed's all-to-all the core attention sees the whole row's positions: where they restart, a
    block-diagonal causal mask, made once for all the layers of a forward (each keeps it for its backward);
    rows of one sequence get none (SDPA's causal path)."""
    import torch
    from transformers.integrations import sdpa_attention

    seen = []
    monkeypatch.setattr(
        sdpa_attention, "sdpa_attention_forward", lambda m, q, k, v, mask, **kw: seen.append(mask)
    )
    q = torch.zeros(1, 2, 5, 4)
    two_documents = torch.tensor([[0, 1, 2, 0, 1]])
    for _ in range(3):  # three layers
        sequence_parallel._attention(None, q, q, q, None, position_ids=two_documents.clone())
    sequence_parallel._attention(None, q, q, q, None, position_ids=torch.arange(5)[None])
    assert seen[0] is seen[1] is seen[2] and seen[3] is None
    assert seen[0][0, 0].int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1],
    ]  # fmt: skip
