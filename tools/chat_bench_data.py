"""A pair of files for timing `dskit prepare-data` on conversations against plain text of the same contents:
OUT/chats.jsonl ({"messages": [...]}: an optional system message, then 1-3 user/assistant turns) and
OUT/text.jsonl ({"text": ...}: each conversation's contents, one per line of a document). Words of README.md,
a fixed seed; docs/data.md has the figures (DIR: a tokenizer with Qwen3's stock template, there the tiny BPE
that tests/support/chat_data.py's chat_tokenizer gives Qwen3's special tokens and template).

    python tools/chat_bench_data.py OUT [--rows 6000] [--turn_chars 100,1200]
    .venv/bin/dskit bench --data OUT/chats.jsonl --tokenizer DIR --procs 1     # and OUT/text.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write(out: Path, rows: int, turn_chars: tuple[int, int], seed: int = 0) -> None:
    rng = random.Random(seed)
    words = (REPO / "README.md").read_text().split()

    def sentence(chars: int) -> str:
        """Words until the sentence has `chars` characters: without its last word it had fewer."""
        picked: list[str] = []
        length = -1  # of the words joined by spaces
        while length < chars:
            picked.append(rng.choice(words))
            length += len(picked[-1]) + 1
        return " ".join(picked)

    out.mkdir(parents=True, exist_ok=True)
    with (out / "chats.jsonl").open("w") as chats, (out / "text.jsonl").open("w") as text:
        for _ in range(rows):
            messages = [{"role": "system", "content": sentence(60)}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 3)):
                for role in ("user", "assistant"):
                    messages.append({"role": role, "content": sentence(rng.randint(*turn_chars))})
            chats.write(json.dumps({"messages": messages}) + "\n")
            text.write(json.dumps({"text": "\n".join(m["content"] for m in messages)}) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--turn_chars", default="100,1200", help="characters of a turn: LOW,HIGH")
    args = parser.parse_args(argv)
    low, high = (int(n) for n in args.turn_chars.split(","))
    write(args.out, args.rows, (low, high))


if __name__ == "__main__":
    main()
