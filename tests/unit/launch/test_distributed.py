"""The process group from torchrun's environment and the loop's collectives, on one real gloo rank in this process
(`gloo_rank`): what each returns and how a ConfigError on rank 0 reaches every rank. Several ranks: the 2-rank
runs in tests/e2e."""

from __future__ import annotations

import pytest

from model_utils.errors import ConfigError
from model_utils.launch import distributed


def test_without_torchrun_the_missing_variables_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as err:
        distributed.init_distributed()
    message = str(err.value)
    assert message.startswith("RANK, WORLD_SIZE, MASTER_PORT not set: launch with torchrun")
    assert "\n" not in message


def test_the_collectives_on_one_rank(gloo_rank) -> None:
    assert (gloo_rank.rank, gloo_rank.world_size, gloo_rank.is_main) == (0, 1, True)
    cpu = gloo_rank.device
    assert distributed.all_reduce_sum([2.5, 3.0], cpu) == [2.5, 3.0]
    assert distributed.mean_and_max([1.0, 2.0], [7.0], cpu) == ([1.0, 2.0], [7.0])
    assert distributed.any_rank([True, False, True], cpu) == [True, False, True]


def test_main_first_and_decide_on_main_run_once_and_carry_rank_0s_error(gloo_rank) -> None:
    calls = []

    def build() -> str:
        calls.append("built")
        return "cache"

    assert distributed.main_first(build, gloo_rank) == "cache" and calls == ["built"]
    assert distributed.decide_on_main(lambda: {"micro_batch": 4}, gloo_rank) == {"micro_batch": 4}

    def refuse() -> None:
        raise ConfigError("dataset d.jsonl is empty")

    with pytest.raises(ConfigError, match=r"^dataset d\.jsonl is empty$"):
        distributed.main_first(refuse, gloo_rank)
    with pytest.raises(ConfigError, match=r"^dataset d\.jsonl is empty$"):
        distributed.decide_on_main(refuse, gloo_rank)


def test_groups_of_consecutive_ranks_share_sequences_and_read_one_share_of_the_data() -> None:
    """--sequence_parallel 2 on 4 ranks: ranks 0-1 and 2-3 are the groups (as DeepSpeed's Ulysses forms them)."""
    import torch

    ranks = [distributed.DistInfo(r, r, 4, torch.device("cpu"), sequence_parallel=2) for r in range(4)]
    assert ranks[0].readers == "2 groups of 2 ranks"
    assert [(d.data_rank, d.data_ranks, d.shard) for d in ranks] == [
        (0, 2, (0, 2)), (0, 2, (1, 2)), (1, 2, (0, 2)), (1, 2, (1, 2)),
    ]  # fmt: skip
    alone = distributed.DistInfo(3, 3, 4, torch.device("cpu"))
    assert (alone.data_rank, alone.data_ranks, alone.shard, alone.readers) == (3, 4, (0, 1), "4 ranks")


def test_the_flight_recorder_is_set_under_the_name_this_torch_reads_unless_the_user_set_it() -> None:
    """torch 2.11 warns on every rank when TORCH_NCCL_TRACE_BUFFER_SIZE is set (seen on an H200); 2.6-2.10 read
    only that name."""
    new, old = distributed.FLIGHT_RECORDER_BUFFER
    assert distributed.flight_recorder_env({}, "2.11.0+cu130") == {
        new: "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    assert distributed.flight_recorder_env({}, "2.15.0") == {new: "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert distributed.flight_recorder_env({}, "2.6.0a0+ecf3bae40a.nv25.01") == {
        old: "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    # the user's choice, under either name (0 turns it off), stands
    assert distributed.flight_recorder_env({old: "0"}, "2.15.0") == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert distributed.flight_recorder_env({new: "500", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, "2.6.0") == {}
