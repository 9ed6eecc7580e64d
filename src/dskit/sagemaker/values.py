"""The values file of `dskit sagemaker submit`: one frozen dataclass with every key and its default.

    role: arn:aws:iam::123456789012:role/SageMakerTraining
    s3_prefix: s3://my-bucket/dskit          # the source tarball, output and (by default) checkpoints go here
    instance_type: ml.p5.48xlarge
    instance_count: 2
    channels: {model: s3://my-bucket/models/Qwen3-8B/, train: s3://my-bucket/data/corpus/}

Keys are strict: an unknown one is an error naming the closest valid key. Every check here runs before anything
is uploaded or created.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from dskit.sagemaker.job_contract import READABLE_INPUT_MODES
from model_utils.config import run_file
from model_utils.errors import ConfigError
from model_utils.observe import redact

# GPUs per instance of the SageMaker training instance types the kit knows. A type not listed is refused (a typo
# would otherwise surface only as a failed job): add a new type here with its GPU count.
INSTANCE_GPUS: dict[str, int] = {
    **{f"ml.{t}.48xlarge": 8 for t in ("p5", "p5e", "p5en", "p6-b200")},
    "ml.p4d.24xlarge": 8,
    "ml.p4de.24xlarge": 8,
    "ml.p3.2xlarge": 1,
    "ml.p3.8xlarge": 4,
    "ml.p3.16xlarge": 8,
    "ml.p3dn.24xlarge": 8,
    **{
        f"ml.{family}.{size}": gpus
        for family in ("g5", "g6", "g6e")
        for size, gpus in (
            ("xlarge", 1),
            ("2xlarge", 1),
            ("4xlarge", 1),
            ("8xlarge", 1),
            ("16xlarge", 1),
            ("12xlarge", 4),
            ("24xlarge", 4),
            ("48xlarge", 8),
        )
    },
    # CPU instances: gloo ranks (cpu_ranks_per_instance), for trying a job out cheaply
    **{f"ml.{family}.{size}": 0 for family in ("m5", "c5") for size in ("xlarge", "2xlarge", "4xlarge")},
}
# Instance types with EFA: the job's environment turns libfabric's EFA provider on for NCCL.
EFA_INSTANCES = frozenset(
    t for t in INSTANCE_GPUS if t.split(".")[1] in ("p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p3dn")
)
# The SageMaker PyTorch training image (AWS Deep Learning Containers) in the job's region; `image` overrides it.
DEFAULT_IMAGE = (
    "763104351884.dkr.ecr.{region}.amazonaws.com/pytorch-training:2.8.0-gpu-py312-cu129-ubuntu22.04-sagemaker"
)
SETUPS = ("uv", "image")  # the kit's Python environment in the job: `uv sync --frozen`, or the image holds it
CHANNELS = ("model", "train", "validation")
REQUIRED_CHANNELS = ("model", "train")

_JOB_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,46}")  # + "-YYYYmmdd-HHMMSS" stays within 63
_ROLE = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+")
_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-\d")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_S3_URI = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/.*)?")
_SUBNET = re.compile(r"subnet-[0-9a-f]+")
_SECURITY_GROUP = re.compile(r"sg-[0-9a-f]+")
MAX_RUNTIME_S = 28 * 24 * 3600  # SageMaker's own limit


@dataclass(frozen=True)
class SageMakerValues:
    """Every key of the values file with its default; None: not given."""

    role: str | None = None  # the job's execution role (S3, ECR, CloudWatch); required
    s3_prefix: str | None = None  # s3://bucket/prefix for the source, output and checkpoints; required
    channels: dict[str, str] = field(
        default_factory=dict
    )  # model, train (required), validation: s3:// prefixes
    job_name: str = "dskit"  # the job is named <job_name>-<YYYYmmdd-HHMMSS>
    region: str | None = None  # default: the AWS configuration's (AWS_DEFAULT_REGION, ~/.aws/config)
    image: str | None = None  # default: DEFAULT_IMAGE in the region
    setup: str = "uv"  # uv: the job runs `uv sync --frozen` (needs internet); image: the image holds the env
    instance_type: str = "ml.p5.48xlarge"
    instance_count: int = 1
    cpu_ranks_per_instance: int = 2  # ranks per instance on a CPU instance type (gloo)
    volume_size_gb: int = 500  # the ML storage volume: channels, checkpoints, caches, TMPDIR
    input_mode: str = "File"  # every channel's: File (downloaded first) or FastFile (streamed); never Pipe
    max_runtime_s: int = 24 * 3600
    spot: bool = False  # managed spot training: interrupted jobs restart and resume from the checkpoints
    max_wait_s: int | None = (
        None  # spot only: runtime plus time waiting for capacity (default 2 x max_runtime_s)
    )
    checkpoint_s3_uri: str | None = None  # default <s3_prefix>/<job>/checkpoints; reuse one to continue a run
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the job
    tags: dict[str, str] = field(default_factory=dict)
    subnets: list[str] = field(default_factory=list)  # VPC: both subnets and security_group_ids, or neither
    security_group_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_types(self)
        if self.role is None:
            raise ConfigError(
                "no role: set role: arn:aws:iam::<account>:role/<name> in the values file (a SageMaker "
                "execution role that may read and write the S3 prefixes and pull the image)"
            )
        if not _ROLE.fullmatch(self.role):
            raise ConfigError(
                f"role {redact.arn(self.role)} is not an IAM role ARN: use arn:aws:iam::<account>:role/<name>"
            )
        if self.s3_prefix is None:
            raise ConfigError(
                "no s3_prefix: set s3_prefix: s3://<bucket>/<prefix> (where the source, output and checkpoints go)"
            )
        bucket_of(self.s3_prefix, "s3_prefix")
        if self.checkpoint_s3_uri is not None:
            bucket_of(self.checkpoint_s3_uri, "checkpoint_s3_uri")
        for name in self.channels:
            if name not in CHANNELS:
                hint = _closest(name, list(CHANNELS))
                raise ConfigError(
                    f"unknown channel {name!r}: "
                    + (f"did you mean {hint}?" if hint else f"use {', '.join(CHANNELS)}")
                )
        for name in REQUIRED_CHANNELS:
            if name not in self.channels:
                raise ConfigError(
                    f"no {name} channel: set channels.{name}: s3://<bucket>/<prefix>/ "
                    + (
                        "(the Hugging Face model dir, uploaded with `aws s3 sync`)"
                        if name == "model"
                        else "(the dataset: files, a save_to_disk dir or a `dskit prepare-data` dir)"
                    )
                )
        for name, uri in self.channels.items():
            bucket_of(uri, f"channels.{name}")
        if not _JOB_NAME.fullmatch(self.job_name):
            raise ConfigError(
                f"job_name {self.job_name!r} must be letters, digits and '-', at most 47 characters, starting "
                "with a letter or digit (a timestamp is appended)"
            )
        if self.region is not None and not _REGION.fullmatch(self.region):
            raise ConfigError(f"region {self.region!r} is not an AWS region name: use e.g. us-east-1")
        if self.image is not None and not self.image.strip():
            raise ConfigError("image is empty: give an image URI or leave the key out for the default")
        if self.input_mode not in READABLE_INPUT_MODES:
            raise ConfigError(
                f"input_mode {self.input_mode!r} is not one the kit can read (it reads the channels as files; "
                f"Pipe streams them through a FIFO): use {' or '.join(READABLE_INPUT_MODES)}"
            )
        if self.setup not in SETUPS:
            raise ConfigError(f"setup {self.setup!r} must be one of {', '.join(SETUPS)}")
        if self.instance_type not in INSTANCE_GPUS:
            hint = _closest(self.instance_type, list(INSTANCE_GPUS))
            raise ConfigError(
                f"unknown instance type {self.instance_type!r}: "
                + (f"did you mean {hint}? " if hint else "")
                + "use a SageMaker training type such as ml.p5.48xlarge (a new type: add it to "
                "INSTANCE_GPUS in src/dskit/sagemaker/values.py)"
            )
        for name, low in (
            ("instance_count", 1),
            ("cpu_ranks_per_instance", 1),
            ("volume_size_gb", 1),
            ("max_runtime_s", 1),
        ):
            if getattr(self, name) < low:
                raise ConfigError(f"{name} = {getattr(self, name)}: use at least {low}")
        if self.max_runtime_s > MAX_RUNTIME_S:
            raise ConfigError(
                f"max_runtime_s = {self.max_runtime_s}: SageMaker allows at most {MAX_RUNTIME_S}"
            )
        if self.max_wait_s is not None:
            if not self.spot:
                raise ConfigError("max_wait_s is for spot jobs: add spot: true or drop max_wait_s")
            if self.max_wait_s < self.max_runtime_s:
                raise ConfigError(
                    f"max_wait_s = {self.max_wait_s} is less than max_runtime_s = {self.max_runtime_s}: "
                    "SageMaker needs max_wait_s >= max_runtime_s"
                )
        for key, value in self.env.items():
            if not _ENV_NAME.fullmatch(key):
                raise ConfigError(
                    f"env key {key!r} is not a valid environment variable name (e.g. NCCL_DEBUG)"
                )
            if any(ord(c) < 32 for c in value):
                raise ConfigError(f"env.{key} contains a control character: remove it")
        if bool(self.subnets) != bool(self.security_group_ids):
            raise ConfigError(
                "subnets and security_group_ids go together: give both (the job's VPC) or neither"
            )
        for name, pattern, example in (
            ("subnets", _SUBNET, "subnet-0abc1234"),
            ("security_group_ids", _SECURITY_GROUP, "sg-0abc1234"),
        ):
            for item in getattr(self, name):
                if not pattern.fullmatch(item):
                    raise ConfigError(f"{name}: {item!r} is not an id like {example}")

    @property
    def gpus_per_instance(self) -> int:
        return INSTANCE_GPUS[self.instance_type]

    @property
    def efa(self) -> bool:
        return self.instance_type in EFA_INSTANCES

    def wait_s(self) -> int | None:
        if not self.spot:
            return None
        return self.max_wait_s if self.max_wait_s is not None else 2 * self.max_runtime_s


FIELDS = {f.name: f for f in dataclasses.fields(SageMakerValues)}
_HINTS = typing.get_type_hints(SageMakerValues)


def bucket_of(uri: str, where: str) -> str:
    m = _S3_URI.fullmatch(uri)
    if not m:
        raise ConfigError(f"{where} {uri!r} is not an S3 URI: use s3://<bucket>/<prefix>")
    return m.group(1)


def _closest(name: str, options: list[str]) -> str | None:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return close[0] if close else None


def _check_types(values: SageMakerValues) -> None:
    # A values file is untyped YAML: catch `instance_count: two` or `spot: 1` here, with the key named.
    names = {int: "an integer", bool: "true or false", str: "a string", dict: "a mapping", list: "a list"}
    for name, hint in _HINTS.items():
        value = getattr(values, name)
        optional = isinstance(hint, types.UnionType)
        if value is None and optional:
            continue
        # int | None -> int
        base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
        want = typing.get_origin(base) or base
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{name} = {value!r} must be {names[want]}")
        if want is dict and not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(f"{name}: keys and values must be strings (quote numbers and booleans)")
        if want is list and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: every item must be a string")


def load(path: str | None) -> SageMakerValues:
    """The values file (YAML), checked; no file: the defaults (which lack a role: an error naming the key)."""
    if path is None:
        return SageMakerValues()
    # The run files' strict reader: a repeated key, an absurd number or an alias bomb is one line here too.
    data = run_file.load_yaml(path, "values file", "pass an existing YAML file to --values")
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"values file {path} must be a mapping of key: value (got {type(data).__name__})")
    for key in data:
        if key not in FIELDS:
            hint = _closest(str(key), list(FIELDS))
            raise ConfigError(
                f"values file {path}: unknown key {key!r}: "
                + (f"did you mean {hint}?" if hint else f"valid keys are {', '.join(FIELDS)}")
            )
    for key in ("env", "tags"):
        if isinstance(data.get(key), dict):  # YAML numbers and booleans -> the strings the API takes
            data[key] = {k: _scalar_text(v) for k, v in data[key].items()}
    return SageMakerValues(**data)


def _scalar_text(value: Any) -> Any:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return str(value)
    return value
