"""Every command README.md and docs/*.md show in a fenced block, and what checks it: the docs guard.

A command is a line of a ```bash, ```sh or ```console block (a console block's `$ ` lines), backslash
continuations joined, its comment dropped, `;` splitting one line into several. Blocks of other languages
(yaml, toml, json, python, text: trees, log and output excerpts) hold no command; a block without a language tag
is refused, so each block's kind is said in the docs. Every command is classified in COMMANDS below, once:

- Run: tests/e2e/test_docs.py runs it for real, in document order, in a copy of the checkout;
- DryRun: it needs what the tests do not have (a GPU, AWS, the network, a SLURM cluster), so a cheap check
  stands in for it: "flags" (tests/unit/test_docs.py parses its flags with the parser that reads them) or a
  shell command (the kit's own --dry_run, `bash -n`, `make -n`, `--help`), run by the e2e test in its place;
- CoveredBy: an existing test runs it (tests/unit/test_docs.py checks the test exists and its source holds the
  command's distinctive part, so the mapping cannot rot);
- Uncovered: no test runs it, and running it here costs too much; its flags are parsed, and the gap is listed.

A yaml/toml block whose first line is `# NAME.yaml` (or .toml) is a file the docs show: the e2e test writes it
into the copy, as a user would, before the commands of that page run.

What a page shows a command printing is an output sample: a console block's lines after a `$ ` command, or a
```text block right after a command block (nothing but blank lines between), printed by that block's last command.
The e2e test runs the sample's command (a Run) and holds each shown line to a line it printed (`unprinted`:
numbers, absolute paths and the host name may differ); a sample whose command does not run there is listed in
OUTPUT_UNCHECKED, with why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMAND_LANGUAGES = ("bash", "sh", "console")
OTHER_LANGUAGES = ("yaml", "toml", "json", "python", "text")
_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_SHOWN_FILE = re.compile(r"^# ([\w./-]+\.(?:ya?ml|toml))$")


@dataclass(frozen=True)
class DocCommand:
    file: str  # relative to the checkout
    line: int  # where the command starts
    text: str  # as a user would type it: continuations joined, the comment dropped, spaces collapsed


@dataclass(frozen=True)
class ShownFile:
    file: str
    line: int
    name: str
    body: str


@dataclass(frozen=True)
class Run:
    pass


@dataclass(frozen=True)
class DryRun:
    reason: str  # what the tests lack: a GPU, AWS, the network, SLURM
    check: str  # "flags", or the shell command run in its place


@dataclass(frozen=True)
class CoveredBy:
    test: str  # "tests/e2e/test_x.py::test_name"
    part: str  # the command's distinctive part, found in that test's source


@dataclass(frozen=True)
class Uncovered:
    reason: (
        str  # why no test runs it: said here, so the gap is in the table, not hidden (its flags still parse)
    )


FLAGS = "flags"


def doc_files() -> list[str]:
    """README.md, then the pages in the order README first links them (how a new user meets them), then any
    page it does not link."""
    readme = (REPO / "README.md").read_text()
    linked = list(dict.fromkeys(re.findall(r"\(docs/([\w-]+\.md)", readme)))
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    return [
        "README.md",
        *[f"docs/{p}" for p in linked if p in pages],
        *[f"docs/{p}" for p in pages if p not in linked],
    ]


def _strip_comment(line: str) -> str:
    if line.lstrip().startswith("#"):
        return ""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and i > 0 and line[i - 1].isspace():
            return line[:i]
    return line


def blocks(file: str) -> list[tuple[str, int, list[str]]]:
    """(language, line of the opening fence, body lines) of each fenced block."""
    found, current = [], None
    for number, line in enumerate((REPO / file).read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if fence and current is None:
            current = (fence.group(1), number, [])
        elif fence:
            found.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    return found


def commands(file: str) -> list[DocCommand]:
    out = []
    for language, start, body in blocks(file):
        if language not in COMMAND_LANGUAGES:
            continue
        pending, first = "", 0
        for offset, raw in enumerate(body, start + 1):
            if language == "console":
                if not (raw.startswith("$ ") or pending):
                    continue  # output
                raw = raw[2:] if raw.startswith("$ ") else raw
            line = _strip_comment(raw).rstrip()
            first = first or offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            for part in (pending + line).split(";"):
                text = " ".join(part.split())
                if text:
                    out.append(DocCommand(file, first, text))
            pending, first = "", 0
    return out


def untagged_blocks(file: str) -> list[str]:
    """`FILE:LINE [tag]` of each block whose language says neither commands nor something else."""
    return [
        f"{file}:{line} [{language}]"
        for language, line, _ in blocks(file)
        if language not in COMMAND_LANGUAGES + OTHER_LANGUAGES
    ]


def shown_files(file: str) -> list[ShownFile]:
    return [
        ShownFile(file, line, named.group(1), "\n".join(body) + "\n")
        for language, line, body in blocks(file)
        if language in ("yaml", "toml") and body and (named := _SHOWN_FILE.match(body[0]))
    ]


@dataclass(frozen=True)
class OutputSample:
    command: DocCommand  # what prints it
    line: int  # where the sample's first line is
    lines: tuple[str, ...]


def output_samples(file: str) -> list[OutputSample]:
    text = (REPO / file).read_text().splitlines()
    shown = commands(file)
    found: list[OutputSample] = []
    previous_end, previous = 0, None  # the line of the previous block's closing fence, its last command
    for language, start, body in blocks(file):
        if language == "console":
            command, lines, first, pending = None, [], 0, False
            for number, raw in enumerate(body, start + 1):
                if raw.startswith("$ ") or pending:
                    if command and lines:
                        found.append(OutputSample(command, first, tuple(lines)))
                    command = [c for c in shown if c.line <= number][-1]  # the last of a `;` line's commands
                    lines, pending = [], raw.rstrip().endswith("\\")
                elif command:
                    first = first if lines else number
                    lines.append(raw)
            if command and lines:
                found.append(OutputSample(command, first, tuple(lines)))
        elif language == "text" and previous and not any(x.strip() for x in text[previous_end : start - 1]):
            found.append(OutputSample(previous, start + 1, tuple(body)))
        ours = [c for c in shown if start < c.line <= start + len(body)]
        previous = ours[-1] if language in COMMAND_LANGUAGES and ours else None
        previous_end = start + len(body) + 1
    return found


def all_output_samples() -> list[OutputSample]:
    return [sample for file in doc_files() for sample in output_samples(file)]


# A number (with its unit of bytes), or an absolute path: what differs between machines and runs.
_VARIABLE = re.compile(r"(?<![\w/])/[\w.@+~/-]*|\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?: ?[KMGT]i?B\b)?")


def _entries(lines: list[str]) -> list[str]:
    """Lines, each with the indented lines under it (a table row's wrapped cells), whitespace collapsed: what
    stays the same when a longer number wraps a cell elsewhere."""
    entries: list[str] = []
    for line in lines:
        if line[:1].isspace() and entries:
            entries[-1] += " " + line
        elif line.strip():
            entries.append(line)
    return [" ".join(e.split()) for e in entries]


def _masked(entry: str) -> str:
    return _VARIABLE.sub(lambda m: "<path>" if m[0].startswith("/") else "<n>", entry)


def unprinted(sample: tuple[str, ...] | list[str], printed: str, host: str) -> list[str]:
    """The sample's lines that the printed output lacks, in order: numbers and absolute paths stand for any, and
    where the output names this host, the sample may name another."""
    patterns = []
    for entry in _entries(printed.splitlines()):
        named = re.sub(rf"(?<![\w./-]){re.escape(host)}(?![\w./-])", "\0", entry)  # not in a path
        patterns.append(re.compile(r"\S+".join(re.escape(_masked(part)) for part in named.split("\0"))))
    missing, at = [], 0
    for entry in _entries(list(sample)):
        hit = next((i for i in range(at, len(patterns)) if patterns[i].fullmatch(_masked(entry))), None)
        if hit is None:
            missing.append(entry)
        else:
            at = hit + 1
    return missing


def all_commands() -> list[DocCommand]:
    return [command for file in doc_files() for command in commands(file)]


_SLURM = "a SLURM cluster"
_SLURM_GPU = "a SLURM cluster with GPU nodes"
_HUB = "the network (a dataset or model from the Hugging Face hub)"
_AWS = "AWS (a SageMaker job)"
_TRAINS = "a training run: "

# Every documented command, as COMMANDS' keys spell it (DocCommand.text), and what checks it.
COMMANDS: dict[str, Run | DryRun | CoveredBy | Uncovered] = {
    # README.md: the launchers
    "./train-singlenode.sh": CoveredBy(
        "tests/e2e/test_training_runs.py::test_train_singlenode_trains_the_embedded_default_and_resumes",
        "train-singlenode.sh",
    ),
    "./train-singlenode.sh ip-10-1-199-129": CoveredBy(
        "tests/slurm/test_slurm.py::test_singlenode_runs_on_the_named_node",
        "./train-singlenode.sh",
    ),
    "sbatch train.sbatch": CoveredBy(
        "tests/slurm/test_slurm.py::test_sbatch_trains_on_both_nodes_and_usr1_requeues_and_resumes",
        "train.sbatch",
    ),
    "CUDA_VERSION=12.9 sbatch train.sbatch": DryRun(_SLURM_GPU, "bash -n train.sbatch"),
    "tail -f logs/*.out": DryRun("follows the logs until interrupted", "bash -n -c 'tail -f logs/*.out'"),
    '.venv/bin/dskit plot "$(ls -t logs/*.out | head -n 1)"': CoveredBy(
        "tests/e2e/test_training_runs.py::test_train_singlenode_trains_the_embedded_default_and_resumes",
        "plot",
    ),
    # docs/metrics-and-trackers.md: samples
    "./train-singlenode.sh --sample_prompts examples/sample_prompts.jsonl --sample_every 500 --report_to tensorboard": CoveredBy(
        "tests/e2e/test_validation.py::test_the_trainer_logs_and_records_its_validation_and_samples_the_same_under_every_engine",
        "--sample_every",
    ),
    # docs/metrics-and-trackers.md: W&B offline
    "WANDB_MODE=offline ./train-singlenode.sh --report_to tensorboard,wandb": CoveredBy(
        "tests/e2e/test_trainer.py::test_the_requeue_continues_the_same_wandb_run_with_the_same_metrics",
        "tensorboard,wandb",
    ),
    ".venv/bin/wandb sync logs/wandb/offline-run-*": DryRun(
        "W&B's servers (the network)", "bash -n -c '.venv/bin/wandb sync logs/wandb/offline-run-*'"
    ),
    # docs/estimate-and-doctor.md: the forecast
    ".venv/bin/dskit estimate --model qwen3-0.6b --nodes 2 --gpus_per_node 8 --tokens 2e10 --mfu 0.4 "
    "--peak_tflops 989 --instance_type p5.48xlarge": Run(),
    # docs/checkpoints.md: the hub
    ".venv/bin/dskit export checkpoints/ out/qwen3-run1 --push_to_hub me/qwen3-run1 --private --revision v1": CoveredBy(
        "tests/e2e/test_export.py::test_export_pushes_the_model_and_its_card_to_the_hub", "--push_to_hub"
    ),
    "./train-singlenode.sh --push_to_hub me/qwen3-run1 --hub_visibility private": DryRun(_HUB, FLAGS),
    # README.md: fine-tuning
    "./train-singlenode.sh --config configs/qwen3-0.6b-sft-lora.yaml --dataset /fsx/data/chats.jsonl": DryRun(
        _HUB, FLAGS
    ),
    ".venv/bin/dskit export checkpoints out/tiny-base": CoveredBy(
        "tests/e2e/test_export.py::test_export_of_a_tag_dir_and_through_the_cli", '"export"'
    ),
    "./train-singlenode.sh --config configs/qwen3-0.6b-sft-lora.yaml --model out/tiny-base --dataset "
    "src/model_utils/assets/tiny_conversations.jsonl --chat_template src/model_utils/assets/tiny_chat_template.jinja "
    "--seq_length 256 --max_steps 24": CoveredBy(
        "tests/e2e/test_sft.py::test_the_shipped_sft_run_file_trains_the_example_conversations_offline",
        "tiny_chat_template",
    ),
    # README.md, docs/preference.md: preference tuning
    "./train-singlenode.sh --config configs/qwen3-0.6b-dpo-lora.yaml --model out/qwen3-sft --dataset "
    "/fsx/data/pairs.jsonl": DryRun(_HUB, FLAGS),
    ".venv/bin/dskit export checkpoints/qwen3-0.6b-sft-lora out/tiny-sft": CoveredBy(
        "tests/e2e/test_preference.py::test_the_shipped_dpo_run_file_tunes_the_example_pairs_offline",
        "export",
    ),
    "./train-singlenode.sh --config configs/qwen3-0.6b-dpo-lora.yaml --model out/tiny-sft --dataset "
    "src/model_utils/assets/tiny_preferences.jsonl --seq_length 128 --max_steps 12 --lr 1e-3": CoveredBy(
        "tests/e2e/test_preference.py::test_the_shipped_dpo_run_file_tunes_the_example_pairs_offline",
        "tiny_preferences.jsonl",
    ),
    ".venv/bin/dskit bench --preference_overhead --seq_length 128 --steps 10 --warmup_steps 2 "
    "--micro_batch_size 2": CoveredBy(
        "tests/e2e/test_bench.py::test_bench_measures_dpo_against_the_next_token_loss_on_the_same_pairs",
        "--preference_overhead",
    ),
    # docs/evaluation.md: the loss before and after a fine-tune (README's run, export and fine-tune above)
    "./train-singlenode.sh --config configs/qwen3-0.6b-sft-lora.yaml --model out/tiny-base --dataset "
    "src/model_utils/assets/tiny_conversations.jsonl --chat_template src/model_utils/assets/tiny_chat_template.jinja "
    "--seq_length 256 --max_steps 24 --validation_only true": CoveredBy(
        "tests/e2e/test_validation_only.py::"
        "test_the_docs_recipe_measures_the_base_then_the_fine_tune_on_the_shipped_conversations",
        "--validation_only",
    ),
    # docs/cost.md
    ".venv/bin/dskit cost checkpoints --instance_type p5.48xlarge": CoveredBy(
        "tests/slurm/test_slurm.py::test_node_failure_ends_job_and_requeued_run_resumes", "--instance_type"
    ),
    "make test": DryRun("the whole suite: what runs this test", "make -n test"),
    # docs/testing.md: the signal tests at slow steps
    "STEP_CONTROL_SECONDS=0.5 .venv/bin/python -m pytest tests/e2e/test_interrupt.py tests/e2e/test_sagemaker_job.py": DryRun(
        "minutes of slow steps; the suite runs these tests at the machine's own speed",
        "STEP_CONTROL_SECONDS=0.5 .venv/bin/python -m pytest --collect-only -q tests/e2e/test_interrupt.py "
        "tests/e2e/test_sagemaker_job.py",
    ),
    # README.md: a real dataset
    ".venv/bin/dskit prepare-data /fsx/data/c4-qwen3 --dataset allenai/c4 --dataset_config_name en "
    "--local_dataset false --model Qwen/Qwen3-0.6B --max_tokens 20000000000": DryRun(_HUB, FLAGS),
    "./train-singlenode.sh --model Qwen/Qwen3-0.6B --dataset /fsx/data/c4-qwen3 --seq_length 2048 "
    "--max_steps 1000 --checkpoint_freq 200": DryRun(_HUB, FLAGS),
    "./train-singlenode.sh --model Qwen/Qwen3-0.6B --dataset /fsx/data/wikitext-2 --text_field text": DryRun(
        _HUB, FLAGS
    ),
    "./train-singlenode.sh --config configs/qwen3-0.6b-lora.yaml --dataset /fsx/data/train.parquet "
    "--validation_dataset /fsx/data/valid.parquet": DryRun(_HUB, FLAGS),
    "./train-singlenode.sh --model qwen3-0.6b --tokenizer Qwen/Qwen3-0.6B": DryRun(_HUB, FLAGS),
    # README.md: SageMaker, against the values files it shows
    ".venv/bin/dskit sagemaker submit --values sm-p5.yaml --config configs/zero3-offload.yaml --max_steps 20000": (
        DryRun(
            _AWS,
            ".venv/bin/dskit sagemaker submit --values sm-p5.yaml --dry_run --config configs/zero3-offload.yaml "
            "--max_steps 20000",
        )
    ),
    ".venv/bin/dskit sagemaker submit --values sm-spot.yaml --dry_run --max_steps 20000": Run(),
    ".venv/bin/dskit sagemaker status JOB": DryRun(_AWS, ".venv/bin/dskit sagemaker status --help"),
    ".venv/bin/dskit sagemaker logs JOB": DryRun(_AWS, ".venv/bin/dskit sagemaker logs --help"),
    ".venv/bin/dskit sagemaker stop JOB": DryRun(_AWS, ".venv/bin/dskit sagemaker stop --help"),
    # docs/data.md
    ".venv/bin/dskit prepare-data /fsx/data/c4-qwen3 --dataset allenai/c4 --dataset_config_name en "
    "--local_dataset false --tokenizer Qwen/Qwen3-0.6B": DryRun(_HUB, FLAGS),
    "./train-singlenode.sh --model Qwen/Qwen3-0.6B --dataset /fsx/data/c4-qwen3 --seq_length 2048": DryRun(
        _HUB, FLAGS
    ),
    ".venv/bin/dskit prepare-data .cache/data/tiny-chats --dataset src/model_utils/assets/tiny_conversations.jsonl "
    "--chat_template src/model_utils/assets/tiny_chat_template.jinja --model tiny-qwen3": Run(),
    # docs/fsdp.md
    "./train-singlenode.sh --backend fsdp": CoveredBy(
        # FSDP2 through the launcher until a Ctrl-C after its first step: trained, saved, stopped
        "tests/e2e/test_interrupt.py::test_ctrl_c_saves_a_checkpoint_and_stops_quietly",
        "--backend fsdp",
    ),
    "./train-singlenode.sh --backend fsdp --fsdp_cpu_offload true": CoveredBy(
        "tests/e2e/test_fsdp.py::test_cpu_offload_trains_in_process", "fsdp_cpu_offload"
    ),
    ".venv/bin/dskit estimate --model qwen3-0.6b --backend fsdp": Run(),
    ".venv/bin/dskit bench --vary backend=fsdp": CoveredBy(
        "tests/e2e/test_bench.py::test_bench_prints_and_writes_both_rows", "backend=fsdp"
    ),
    # docs/checkpoints.md: after the README's first run made checkpoints/
    ".venv/bin/dskit bench --checkpoint_mb 100,1000": CoveredBy(
        # the same benchmark at 1 MB (2 real ranks, both methods): the sizes only change how long it takes
        "tests/unit/dskit/bench/test_checkpoint_bench.py::test_a_small_run_times_both_methods_and_writes_json",
        "--checkpoint_mb",
    ),
    ".venv/bin/dskit export checkpoints/ out/qwen3-run1 --dtype bf16": CoveredBy(
        "tests/e2e/test_export.py::test_a_checkpoint_dir_exports_what_resume_would_pick_not_latest",
        "checkpoint",
    ),
    # docs/launchers.md
    "kill -USR1 \"$(grep -ho 'kill -USR1 [0-9]*' logs/tiny_qwen3-deepspeed_*.out | tail -1 | cut -d' ' -f3)\"": (
        CoveredBy(
            "tests/e2e/test_interrupt.py::test_usr1_to_the_pid_the_log_names_while_the_ranks_start_saves_and_stops",
            "grep -ho 'kill -USR1 [0-9]*'",
        )
    ),
    "MAX_STEPS=1000 DATASET=allenai/c4 DATASET_CONFIG_NAME=en LOCAL_DATASET=false sbatch train.sbatch "
    "--model Qwen/Qwen3-0.6B": DryRun(_SLURM + " and " + _HUB, FLAGS),
    ".venv/bin/dskit render --values p5.yaml": Run(),
    ".venv/bin/dskit render --set nodes=4 --set partition=gpu --set env.NCCL_DEBUG=INFO": Run(),
    ".venv/bin/accelerate launch --config_file configs/accelerate/deepspeed-zero2.yaml --num_processes 2 "
    "src/train_deepspeed.py --max_steps 50": CoveredBy(
        "tests/e2e/test_accelerate_launch.py::test_accelerate_launch_trains_one_world_of_two",
        "configs/accelerate/deepspeed-zero2.yaml",
    ),
    ".venv/bin/accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16 src/train_deepspeed.py": (
        CoveredBy(
            "tests/e2e/test_accelerate_launch.py::test_accelerate_launch_trains_one_world_of_two",
            "--multi_gpu",
        )
    ),
    ".venv/bin/dskit render --set launcher=accelerate "
    "--set accelerate_config=configs/accelerate/deepspeed-zero2.yaml": Run(),
    "ACCELERATE_CONFIG=my-fsdp.yaml sbatch train.sbatch --max_steps 1000": CoveredBy(
        # the variable's handling is the launchers' shared code, run there against stand-in commands
        "tests/unit/dskit/test_render.py::test_accelerate_singlenode",
        "ACCELERATE_CONFIG",
    ),
    "make wheelhouse": DryRun(_HUB + ": 3 GiB of wheels", "make -n wheelhouse"),
    "make wheelhouse WHEELHOUSE_DIR=/tmp/wh WHEELHOUSE_PYTHON=3.12 WHEELHOUSE_MACHINE=aarch64 "
    "WHEELHOUSE_GLIBC=2.28": DryRun(
        _HUB + ": 3 GiB of wheels",
        "make -n wheelhouse WHEELHOUSE_DIR=/tmp/wh WHEELHOUSE_PYTHON=3.12 WHEELHOUSE_MACHINE=aarch64 "
        "WHEELHOUSE_GLIBC=2.28",
    ),
    "WHEELHOUSE=/fsx/wheelhouse ./train-singlenode.sh": CoveredBy(
        "tests/slurm/test_slurm.py::test_offline_install_from_a_wheelhouse_trains_through_both_launchers",
        "train-singlenode.sh",
    ),
    "DSKIT_PYTHON=/opt/conda/bin/python WHEELHOUSE=/fsx/wheelhouse sbatch train.sbatch": CoveredBy(
        "tests/slurm/test_slurm.py::test_offline_install_from_a_wheelhouse_trains_through_both_launchers",
        "DSKIT_PYTHON",
    ),
    "jid=$(sbatch --parsable prepare-data.sbatch)": CoveredBy(
        "tests/slurm/test_slurm.py::test_prepare_data_array_then_training_on_it", "prepare-data.sbatch"
    ),
    "DATASET=data/prepared sbatch --dependency=afterok:$jid --kill-on-invalid-dep=yes train.sbatch": CoveredBy(
        "tests/slurm/test_slurm.py::test_prepare_data_array_then_training_on_it", "--dependency=afterok"
    ),
    # docs/estimate-and-doctor.md
    ".venv/bin/dskit estimate --model qwen3-0.6b --nodes 2 --gpus_per_node 8 --zero_stage 2 --offload optimizer "
    "--micro_batch_size 1 --seq_length 2048 --gpu_memory_gib 80": Run(),
    "DS_ACCELERATOR=cpu .venv/bin/dskit doctor": Run(),
    # docs/metrics-and-trackers.md: two launches of one named run, plotted as one (the launcher's log naming is
    # tests/unit/dskit/test_render.py::test_singlenode_names_its_log_after_the_run)
    "./train-singlenode.sh --max_steps 40 --run_name first-hour --checkpoint_dir checkpoints/first-hour": CoveredBy(
        "tests/e2e/test_trainer.py::test_two_local_launches_of_a_named_run_are_one_run", "--run_name"
    ),
    "./train-singlenode.sh --max_steps 80 --run_name first-hour --checkpoint_dir checkpoints/first-hour": CoveredBy(
        "tests/e2e/test_trainer.py::test_two_local_launches_of_a_named_run_are_one_run", "--run_name"
    ),
    ".venv/bin/dskit plot first-hour": CoveredBy(
        "tests/e2e/test_trainer.py::test_two_local_launches_of_a_named_run_are_one_run", "plot"
    ),
    # README.md and docs/evaluation.md: dskit eval
    ".venv/bin/dskit eval checkpoints/ --tasks dskit_tiny_mc": CoveredBy(
        "tests/e2e/test_trainer.py::test_dskit_eval_of_the_final_checkpoint_lands_in_its_tensorboard_run",
        "dskit_tiny_mc",
    ),
    "jid=$(sbatch --parsable train.sbatch)": DryRun(_SLURM, "bash -n train.sbatch"),
    "sbatch --dependency=afterok:$jid --kill-on-invalid-dep=yes eval.sbatch": CoveredBy(
        "tests/unit/dskit/test_render.py::test_eval_job_evaluates_the_checkpoint_on_the_tasks", "eval.sbatch"
    ),
    # docs/pipelines.md
    ".venv/bin/python examples/kedro/run.py --work_dir /tmp/kedro-run --max_steps 20 --mlflow": CoveredBy(
        "tests/e2e/test_api.py::test_kedro_example_trains_as_one_node_and_returns_a_serialisable_result",
        "run.py",
    ),
    # docs/sagemaker.md: the synopsis
    ".venv/bin/dskit sagemaker submit [--values FILE] [--wait] [--dry_run] [TRAINING FLAGS or --config "
    "run.yaml]": DryRun(
        _AWS + "; a synopsis, [ ] marks what is optional", ".venv/bin/dskit sagemaker --help"
    ),
    # docs/long-context.md
    "./train-singlenode.sh --sequence_parallel 2": CoveredBy(
        "tests/e2e/test_sequence_parallel.py::"
        "test_a_run_changes_sequence_parallelism_on_resume_and_trains_as_the_uninterrupted_run",
        "--sequence_parallel",
    ),
    ".venv/bin/dskit estimate --model qwen3-0.6b --seq_length 32768 --gpus_per_node 8 --gpu_memory_gib 24 "
    "--host_memory_gib 512 --liger off": Run(),
    "sbatch --nodes=1 train.sbatch --model /fsx/models/Qwen3-8B-yarn --dataset /fsx/data/long-docs --seq_length "
    "131072 --sequence_parallel 2 --activation_checkpointing full --deepspeed_config deepspeed/ds_config_gpu.json "
    "--micro_batch_size 1": DryRun(_SLURM_GPU, FLAGS),
    ".venv/bin/dskit bench --sequence_parallel 1,2 --seq_lengths 1024,4096 --budget_mib 256": CoveredBy(
        # the same benchmark at 2,048 tokens and a 50 MiB budget: the lengths only change how long it takes
        "tests/unit/dskit/bench/test_sequence_bench.py::"
        "test_a_group_of_two_holds_less_per_rank_and_the_budget_search_doubles",
        "--sequence_parallel",
    ),
}

# Output samples whose command the docs test does not run (every other sample's command is a Run), and why.
OUTPUT_UNCHECKED: dict[str, str] = {
    "./train-singlenode.sh --config configs/qwen3-0.6b-sft-lora.yaml --model out/tiny-base --dataset "
    "src/model_utils/assets/tiny_conversations.jsonl --chat_template src/model_utils/assets/tiny_chat_template.jinja "
    "--seq_length 256 --max_steps 24 --validation_only true": "needs README's run and export, and the fine-tune's "
    "checkpoint (its covering test makes a base model and a fine-tune's checkpoint of its own)",
    ".venv/bin/dskit eval checkpoints/ --tasks dskit_tiny_mc": "needs a trained run's checkpoints (its covering "
    "test trains one)",
}
