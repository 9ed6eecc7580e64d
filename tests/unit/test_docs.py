"""The docs guard, unit tier: every command README.md and docs/*.md show in a fenced block is classified once in
support/doc_commands.py (run by tests/e2e/test_docs.py, dry-run, or covered by a named test), and what can be
checked without running it is: a dry run's flags parse, a covering test exists and holds the command, every
sample of a command's output is held to what the command prints (by the e2e test, or listed as a gap), and the run
files the docs list are those configs/ ships."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from support import doc_commands
from support.doc_commands import COMMANDS, FLAGS, CoveredBy, DocCommand, DryRun, Run, Uncovered

REPO = doc_commands.REPO


def test_every_fenced_block_says_its_language() -> None:
    untagged = [block for file in doc_commands.doc_files() for block in doc_commands.untagged_blocks(file)]
    assert not untagged, (
        "fenced blocks with no known language tag (commands: "
        + ", ".join(doc_commands.COMMAND_LANGUAGES)
        + "; anything else: "
        + ", ".join(doc_commands.OTHER_LANGUAGES)
        + "):\n"
        + "\n".join(untagged)
    )


def test_every_documented_command_is_classified_and_every_classification_documented() -> None:
    documented = doc_commands.all_commands()
    unclassified = [f"{c.file}:{c.line}: {c.text}" for c in documented if c.text not in COMMANDS]
    assert not unclassified, (
        "documented commands with no entry in tests/support/doc_commands.py COMMANDS (Run, DryRun or "
        "CoveredBy):\n" + "\n".join(unclassified)
    )
    stale = sorted(set(COMMANDS) - {c.text for c in documented})
    assert not stale, "COMMANDS entries no page shows any more (remove or update them):\n" + "\n".join(stale)


def test_the_extraction_reads_commands_as_a_user_types_them(tmp_path: Path, monkeypatch) -> None:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "README.md").write_text("[page](docs/page.md)\n")
    page.write_text(
        "```bash\n"
        "# a comment line\n"
        ".venv/bin/dskit estimate --model x \\\n"
        "    --nodes 2   # two nodes\n"
        "a arg; b 'x # y'\n"
        "```\n"
        "```console\n"
        "$ .venv/bin/dskit doctor\n"
        "check  PASS  # output, not a command\n"
        "```\n"
        "```yaml\n"
        "# shown.yaml\n"
        "key: 1\n"
        "```\n"
        "```\n"
        "a tree\n"
        "```\n"
    )
    monkeypatch.setattr(doc_commands, "REPO", tmp_path)
    assert doc_commands.doc_files() == ["README.md", "docs/page.md"]
    assert doc_commands.commands("docs/page.md") == [
        DocCommand("docs/page.md", 3, ".venv/bin/dskit estimate --model x --nodes 2"),
        DocCommand("docs/page.md", 5, "a arg"),
        DocCommand("docs/page.md", 5, "b 'x # y'"),
        DocCommand("docs/page.md", 8, ".venv/bin/dskit doctor"),
    ]
    assert [(f.name, f.body) for f in doc_commands.shown_files("docs/page.md")] == [
        ("shown.yaml", "# shown.yaml\nkey: 1\n")
    ]
    assert doc_commands.untagged_blocks("docs/page.md") == ["docs/page.md:15 []"]


def test_output_samples_are_read_and_held_line_by_line_to_what_was_printed(
    tmp_path: Path, monkeypatch
) -> None:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "README.md").write_text("")
    page.write_text(
        "```console\n"
        "$ tool check\n"
        "tool check on node7 (1 node):\n"
        "disk   PASS  12.3 MiB free at /work/main/checkpoints, kept\n"
        "             for 4 checkpoints\n"
        "$ tool quiet\n"
        "```\n"
        "```bash\n"
        "tool a; tool forecast --tokens 2e10\n"
        "```\n"
        "\n"
        "```text\n"
        "forecast: 2e+10 tokens, 3.8 h\n"
        "```\n"
        "Prose, then a tree, which is no output:\n"
        "```text\n"
        "src/\n"
        "```\n"
    )
    monkeypatch.setattr(doc_commands, "REPO", tmp_path)
    samples = doc_commands.output_samples("docs/page.md")
    assert [(s.command.text, s.line, s.lines) for s in samples] == [
        (
            "tool check",
            3,
            (
                "tool check on node7 (1 node):",
                "disk   PASS  12.3 MiB free at /work/main/checkpoints, kept",
                "             for 4 checkpoints",
            ),
        ),
        ("tool forecast --tokens 2e10", 13, ("forecast: 2e+10 tokens, 3.8 h",)),
    ]
    shown = samples[0].lines
    # Another host, other numbers and paths, a cell wrapped elsewhere: the same lines.
    printed = (
        "tool check on ip-10-1-2-3 (1 node):\n"
        "disk   PASS  123.4 GiB free at /tmp/x/checkpoints,\n"
        "             kept for 4 checkpoints\n"
        "tool: done\n"
    )
    assert doc_commands.unprinted(shown, printed, host="ip-10-1-2-3") == []
    # a host named like a directory: the path stays a path
    assert doc_commands.unprinted(shown, printed.replace("ip-10-1-2-3", "x"), host="x") == []
    # A line the tool prints no more, or prints before the one shown above it: named.
    changed = printed.replace("kept for", "kept of")
    assert doc_commands.unprinted(shown, changed, "ip-10-1-2-3") == [
        "disk PASS 12.3 MiB free at /work/main/checkpoints, kept for 4 checkpoints"
    ]
    assert doc_commands.unprinted((*shown[1:], shown[0]), printed, "ip-10-1-2-3") == [
        "tool check on node7 (1 node):"
    ]
    assert doc_commands.unprinted(shown, printed, "another-host") == ["tool check on node7 (1 node):"]


def test_every_output_sample_is_held_to_its_commands_output() -> None:
    """tests/e2e/test_docs.py runs a Run command and compares; any other sample is a listed gap."""
    samples = doc_commands.all_output_samples()
    unchecked = [
        f"{s.command.file}:{s.line}: {s.command.text}"
        for s in samples
        if not isinstance(COMMANDS[s.command.text], Run)
        and s.command.text not in doc_commands.OUTPUT_UNCHECKED
    ]
    assert not unchecked, (
        "output samples of commands the docs test does not run (a Run, or OUTPUT_UNCHECKED):\n"
        + "\n".join(unchecked)
    )
    stale = set(doc_commands.OUTPUT_UNCHECKED) - {s.command.text for s in samples}
    assert not stale, f"OUTPUT_UNCHECKED entries with no sample any more: {sorted(stale)}"


# Where the docs list the run files configs/ ships: the list's text.
RUN_FILE_LISTS = {
    "docs/flags.md": r"\(`configs/` ships (.*?)\):\n",
    "README.md": r"^configs/ (.*?)\n(?=\S)",  # the layout's row, with its indented lines
}


@pytest.mark.parametrize("file", RUN_FILE_LISTS)
def test_the_run_files_the_docs_list_are_the_ones_configs_ships(file: str) -> None:
    shipped = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    listing = re.search(RUN_FILE_LISTS[file], (REPO / file).read_text(), re.MULTILINE | re.DOTALL)
    assert listing, f"{file}: no list of run files ({RUN_FILE_LISTS[file]})"
    assert sorted(set(re.findall(r"[\w.-]+\.yaml", listing[1]))) == shipped, listing[0]


def test_a_dry_run_check_is_the_flags_or_a_cheap_stand_in_and_says_why() -> None:
    for text, how in COMMANDS.items():
        if not isinstance(how, DryRun):
            continue
        assert how.reason, text
        cheap = how.check == FLAGS or how.check.startswith(("bash -n ", "make -n "))
        cheap |= how.check.startswith(".venv/bin/dskit ") and (
            "--dry_run" in how.check or "--help" in how.check
        )
        cheap |= " -m pytest --collect-only " in how.check  # the tests collected, not run
        assert cheap, (
            f"{text}: its check {how.check!r} is not a dry run, a syntax check, a collection or --help"
        )


def _training_flags(words: list[str]) -> list[str] | None:
    """The training flags of a launcher command (env assignments, sbatch options and a node name skipped)."""
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]
    if words[:1] == ["sbatch"]:
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1:]
    if words[:1] in (["./train-singlenode.sh"], ["train.sbatch"]):
        rest = words[1:]
        return rest[1:] if rest[:1] and not rest[0].startswith("-") else rest
    return None


@pytest.mark.parametrize(
    "text",
    [
        t
        for t, how in COMMANDS.items()
        if (isinstance(how, DryRun) and how.check == FLAGS) or isinstance(how, Uncovered)
    ],
)
def test_a_dry_runs_flags_parse(text: str, monkeypatch) -> None:
    """What the command would read first, read here: a misspelt flag, a run file the checkout lacks or a bad
    value fails without a GPU, the hub or a cluster. Uncovered commands too: the least that can be checked."""
    from model_utils.config.arguments import parse_args

    monkeypatch.chdir(REPO)  # run files are named relative to the checkout, as a user types them there
    words = shlex.split(text)
    flags = _training_flags(words)
    if flags is not None:
        parse_args(flags)
        return
    assert words[:2] == [".venv/bin/dskit", "prepare-data"], f"no flags parser known for: {text}"
    from dskit import prepare_data

    prepare_data.build_parser().parse_args(words[2:])


def _test_source(test: str) -> str:
    """The named test function's source and its module's top-level statements (parametrize tables, constants),
    or '' when there is no such test."""
    path, _, name = test.partition("::")
    file = REPO / path
    if not file.is_file():
        return ""
    text = file.read_text()
    tree = ast.parse(text)
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    found = [n for n in functions if n.name == name]
    if not found:
        return ""
    module = [ast.get_source_segment(text, n) or "" for n in tree.body if n not in functions]
    node = found[0]
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    body = "\n".join(text.splitlines()[start - 1 : node.end_lineno])
    return "\n".join([*module, body])


def test_a_covering_test_exists_and_holds_the_commands_distinctive_part() -> None:
    problems = []
    for text, how in COMMANDS.items():
        if not isinstance(how, CoveredBy):
            continue
        if how.part not in text and how.part.strip('"') not in text:
            problems.append(f"{text}: {how.part!r} is not part of the command")
        source = _test_source(how.test)
        if not source:
            problems.append(f"{text}: no test {how.test}")
        elif how.part not in source:
            problems.append(f"{text}: {how.test} does not contain {how.part!r}")
    assert not problems, "\n".join(problems)


def test_every_kind_is_used() -> None:
    kinds = {type(how) for how in COMMANDS.values()}
    assert {Run, DryRun, CoveredBy} <= kinds
    # the gaps, said where the report can list them: a new one is a decision, not an accident
    assert [t for t, how in COMMANDS.items() if isinstance(how, Uncovered)] == []
