"""One-off: move the flat modules into subpackages (git mv) and rewrite every reference to them.

Kept in tools/ as the record of the 2026 layout change (old module -> new module); not run by anything.
    python tools/relayout.py move      # git mv only (its own commit, so `git log --follow` keeps history)
    python tools/relayout.py rewrite   # imports, usages, dotted names and paths in src/tests/docs/...
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# old dotted module -> new dotted module; a package __init__ is written as the package itself.
MOVES = {
    "model_utils.arguments": "model_utils.config.arguments",
    "model_utils.run_file": "model_utils.config.run_file",
    "model_utils.presets": "model_utils.config.presets",
    "model_utils.launch_env": "model_utils.launch.launch_env",
    "model_utils.distributed": "model_utils.launch.distributed",
    "model_utils.startup": "model_utils.launch.startup",
    "model_utils.preemption": "model_utils.launch.preemption",
    "model_utils.walltime": "model_utils.launch.walltime",
    "model_utils.accelerate_env": "model_utils.launch.accelerate_env",
    "model_utils.preflight": "model_utils.resolve.resolver",
    "model_utils.batch_layout": "model_utils.resolve.batch_layout",
    "model_utils.autobatch": "model_utils.resolve.micro_batch_probe",
    "model_utils.memory_estimate": "model_utils.resolve.memory_estimate",
    "model_utils.models": "model_utils.model.models",
    "model_utils.hub": "model_utils.model.hub",
    "model_utils.lora": "model_utils.model.lora",
    "model_utils.activation_checkpointing": "model_utils.model.activation_checkpointing",
    "model_utils.kernels": "model_utils.model.kernels",
    "model_utils.schedules": "model_utils.optim.schedules",
    "model_utils.param_groups": "model_utils.optim.param_groups",
    "model_utils.deepspeed_config": "model_utils.engines.deepspeed_config",
    "model_utils.documents": "model_utils.data.documents",
    "model_utils.token_shards": "model_utils.data.token_shards",
    "model_utils.concat_dataset": "model_utils.data.block_cache",
    "model_utils.batches": "model_utils.data.step_batches",
    "model_utils.file_manifest": "model_utils.storage.file_manifest",
    "model_utils.s3_tier": "model_utils.storage.s3_tier",
    "model_utils.checkpoint": "model_utils.checkpoint.protocol",
    "model_utils.launch_record": "model_utils.checkpoint.launch_record",
    "model_utils.faults": "model_utils.loop.faults",
    "model_utils.engine": "model_utils.engines.base",
    "model_utils.deepspeed_engine": "model_utils.engines.deepspeed_engine",
    "model_utils.fsdp_engine": "model_utils.engines.fsdp_engine",
    "model_utils.reporter": "model_utils.observe.reporter",
    "model_utils.step_line": "model_utils.observe.step_line",
    "model_utils.metrics": "model_utils.observe.metrics",
    "model_utils.trackers": "model_utils.observe.trackers",
    "model_utils.profiling": "model_utils.observe.profiling",
    "model_utils.log": "model_utils.observe.log",
    "model_utils.trainer": "model_utils.loop.trainer",
    "model_utils.spike_guard": "model_utils.loop.spike_guard",
    "dskit.bench": "dskit.bench",
    "dskit.data_bench": "dskit.bench.data_bench",
    "dskit.gpu_check": "dskit.bench.gpu_check",
    "dskit.plot": "dskit.plot",
    "dskit.schedule_plot": "dskit.plot.schedule_plot",
    "dskit.sagemaker": "dskit.sagemaker",
    "dskit.sagemaker_entry": "dskit.sagemaker.entry",
    "dskit.sagemaker_values": "dskit.sagemaker.values",
    "dskit.python_env": "dskit.env.python_env",
    "dskit.wheelhouse": "dskit.env.wheelhouse",
}
# Modules that become a package's __init__ (the command is the package, as dskit.doctor already is).
PACKAGE_MODULES = {"dskit.bench", "dskit.plot", "dskit.sagemaker"}
PACKAGE_DOCS = {
    "model_utils.config": "The typed config tree: flags, run files and model presets, parsed once and frozen.",
    "model_utils.launch": "What the launchers hand a rank: its variables, the process group, signals, the time limit, quiet imports.",
    "model_utils.resolve": "Everything derived from the config, once, into a frozen run: settings, batch layout, memory model.",
    "model_utils.model": "The model: its source and hub snapshot, LoRA adapters, activation checkpointing, kernels.",
    "model_utils.optim": "Optimizer and lr-schedule settings both engines train with, and the weight-decay groups.",
    "model_utils.data": "Data: documents from every source, the prepared token shards, the block cache and the step batches.",
    "model_utils.storage": "Files and objects: checksummed manifests, atomic writes, S3.",
    "model_utils.checkpoint": "The crash-safe checkpoint protocol over the engines, and the launch record it keeps.",
    "model_utils.engines": "The training engines behind one seam; each owns everything engine-specific.",
    "model_utils.observe": "What a run reports: the log line, metrics, trackers, the profiler.",
    "model_utils.loop": "The training loop over explicit checkpointable state, and the spike guard.",
    "dskit.env": "The Python environment the launchers run in: the interpreter probe and the wheelhouse.",
}


def path_of(module: str) -> Path:
    rel = Path("src", *module.split("."))
    return ROOT / (rel / "__init__.py" if module in PACKAGE_MODULES else rel.with_suffix(".py"))


def old_path(module: str) -> Path:
    return ROOT / Path("src", *module.split(".")).with_suffix(".py")


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def move() -> None:
    for package, doc in PACKAGE_DOCS.items():
        init = ROOT / "src" / Path(*package.split(".")) / "__init__.py"
        init.parent.mkdir(parents=True, exist_ok=True)
        init.write_text(f'"""{doc}"""\n')
    for old, new in MOVES.items():
        src, dst = old_path(old), path_of(new)
        if src == dst:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        git("mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT)))
    git("add", "src")


def short(module: str) -> str:
    return module.rpartition(".")[2]


# Renamed stems: usages of the bare module name change in files that import it by that name.
RENAMES = {short(o): short(n) for o, n in MOVES.items() if short(o) != short(n)}


def rename_names(text: str, names: dict[str, str]) -> str:
    """NAME tokens (not attributes, not keyword arguments, not strings) renamed."""
    if not names:
        return text
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    lines = text.splitlines(keepends=True)
    edits = []
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.NAME or tok.string not in names:
            continue
        prev = tokens[i - 1] if i else None
        if prev is not None and prev.type == tokenize.OP and prev.string == ".":
            continue
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if (
            nxt is not None
            and nxt.type == tokenize.OP
            and nxt.string == "="
            and prev is not None
            and prev.string in "(,"
        ):
            continue
        edits.append((tok.start, tok.end, names[tok.string]))
    for (row, col), (_, end), new in reversed(edits):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[end:]
    return "".join(lines)


FROM_PKG = re.compile(
    r"^(?P<indent>[ \t]*)from (?P<pkg>model_utils|dskit) import (?P<names>\([^)]*\)|[^\n]+)", re.M
)


def rewrite_from_package(text: str) -> tuple[str, dict[str, str]]:
    """`from model_utils import a, b` -> one import per new home; returns the text and the bare names renamed."""
    renamed: dict[str, str] = {}

    def sub(m: re.Match[str]) -> str:
        indent, pkg = m["indent"], m["pkg"]
        raw = m["names"].strip()
        comment = ""
        if not raw.startswith("(") and "#" in raw:
            raw, comment = raw.split("#", 1)
            comment = "  #" + comment
        body = raw.strip("()")
        names = [n.strip() for n in re.sub(r"#[^\n]*", "", body).replace("\n", " ").split(",") if n.strip()]
        groups: dict[str, list[str]] = {}
        for entry in names:
            name, _, alias = entry.partition(" as ")
            name, alias = name.strip(), alias.strip()
            old = f"{pkg}.{name}"
            new = MOVES.get(old, old)
            home, _, stem = new.rpartition(".")
            if new in PACKAGE_MODULES:
                home, stem = pkg, name
            if stem != name and not alias:
                renamed[name] = stem
            groups.setdefault(home, []).append(stem + (f" as {alias}" if alias else ""))
        out = []
        for home, stems in sorted(groups.items()):
            joined = ", ".join(stems)
            line = f"{indent}from {home} import {joined}"
            if len(line) > 110:
                inner = "".join(f"{indent}    {s},\n" for s in stems)
                line = f"{indent}from {home} import (\n{inner}{indent})"
            out.append(line)
        return "\n".join(out) + comment

    return FROM_PKG.sub(sub, text), renamed


def dotted(text: str) -> str:
    """Every dotted reference (imports, strings, `-m`) and src path to a moved module."""
    for old, new in sorted(MOVES.items(), key=lambda kv: -len(kv[0])):
        if old == new:
            continue
        text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)
        old_file = "src/" + old.replace(".", "/") + ".py"
        new_file = str(path_of(new).relative_to(ROOT))
        text = re.sub(rf"(?<![\w/]){re.escape(old_file)}", new_file, text)
        text = re.sub(rf"(?<![\w/.]){re.escape(old_file[4:])}", new_file[4:], text)
    return text


def files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    keep = []
    for rel in out.split():
        p = ROOT / rel
        if rel.startswith("tools/relayout.py") or not p.is_file():
            continue
        if (
            p.suffix in {".py", ".md", ".j2", ".sh", ".sbatch", ".toml", ".yaml", ".yml", ".json", ".txt", ""}
            or rel == "Makefile"
        ):
            keep.append(p)
    return keep


def rewrite() -> None:
    for p in files():
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        new = text
        if p.suffix == ".py":
            new, renamed = rewrite_from_package(new)
            new = rename_names(new, renamed)
        new = dotted(new)
        if new != text:
            p.write_text(new)
            print("rewrote", p.relative_to(ROOT))


if __name__ == "__main__":
    {"move": move, "rewrite": rewrite}[sys.argv[1]]()
