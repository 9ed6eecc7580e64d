"""`dskit render`: write train.sbatch, train-singlenode.sh, prepare-data.sbatch and eval.sbatch from templates/ and
one set of launch values.

Values come from the defaults in `LaunchValues`, then an optional values file (YAML or TOML), then
`--set key=value` overrides. Every value that reaches the shell goes through the `sq` filter (shlex.quote), and
values that land in `#SBATCH` lines (which sbatch parses without a shell) are restricted to safe characters, so a
hostile value cannot run anything. Every script is rendered before any is written: bad input never leaves a
half-updated set behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import tempfile
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import yaml

from model_utils.errors import CommandParser, ConfigError
from model_utils.repo import REPO_ROOT

TEMPLATE_DIR = REPO_ROOT / "templates"
# output file name -> template name. SCRIPTS: the training launchers (each runs `dskit preflight`, then torchrun).
SCRIPTS = {"train.sbatch": "train.sbatch.j2", "train-singlenode.sh": "train-singlenode.sh.j2"}
# The SLURM array job that tokenizes a dataset on CPU nodes (`dskit prepare-data`) for the launchers to train on.
DATA_SCRIPTS = {"prepare-data.sbatch": "prepare-data.sbatch.j2"}
# The downstream evaluation job (`dskit eval`) that a training job chains with --dependency=afterok.
EVAL_SCRIPTS = {"eval.sbatch": "eval.sbatch.j2"}
# Everything `dskit render` writes.
RENDERED = {**SCRIPTS, **DATA_SCRIPTS, **EVAL_SCRIPTS}
REGENERATE = ".venv/bin/dskit render [--values FILE] [--set key=value ...]"

# Values written into #SBATCH lines are parsed by sbatch, not by a shell: keep them to characters that need no
# quoting anywhere (job names also become log file names).
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SLURM_LIST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._,-]*")
# SLURM --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
_CUDA = re.compile(r"\d+\.\d+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
EFA_MODES = ("auto", "on", "off")
# What starts the ranks on each node: torchrun, or `accelerate launch` (which reads an accelerate config file).
LAUNCHERS = ("torchrun", "accelerate")
# --signal=B:USR1@N takes at most 65535 seconds
MAX_SIGNAL_LEAD_S = 65535
# prepare-data flags not taken in prepare_args: the array's share (set by the script) and those with their own value
PREPARE_ARGS_OWNED = {
    "--task_index": "each array task sets its own: drop it",
    "--num_tasks": "the array's size sets it: use prepare_tasks",
    "--dataset": "use prepare_dataset",
    "--model": "use model (training's too, so both use one tokenizer)",
    "--tokenizer": "use prepare_tokenizer",
}


@dataclass(frozen=True)
class LaunchValues:
    """Every launch value with its default. None for a training value means: the trainer's own default."""

    nodes: int = 2
    gpus_per_node: int = 8
    # ranks per node when a node has no GPU (CPU training over gloo)
    cpu_ranks_per_node: int = 2
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    job_name: str = "qwen3_0_6b-DeepSpeed"
    exclusive: bool = True
    # Pyxis/enroot image: the ranks and `dskit prepare` then run in it (it must hold the Python environment)
    container_image: str | None = None
    # an interpreter with torch preinstalled (a container's, a cluster module's), used instead of uv sync: the
    # default of DSKIT_PYTHON; with container_image, the interpreter inside the image (default python3)
    python: str | None = None
    # a `make wheelhouse` directory the launchers install .venv from with no network: the default of WHEELHOUSE
    wheelhouse: str | None = None
    cuda_version: str = "12.8"
    efa: str = "auto"
    # torchrun or accelerate (`accelerate launch` on every node; accelerate_config: its --config_file, which picks
    # DeepSpeed, FSDP or plain data parallel and maps onto the training flags: docs/launchers.md)
    launcher: str = "torchrun"
    accelerate_config: str | None = None
    # SageMaker HyperPod: `srun --auto-resume=1`, so HyperPod replaces a faulty node and restarts the step
    hyperpod_auto_resume: bool = False
    # clusters that hand GPUs out as GRES: ask for gpus_per_node of them (#SBATCH --gpus-per-node)
    gres: bool = False
    # extra environment for the ranks, e.g. {NCCL_DEBUG: INFO, FI_EFA_FORK_SAFE: 1}
    env: dict[str, str] = field(default_factory=dict)
    # seconds before the time limit at which SLURM sends USR1 (checkpoint, then requeue)
    signal_lead_s: int = 300
    # train.sbatch: requeues after a hang (exit status 75), each without the hosts of the ranks that stopped
    max_hang_requeues: int = 2
    # train.sbatch: also drain those hosts (scontrol update NodeName=... State=DRAIN), where the user may (an operator)
    drain_hung_nodes: bool = False
    max_steps: int | None = None
    checkpoint_freq: int | None = None
    dataset: str | None = None
    dataset_config_name: str | None = None
    local_dataset: bool | None = None
    config: str | None = None  # a run file (YAML) the launchers pass as --config
    # also the model whose tokenizer prepare-data.sbatch tokenizes with, so the prepared data fits the training
    model: str | None = None
    # prepare-data.sbatch: an array job on CPU nodes that tokenizes prepare_dataset into prepared_dir
    prepare_partition: str | None = None  # the CPU nodes' partition (None: the cluster's default partition)
    prepare_tasks: int = 4  # the array's size: each task tokenizes every prepare_tasks-th unit of the source
    prepare_cpus_per_task: int = 8  # one tokenizer process per CPU
    prepare_time_limit: str | None = None
    prepare_dataset: str | None = None  # the source (None: prepare-data's default, the embedded corpus)
    prepared_dir: str = "data/prepared"  # the output: train on it with dataset (or DATASET=) set to this
    prepare_tokenizer: str | None = None  # None: the model's tokenizer
    # more prepare-data flags, as shell words, e.g. "--unit_mb 64 --text_field content"
    prepare_args: str | None = None
    # eval.sbatch, the downstream evaluation job (`dskit eval`, one node, one GPU with gres): what it evaluates by
    # default (the training's --checkpoint_dir: its newest verified tag) and on which lm-eval tasks
    eval_checkpoint: str = "checkpoints"
    eval_tasks: str = "dskit_tiny_mc"
    eval_time_limit: str | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        if self.max_hang_requeues < 0:
            raise ConfigError(
                f"max_hang_requeues = {self.max_hang_requeues} is negative: use 0 (never) or more"
            )
        if self.nodes < 1:
            raise ConfigError(f"nodes = {self.nodes}: use at least 1 (e.g. --set nodes=2)")
        for name in ("gpus_per_node", "cpu_ranks_per_node"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} = {getattr(self, name)} is negative: use 0 or more")
        if self.gpus_per_node == 0 and self.cpu_ranks_per_node == 0:
            raise ConfigError(
                "gpus_per_node and cpu_ranks_per_node are both 0, so no rank could run: "
                "set gpus_per_node (GPU nodes) or cpu_ranks_per_node (CPU nodes) to at least 1"
            )
        if not _SLURM_NAME.fullmatch(self.job_name):
            raise ConfigError(
                f"job_name {self.job_name!r} must be letters, digits, '.', '_' or '-' (it names the log files)"
            )
        for name in ("partition", "account", "prepare_partition"):
            value = getattr(self, name)
            if value is not None and not _SLURM_LIST.fullmatch(value):
                raise ConfigError(f"{name} {value!r} must be letters, digits, '.', '_', '-' or ','")
        for name in ("time_limit", "prepare_time_limit", "eval_time_limit"):
            value = getattr(self, name)
            if value is not None and not _TIME.fullmatch(value):
                raise ConfigError(
                    f"{name} {value!r} is not a SLURM time: use e.g. 90, 12:00:00 or 2-00:00:00"
                )
        if not _CUDA.fullmatch(self.cuda_version):
            raise ConfigError(f"cuda_version {self.cuda_version!r} must look like 12.8")
        if self.efa not in EFA_MODES:
            raise ConfigError(f"efa {self.efa!r} must be one of {', '.join(EFA_MODES)}")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher {self.launcher!r} must be one of {', '.join(LAUNCHERS)}")
        if self.accelerate_config is not None and self.launcher != "accelerate":
            raise ConfigError(
                "accelerate_config is read by `accelerate launch` only: add launcher: accelerate or drop it"
            )
        if self.gres and self.gpus_per_node < 1:
            raise ConfigError(
                f"gres: true asks SLURM for gpus_per_node GPUs per node, but gpus_per_node = {self.gpus_per_node}:"
                " set gpus_per_node (e.g. 8), or gres: false for CPU nodes"
            )
        for key in self.env:
            if not _ENV_NAME.fullmatch(key):
                raise ConfigError(
                    f"env key {key!r} is not a valid environment variable name (e.g. NCCL_DEBUG)"
                )
        if not 1 <= self.signal_lead_s <= MAX_SIGNAL_LEAD_S:
            raise ConfigError(
                f"signal_lead_s = {self.signal_lead_s}: use 1..{MAX_SIGNAL_LEAD_S} seconds (e.g. 300), "
                "enough to save a checkpoint"
            )
        for name in ("max_steps", "checkpoint_freq"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(
                    f"{name} = {value}: use at least 1, or leave it out for the trainer's default"
                )
        for name in ("prepare_tasks", "prepare_cpus_per_task"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)}: use at least 1")
        for name in (
            "container_image",
            "python",
            "wheelhouse",
            "dataset",
            "dataset_config_name",
            "model",
            "config",
            "accelerate_config",
        ):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"{name} is empty: give a value or leave the key out")
        for name in (
            "prepare_dataset",
            "prepared_dir",
            "prepare_tokenizer",
            "prepare_args",
            "eval_checkpoint",
            "eval_tasks",
        ):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"{name} is empty: give a value or leave the key out")
        for name, value in self.strings():
            if any(ord(c) < 32 for c in value):
                raise ConfigError(f"{name} contains a control character (newline, tab, ...): remove it")
        self.prepare_arg_words()

    def prepare_arg_words(self) -> list[str]:
        """prepare_args as the words the shell would see (each rendered quoted, so nothing in them runs)."""
        if self.prepare_args is None:
            return []
        try:
            words = shlex.split(self.prepare_args)
        except ValueError as e:
            raise ConfigError(
                f"prepare_args {self.prepare_args!r} is not valid shell words ({e}): fix its quoting"
            ) from None
        for word in words:
            flag = word.partition("=")[0]
            if flag in PREPARE_ARGS_OWNED:
                raise ConfigError(f"prepare_args sets {flag}: {PREPARE_ARGS_OWNED[flag]}")
        return words

    def strings(self) -> list[tuple[str, str]]:
        out = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        out += [(f"env.{k}", k) for k in self.env] + [(f"env.{k}", v) for k, v in self.env.items()]
        return [(name, v) for name, v in out if isinstance(v, str)]


FIELDS = {f.name: f for f in dataclasses.fields(LaunchValues)}
_HINTS = typing.get_type_hints(LaunchValues)


def _base_type(hint: Any) -> Any:
    """int | None -> int; dict[str, str] -> dict."""
    if isinstance(hint, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) or hint


def _type_name(t: Any) -> str:
    return {int: "an integer", bool: "true or false", str: "a string", dict: "a mapping"}[t]


def _check_types(values: LaunchValues) -> None:
    # Values files are untyped: catch `nodes: two` or `exclusive: 1` here, with the key named.
    for name, hint in _HINTS.items():
        value = getattr(values, name)
        optional = isinstance(hint, types.UnionType)
        want = _base_type(hint)
        if value is None and optional:
            continue
        # bool is an int subclass: `nodes: true` must not pass as 1
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{name} = {value!r} must be {_type_name(want)}")
    for key, value in values.env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(f"env.{key} = {value!r}: env keys and values must be strings (quote numbers)")


def _unknown_key(key: str, where: str) -> ConfigError:
    import difflib

    close = difflib.get_close_matches(key, FIELDS, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return ConfigError(f"unknown key {key!r} in {where}: {hint}valid keys are {', '.join(FIELDS)}")


def _env_values(raw: dict[Any, Any]) -> dict[Any, Any]:
    # YAML/TOML give numbers and booleans; the environment only has strings. Convert the obvious scalars.
    out: dict[Any, Any] = {}
    for k, v in raw.items():
        if isinstance(v, bool):
            out[k] = "1" if v else "0"
        elif isinstance(v, int | float):
            out[k] = str(v)
        else:
            out[k] = v
    return out


def load_values_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"values file {path} not found: pass an existing YAML or TOML file to --values")
    text = p.read_text()
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"values file {path}: name it *.yaml, *.yml or *.toml so its format is known")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"values file {path} is not valid YAML{where}: {problem}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"values file {path} is not valid TOML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"values file {path} must be a mapping of key: value (got {type(data).__name__})")
    for key in data:
        if key not in FIELDS:
            raise _unknown_key(str(key), path)
    if isinstance(data.get("env"), dict):
        data["env"] = _env_values(data["env"])
    return data


def _parse_scalar(name: str, text: str) -> Any:
    want = _base_type(_HINTS[name])
    optional = isinstance(_HINTS[name], types.UnionType)
    if optional and text in ("", "none", "null"):
        return None
    if want is bool:
        lowered = text.lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"--set {name}={text}: use true or false")
    if want is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--set {name}={text}: {name} must be an integer") from None
    if want is dict:
        raise ConfigError(f"--set {name}={text}: set one entry at a time, e.g. --set env.NCCL_DEBUG=INFO")
    return text


def apply_sets(values: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    out = dict(values)
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item}: write it as key=value, e.g. --set nodes=4")
        if key.startswith("env."):
            out["env"] = {**out.get("env", {}), key[len("env.") :]: text}
            continue
        if key not in FIELDS:
            raise _unknown_key(key, "--set")
        out[key] = _parse_scalar(key, text)
    return out


def resolve_values(values_file: str | None = None, sets: list[str] | None = None) -> LaunchValues:
    raw = load_values_file(values_file) if values_file else {}
    return LaunchValues(**apply_sets(raw, sets or []))


# The training variables both launchers read from the environment: (variable, training flag, which is also the
# render value giving its default). The templates' defaults, the flags they add and their usage text all come
# from this table.
TRAINING_ENV: tuple[tuple[str, str], ...] = (
    ("CONFIG", "config"),  # a run file (--config); the other variables and the flags override it
    ("MAX_STEPS", "max_steps"),
    ("CHECKPOINT_FREQ", "checkpoint_freq"),
    ("DATASET", "dataset"),
    ("DATASET_CONFIG_NAME", "dataset_config_name"),
    ("LOCAL_DATASET", "local_dataset"),
    ("MODEL", "model"),
)


def _shell_quote(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return shlex.quote(str(value))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sq"] = _shell_quote
    return env


def render_scripts(values: LaunchValues) -> dict[str, str]:
    """Output file name -> script text."""
    env = _environment()
    training_env = [(var, flag, getattr(values, flag)) for var, flag in TRAINING_ENV]
    context = {
        "v": values,
        "regenerate": REGENERATE,
        "training_env": training_env,
        "prepare_args": values.prepare_arg_words(),
    }
    return {name: env.get_template(template).render(context) for name, template in RENDERED.items()}


def write_scripts(scripts: dict[str, str], out_dir: Path) -> list[Path]:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is not a directory: pick a directory (it is created if missing)")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in scripts.items():
        path = out_dir / name
        if path.is_file() and path.read_text() == text:
            continue  # unchanged: keep its mtime
        # Write then rename, so a concurrent reader (or a running sbatch copy) never sees half a script.
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
        written.append(path)
    return written


def build_parser() -> argparse.ArgumentParser:
    keys = ", ".join(f"{n} (default {FIELDS[n].default!r})" for n in FIELDS if n != "env")
    parser = CommandParser(
        prog="dskit render",
        description="Write train.sbatch, train-singlenode.sh, prepare-data.sbatch and eval.sbatch from templates/ "
        "and launch values.",
        epilog=f"keys: {keys}, env.NAME (extra environment for the ranks)",
    )
    parser.add_argument(
        "--values", metavar="FILE", help="YAML (.yaml/.yml) or TOML (.toml) file of key: value"
    )
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="override one value"
    )
    parser.add_argument(
        "--out",
        default=str(REPO_ROOT),
        metavar="DIR",
        help="where to write, created if missing (default: the repo root, the checkout's tracked launchers)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    values = resolve_values(args.values, args.sets)
    scripts = render_scripts(values)
    written = write_scripts(scripts, Path(args.out))
    tracked = Path(args.out).resolve() == REPO_ROOT.resolve()
    for name in scripts:
        state = "written" if Path(args.out) / name in written else "unchanged"
        if state == "written" and tracked:  # the checkout's own launchers, which git tracks
            state += (
                " (the checkout's tracked launcher: `git diff` shows the change; --out DIR writes elsewhere)"
            )
        print(f"{Path(args.out) / name}: {state}")
    return 0
