"""Prompt/completion and conversation data through `dskit prepare-data` and the in-process path: the masks stored
beside the tokens (parallel, killed and resumed: the same bytes; checksummed and verified), the options in the
plan (a changed one prepares anew), bad rows and untrained rows in one line with nothing looking finished."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model_utils.config import run_file
from model_utils.config.arguments import SECTIONS, DataArgs
from model_utils.data import chat, documents, token_shards
from model_utils.errors import ConfigError
from support.chat_data import FAMILIES, chat_tokenizer, conversations, write_rows
from support.prepared_data import prep, run_data


@pytest.fixture
def qwen3(tmp_path: Path):
    path = tmp_path / "qwen3-tokenizer"
    return chat_tokenizer(FAMILIES["qwen3"], path), path


def _chats(n: int) -> list[dict]:
    base = conversations("qwen3")
    return [
        {"messages": [{**m, "content": f"{m['content']} ({i})"} for m in base[i % len(base)]]}
        for i in range(n)
    ]


def _all_rows(dataset, split: str, seq: int):
    blocks = dataset.blocks(split, seq)
    return blocks, blocks.rows(np.arange(len(blocks)))


def test_prepare_data_stores_masks_that_survive_parallel_kill_and_resume(
    tmp_path: Path, qwen3, monkeypatch
) -> None:
    tokenizer, tokenizer_dir = qwen3
    source = write_rows(tmp_path / "chats.jsonl", _chats(600))
    args = ["--dataset", str(source), "--tokenizer", str(tokenizer_dir), "--unit_mb", "0.03"]
    assert prep(tmp_path / "two", *args, "--num_proc", "2") == 0
    two = token_shards.open_prepared(tmp_path / "two")
    assert two.manifest["data_format"] == "messages" and two.manifest["units"] > 3
    assert all("mask" in shard for shard in two.manifest["shards"]["train"])

    real_read = documents.read
    calls = []

    class KilledInUnit2:
        def __init__(self, unit, field, scratch) -> None:
            calls.append(unit.start)
            self.reading = real_read(unit, field, scratch)
            self.where = self.reading.where

        def __iter__(self):
            for i, item in enumerate(self.reading):
                yield item
                if len(calls) == 3 and i == 0:
                    raise KeyboardInterrupt  # killed mid-unit

    monkeypatch.setattr(documents, "read", KilledInUnit2)
    with pytest.raises(KeyboardInterrupt):
        prep(tmp_path / "cut", *args, "--num_proc", "1")
    cut = tmp_path / "cut"
    assert token_shards.state(cut) == "unfinished"
    assert not [
        p for p in (cut / ".staging").rglob("*") if p.is_file()
    ]  # the cut unit's tokens and mask gone
    monkeypatch.setattr(documents, "read", real_read)
    assert prep(cut, *args, "--num_proc", "1") == 0
    resumed = token_shards.open_prepared(cut)
    assert resumed.manifest["shards"] == two.manifest["shards"]  # tokens and masks, byte for byte

    # What a run reads: each row's targets are exactly the assistant turns' tokens, never a document's first.
    blocks, rows = _all_rows(resumed, "train", 256)
    trained_text = tokenizer.decode(rows.tokens[rows.targets])
    assert "Four. (0)<|im_end|>" in trained_text and "What is two plus two?" not in trained_text
    assert not rows.targets[rows.positions == 0].any()
    assert blocks.stats.documents == two.manifest["documents"]["train"]


def test_a_corrupted_mask_is_found_by_verification(tmp_path: Path, qwen3) -> None:
    _, tokenizer_dir = qwen3
    source = write_rows(tmp_path / "chats.jsonl", _chats(50))
    out = tmp_path / "p"
    assert prep(out, "--dataset", str(source), "--tokenizer", str(tokenizer_dir), "--num_proc", "1") == 0
    mask = out / "train" / "00000.mask"
    data = bytearray(mask.read_bytes())
    data[5] ^= chat.TRAINED
    mask.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"shard train/00000.mask does not match its checksum"):
        token_shards.open_prepared(out)


def test_changed_chat_options_prepare_anew_and_are_refused_for_a_prepared_dir(tmp_path: Path, qwen3) -> None:
    tokenizer, tokenizer_dir = qwen3
    source = write_rows(tmp_path / "chats.jsonl", _chats(40))
    cache = str(tmp_path / "cache")
    answers_only = run_data(
        DataArgs(dataset=str(source), data_cache_dir=cache, validation_fraction=0), tokenizer
    )
    everything = run_data(
        DataArgs(dataset=str(source), data_cache_dir=cache, validation_fraction=0, train_on_prompt=True),
        tokenizer,
    )
    assert answers_only.path != everything.path
    _, few = _all_rows(answers_only, "train", 128)
    _, all_ = _all_rows(everything, "train", 128)
    assert few.targets.sum() < all_.targets.sum()
    template = tmp_path / "llama.jinja"
    template.write_text((Path(__file__).parents[2] / "support/chat_templates/llama3_1.jinja").read_text())
    other = run_data(
        DataArgs(
            dataset=str(source), data_cache_dir=cache, validation_fraction=0, chat_template=str(template)
        ),
        tokenizer,
    )
    assert other.path not in (answers_only.path, everything.path)
    assert other.manifest["chat"]["template_from"] == str(template)
    args = ["--dataset", str(source), "--tokenizer", str(tokenizer_dir), "--num_proc", "1"]
    assert prep(tmp_path / "p", *args) == 0
    with pytest.raises(ConfigError, match=r"differs in: chat"):
        prep(tmp_path / "p", *args, "--train_on_prompt", "true")
    with pytest.raises(ConfigError, match=r"differs in: chat"):
        prep(tmp_path / "p", *args, "--enable_thinking", "false")
    assert prep(tmp_path / "no-think", *args, "--enable_thinking", "false") == 0
    record = json.loads((tmp_path / "no-think" / token_shards.PLAN).read_text())
    assert record["chat"]["template_kwargs"] == {"enable_thinking": False}
    assert "--enable_thinking false" in token_shards.prepare_command(tmp_path / "no-think", record)
    _, thinking = _all_rows(token_shards.open_prepared(tmp_path / "p"), "train", 128)
    _, plain = _all_rows(token_shards.open_prepared(tmp_path / "no-think"), "train", 128)
    # Non-thinking mode: the empty <think></think> of each last turn moves from the trained answer to the prompt.
    assert plain.targets.sum() < thinking.targets.sum()
    assert plain.tokens.size == thinking.tokens.size


@pytest.mark.parametrize(
    ("bad", "wrong"),
    [
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], "message 1 is an empty"),
        (
            [{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "a"}],
            "message 0 has the unknown",
        ),
    ],
)
def test_a_bad_row_stops_the_preparation_in_one_line_leaving_nothing_finished(
    tmp_path: Path, qwen3, bad: list[dict], wrong: str
) -> None:
    rows = _chats(30)
    rows[17] = {"messages": bad}
    source, line = _row_18_refused(tmp_path / "chats.jsonl", rows, qwen3[1])
    assert line.startswith(f"{source} line 18: {wrong}") and "\n" not in line  # the file's line, from 1


def _row_18_refused(source: Path, rows: list[dict], tokenizer_dir: Path) -> tuple[Path, str]:
    """Prepares rows whose line 18 is bad, in units of a few rows (line 18 in a later one): the error line, and
    nothing finished or left in staging."""
    write_rows(source, rows)
    out = source.parent / "p"
    unit_mb = 0.001
    assert len(documents.plan(DataArgs(dataset=str(source)), int(unit_mb * 2**20)).units) > 3
    args = ["--dataset", str(source), "--tokenizer", str(tokenizer_dir), "--unit_mb", str(unit_mb)]
    with pytest.raises(ConfigError) as raised:
        prep(out, *args, "--num_proc", "1")
    assert token_shards.state(out) == "unfinished"
    assert not [p for p in (out / ".staging").rglob("*") if p.is_file()]  # its unit's tokens and mask gone
    return source, str(raised.value)


def test_rows_without_an_assistant_turn_are_counted_then_refused_past_the_limit(
    tmp_path: Path, qwen3
) -> None:
    tokenizer, _ = qwen3
    no_answer = {"messages": [{"role": "user", "content": "Hello?"}]}
    few = write_rows(tmp_path / "few.jsonl", [*_chats(199), no_answer])  # 0.5%: counted
    dataset = run_data(
        DataArgs(dataset=str(few), data_cache_dir=str(tmp_path / "c"), validation_fraction=0), tokenizer
    )
    record = json.loads((dataset.path / "units" / "00000.json").read_text())
    assert record["untrained_documents"] == 1
    many = write_rows(tmp_path / "many.jsonl", [*_chats(20), no_answer, no_answer])
    with pytest.raises(
        ConfigError,
        match=r"^2 of 22 conversations in .*many.jsonl.* have no token to train on "
        r"\(the first: .*many.jsonl line 21;",
    ):
        run_data(DataArgs(dataset=str(many), data_cache_dir=str(tmp_path / "c")), tokenizer)
    assert not list((tmp_path / "c").rglob("manifest.json"))[1:]  # only the first dataset's


def test_conversations_given_as_text_are_one_line_and_auto_reads_them(tmp_path: Path, qwen3) -> None:
    tokenizer, _ = qwen3
    source = write_rows(tmp_path / "chats.jsonl", _chats(20))
    cache = str(tmp_path / "c")
    with pytest.raises(ConfigError, match=r"field 'messages' of .* holds list values, not text"):
        run_data(
            DataArgs(dataset=str(source), text_field="messages", data_format="text", data_cache_dir=cache),
            tokenizer,
        )
    dataset = run_data(DataArgs(dataset=str(source), text_field="messages", data_cache_dir=cache), tokenizer)
    assert dataset.manifest["data_format"] == "messages" and sum(dataset.manifest["documents"].values()) == 20


def test_prompt_completion_parquet_and_the_text_record_unchanged(tmp_path: Path, qwen3, tokenizer) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat_tok, _ = qwen3
    table = pa.table(
        {"prompt": [f"Say {i}:" for i in range(30)], "completion": [f" {i}." for i in range(30)]}
    )
    pq.write_table(table, tmp_path / "pc.parquet")
    dataset = run_data(
        DataArgs(
            dataset=str(tmp_path / "pc.parquet"), data_cache_dir=str(tmp_path / "c"), validation_fraction=0
        ),
        chat_tok,
    )
    assert dataset.manifest["data_format"] == "prompt_completion"
    _, rows = _all_rows(dataset, "train", 64)
    assert chat_tok.decode(rows.tokens[rows.targets]).count("<|im_end|>") == 30  # each completion's EOS
    assert "Say" not in chat_tok.decode(rows.tokens[rows.targets])
    text = write_rows(tmp_path / "t.jsonl", [{"text": "plain words"}] * 5)
    plain = run_data(DataArgs(dataset=str(text), data_cache_dir=str(tmp_path / "c")), tokenizer)
    assert not {"data_format", "fields", "chat"} & set(plain.manifest)  # a text preparation as it always was
    with pytest.raises(
        ConfigError, match=r"^--chat_template applies to prompt/completion and conversation rows"
    ):
        run_data(
            DataArgs(dataset=str(text), data_cache_dir=str(tmp_path / "c"), chat_template="t.jinja"),
            tokenizer,
        )
    with pytest.raises(
        ConfigError, match=r"^--enable_thinking applies to prompt/completion and conversation"
    ):
        run_data(
            DataArgs(dataset=str(text), data_cache_dir=str(tmp_path / "c"), enable_thinking=False), tokenizer
        )


def test_the_data_flags_are_run_file_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "data: {data_format: messages, chat_template: t.jinja, train_on_prompt: true, enable_thinking: false}\n"
    )
    values = run_file.load(str(path), SECTIONS).values
    assert values["data_format"] == "messages" and values["chat_template"] == "t.jinja"
    assert values["train_on_prompt"] is True and values["enable_thinking"] is False
    with pytest.raises(ConfigError, match="--data_format 'chat' is not one of"):
        DataArgs(data_format="chat")


def test_the_shipped_conversations_prepare_with_the_tiny_tokenizer(tmp_path: Path, tokenizer) -> None:
    from model_utils.assets import CHAT_TEMPLATE_PATH, CONVERSATIONS_PATH

    module = _tool("example_conversations")
    assert CONVERSATIONS_PATH.read_text() == module.render(
        module.conversations()
    )  # regenerated byte for byte
    data = DataArgs(
        dataset=str(CONVERSATIONS_PATH),
        chat_template=str(CHAT_TEMPLATE_PATH),
        data_cache_dir=str(tmp_path / "c"),
        validation_fraction=0.05,
    )
    dataset = run_data(data, tokenizer)
    assert dataset.manifest["data_format"] == "messages"
    assert sum(dataset.manifest["documents"].values()) == 300
    blocks, rows = _all_rows(dataset, "train", 256)
    trained = tokenizer.decode(rows.tokens[rows.targets])
    assert "plus" in trained and "What" not in trained and "User:" not in trained
    assert blocks.stats.fill > 0.9 and blocks.stats.dropped == 0


def test_an_array_of_two_tasks_prepares_the_same_masks_as_one_process(tmp_path: Path, qwen3) -> None:
    _, tokenizer_dir = qwen3
    source = write_rows(tmp_path / "chats.jsonl", _chats(200))
    args = [
        "--dataset",
        str(source),
        "--tokenizer",
        str(tokenizer_dir),
        "--unit_mb",
        "0.02",
        "--num_proc",
        "1",
    ]
    assert prep(tmp_path / "one", *args) == 0
    array = tmp_path / "array"
    assert prep(array, *args, "--task_index", "0", "--num_tasks", "2") == 0
    assert token_shards.state(array) == "unfinished"  # task 1's units are not done yet
    assert prep(array, *args, "--task_index", "1", "--num_tasks", "2") == 0
    one, both = token_shards.open_prepared(tmp_path / "one"), token_shards.open_prepared(array)
    assert one.manifest["units"] > 2 and both.manifest["shards"] == one.manifest["shards"]


def test_the_bench_pair_holds_one_conversations_contents_as_text(tmp_path: Path) -> None:
    """tools/chat_bench_data.py (docs/data.md's conversations-against-text figures): each text row is its
    conversation's contents, the turns alternate after an optional system message, each turn in the asked range."""
    import subprocess
    import sys

    tool = Path(__file__).parents[3] / "tools" / "chat_bench_data.py"
    subprocess.run(
        [sys.executable, str(tool), str(tmp_path), "--rows", "50", "--turn_chars", "20,60"], check=True
    )
    chats = [json.loads(line)["messages"] for line in (tmp_path / "chats.jsonl").read_text().splitlines()]
    texts = [json.loads(line)["text"] for line in (tmp_path / "text.jsonl").read_text().splitlines()]
    assert len(chats) == len(texts) == 50
    for messages, text in zip(chats, texts, strict=True):
        assert text == "\n".join(m["content"] for m in messages)
        turns = messages[1:] if messages[0]["role"] == "system" else messages
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2) and 1 <= len(
            turns
        ) // 2 <= 3
        # words are added until the turn is long enough: without its last word it was not yet
        assert all(len(m["content"]) >= 20 and len(m["content"].rpartition(" ")[0]) < 60 for m in turns)


# --- preference pairs -----------------------------------------------------------------------------------


def _pairs(n: int) -> list[dict]:
    """Conversational preference rows, each its own."""
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {i} plus one?"}],
            "chosen": [{"role": "assistant", "content": f"It is {i + 1}."}],
            "rejected": [{"role": "assistant", "content": f"um, {i + 7}"}],
        }
        for i in range(n)
    ]


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[3] / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_preferences_prepare_into_pairs_read_as_trls_batches(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from model_utils.assets import CHAT_TEMPLATE_PATH, PREFERENCES_PATH, TOKENIZER_DIR
    from model_utils.data.pairs import PairBlocks
    from support.preference_data import collated, dpo_tokenized

    module = _tool("example_preferences")
    rows = module.preferences()
    assert PREFERENCES_PATH.read_text() == module.render(rows)  # regenerated byte for byte
    assert len(rows) == 64 and all(r["chosen"] != r["rejected"] for r in rows)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    said = []
    data = DataArgs(
        dataset=str(PREFERENCES_PATH),
        chat_template=str(CHAT_TEMPLATE_PATH),
        data_cache_dir=str(tmp_path / "c"),
        validation_fraction=0,
    )
    dataset = run_data(data, tokenizer)
    assert dataset.manifest["data_format"] == "preference"
    assert dataset.manifest["fields"] == ["prompt", "chosen", "rejected"]
    assert dataset.manifest["documents"] == {"train": 64, "validation": 0}
    tokenizer.chat_template = CHAT_TEMPLATE_PATH.read_text()
    (theirs,) = dpo_tokenized(tokenizer, [rows], tmp_path)
    longest = max(len(p) + max(len(c), len(r)) for p, c, r in theirs)
    for seq, mode in ((longest, "keep_start"), (24, "keep_start"), (24, "keep_end")):
        blocks = dataset.blocks("train", seq, truncation_mode=mode)
        assert isinstance(blocks, PairBlocks)
        kept = [t for t in theirs if mode == "keep_end" or len(t[0]) < seq]
        assert len(blocks) == len(kept) and blocks.stats.dropped == len(theirs) - len(kept)
        order = np.arange(len(blocks))
        rows_ = blocks.rows(order)
        batch = collated(kept, dataset.document_end, seq, mode)
        width = batch["input_ids"].shape[1]  # TRL's, to the longest row; the kit's rows are whole blocks
        assert (
            rows_.tokens.shape[1] == seq and rows_.tokens[:, :width].tolist() == batch["input_ids"].tolist()
        )
        assert (rows_.targets[:, 1:width] == batch["completion_mask"].numpy()[:, 1:].astype(bool)).all()
        assert not rows_.targets[:, width:].any()
        said.append(blocks.summary)
        assert rows_.reference is None
        blocks.reference = np.stack([-order, -order - 0.5], axis=1)
        assert blocks.rows(np.array([2, 0])).reference.tolist() == [-2, 0, -2.5, -0.5]
    assert (
        said[0]
        == f"Data: 64 pairs (train); 0 truncated to --seq_length {longest} (keep_start), 0 dropped: their prompt fills --seq_length"
    )
    assert said[2].startswith("Data: 64 pairs (train); ") and said[2].endswith(
        "truncated to --seq_length 24 (keep_end)"
    )
    # the chosen answers are trained on, their prompts are not
    trained = tokenizer.decode(rows_.tokens[: len(blocks)][rows_.targets[: len(blocks)]])
    assert "plus" in trained and "um, i think" not in trained and "User:" not in trained


def test_pairs_are_held_out_whole_and_an_implicit_prompt_prepares(tmp_path: Path, qwen3) -> None:
    tokenizer, _ = qwen3
    cache = str(tmp_path / "c")
    source = write_rows(tmp_path / "prefs.jsonl", _pairs(200))
    dataset = run_data(
        DataArgs(dataset=str(source), data_cache_dir=cache, validation_fraction=0.1), tokenizer
    )
    assert (
        sum(dataset.manifest["documents"].values()) == 200
        and dataset.manifest["documents"]["validation"] > 10
    )
    for split in ("train", "validation"):
        blocks = dataset.blocks(split, 64)
        assert len(blocks) == dataset.manifest["documents"][split]
        rows = blocks.rows(np.arange(len(blocks)))
        n = len(blocks)
        chosen = [tokenizer.decode(r) for r in rows.tokens[:n]]
        rejected = [tokenizer.decode(r) for r in rows.tokens[n:]]
        for c, r in zip(chosen, rejected, strict=True):  # the same pair's, in the same order
            assert c.split("plus")[0] == r.split("plus")[0] and "um," in r and "um," not in c
    implicit = [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in _pairs(20)
    ]
    source = write_rows(tmp_path / "implicit.jsonl", implicit)
    dataset = run_data(DataArgs(dataset=str(source), data_cache_dir=cache, validation_fraction=0), tokenizer)
    assert (
        dataset.manifest["fields"] == ["chosen", "rejected"] and dataset.manifest["documents"]["train"] == 20
    )
    explicit = run_data(
        DataArgs(dataset=str(tmp_path / "prefs.jsonl"), data_cache_dir=cache, validation_fraction=0),
        tokenizer,
    )
    ours = dataset.blocks("train", 64).rows(np.arange(20))
    assert ours.tokens.tolist() == explicit.blocks("train", 64).rows(np.arange(20)).tokens.tolist()


@pytest.mark.parametrize(
    ("bad", "wrong"),
    [
        ({"prompt": "Q", "chosen": "a"}, "has no field 'rejected' (fields: prompt, chosen)"),
        (
            {"prompt": [{"role": "user", "content": "Q"}], "chosen": [], "rejected": []},
            "'chosen' is an empty list",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "Q"}],
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "a"}],
            },
            "'chosen' and 'rejected' are identical",
        ),
        (
            {
                "prompt": "Q",
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "'prompt' is text and 'chosen' a list of messages",
        ),
        ({"prompt": [{"role": "user", "content": "Q"}], "chosen": None, "rejected": []}, "'chosen' is null"),
    ],
)
def test_a_bad_pair_stops_the_preparation_in_one_line_leaving_nothing_finished(
    tmp_path: Path, qwen3, bad: dict, wrong: str
) -> None:
    rows = _pairs(30)
    rows[17] = bad
    source, line = _row_18_refused(tmp_path / "prefs.jsonl", rows, qwen3[1])
    assert (
        line.startswith(f"{source} line 18{'' if 'no field' in wrong else ':'} {wrong}") and "\n" not in line
    )
    assert "fix the row" in line


def test_train_on_prompt_is_refused_for_pairs_and_mixtures_of_pairs_are_refused(
    tmp_path: Path, qwen3
) -> None:
    from model_utils.data import mixture

    tokenizer, _ = qwen3
    source = write_rows(tmp_path / "prefs.jsonl", _pairs(10))
    cache = str(tmp_path / "c")
    with pytest.raises(ConfigError) as raised:
        run_data(DataArgs(dataset=str(source), data_cache_dir=cache, train_on_prompt=True), tokenizer)
    assert str(raised.value).startswith(
        "--train_on_prompt applies to prompt/completion and conversation rows, and "
    )
    assert "holds preference pairs" in str(raised.value) and "\n" not in str(raised.value)
    dataset = run_data(DataArgs(dataset=str(source), data_cache_dir=cache), tokenizer)
    with pytest.raises(
        ConfigError, match=r"^source prefs holds preference pairs, which --sources does not mix"
    ):
        mixture._source_blocks("prefs", dataset, "train", 64)
    with pytest.raises(ConfigError, match=r"--truncation_mode 'keep_middle' is not a truncation mode"):
        DataArgs(truncation_mode="keep_middle")


def test_a_max_tokens_prefix_reads_whole_pairs(tmp_path: Path, qwen3) -> None:
    _, tokenizer_dir = qwen3
    source = write_rows(tmp_path / "prefs.jsonl", _pairs(40))
    args = ["--dataset", str(source), "--tokenizer", str(tokenizer_dir), "--validation_fraction", "0"]
    assert prep(tmp_path / "all", *args) == 0
    whole = token_shards.open_prepared(tmp_path / "all").blocks("train", 64)
    ends = np.cumsum(whole.chosen_length + whole.rejected_length)
    assert prep(tmp_path / "cut", *args, "--max_tokens", str(ends[4] + 3)) == 0
    cut = token_shards.open_prepared(tmp_path / "cut")
    assert cut.tokens("train") == ends[4] + 3  # the manifest cuts the sixth pair
    blocks = cut.blocks("train", 64)
    assert len(blocks) == 5  # the pair the cut runs through is not read
    assert blocks.rows(np.arange(5)).tokens.tolist() == whole.rows(np.arange(5)).tokens.tolist()


def test_pairs_in_parquet_prepare_as_the_same_pairs_in_json_lines(tmp_path: Path) -> None:
    """The shipped pairs written as parquet (conversations as lists of structs) prepare into the same documents, and
    so does the standard (text) form read from parquet as from JSON lines."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from model_utils.assets import CHAT_TEMPLATE_PATH, PREFERENCES_PATH, TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    rows = [json.loads(line) for line in PREFERENCES_PATH.read_text().splitlines()]
    text = [{"prompt": r["prompt"][0]["content"], "chosen": " " + r["chosen"][0]["content"], "rejected": " " + r["rejected"][0]["content"]} for r in rows]  # fmt: skip
    for name, records in (("chats", rows), ("text", text)):
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{name}.parquet")
        lines = write_rows(tmp_path / f"{name}.jsonl", records)
        prepared = []
        for source in (tmp_path / f"{name}.parquet", lines):
            data = DataArgs(
                dataset=str(source),
                chat_template=str(CHAT_TEMPLATE_PATH),
                data_cache_dir=str(tmp_path / f"c-{source.suffix}-{name}"),
                validation_fraction=0,
            )
            dataset = run_data(data, tokenizer)
            assert dataset.manifest["data_format"] == "preference", name
            blocks = dataset.blocks("train", 128)
            prepared.append(blocks.rows(np.arange(len(blocks))))
        assert len(prepared[0].tokens) == 2 * 64
        assert np.array_equal(prepared[0].tokens, prepared[1].tokens), name
        assert np.array_equal(prepared[0].targets, prepared[1].targets), name
