"""`dskit sagemaker`: the same run as a SageMaker training job.

    dskit sagemaker submit [--values sm.yaml] [--wait] [--dry_run] [TRAINING FLAGS or --config run.yaml]
    dskit sagemaker status JOB
    dskit sagemaker logs JOB
    dskit sagemaker stop JOB

`submit` checks the values file and the training flags locally (the trainer's own parser and DeepSpeed config
check), checks every S3 bucket and channel prefix, packs the kit's source (the files git tracks or would track, plus
the run file; never what runs write: checkpoints, logs, exports, caches, .venv) to <s3_prefix>/<job>/source/, and
creates the job with boto3's `create_training_job`. The job
runs `dskit.sagemaker.entry` on every instance (see there). The training flags travel as the job's
hyperparameters. Role ARNs are printed with the account masked; credentials never.

boto3, not the SageMaker Python SDK (v3 `ModelTrainer`): the SDK adds ~130 packages (docker, paramiko, fastapi,
...) for one API call, and its distributed drivers run torchrun themselves under a hardcoded /opt/ml, where the
kit needs its own entry (node rank, SIGTERM as a checkpoint request, the export). The request is a plain dict
here, visible with --dry_run.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from dskit.sagemaker import job_contract
from dskit.sagemaker.values import DEFAULT_IMAGE, SageMakerValues, bucket_of, load
from model_utils import launch_env
from model_utils.errors import CommandParser, ConfigError, first_line
from model_utils.observe import redact, step_line
from model_utils.repo import REPO_ROOT as REPO

SOURCE_ARCHIVE = "sourcedir.tar.gz"
CODE_CHANNEL = "code"
RUN_FILE_IN_SOURCE = ".dskit-sagemaker/run.yaml"  # where the run file lands inside the job's source root
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
# An untracked file larger than this is something a run or a command wrote (weights, shards, a log, data), not
# code: left out of the source, and named. Tracked files always go (the shipped corpus is 2.5 MB).
UNTRACKED_LIMIT_BYTES = 1_000_000
TERMINAL = ("Completed", "Failed", "Stopped")
POLL_S = 30.0
# The job's command: unpack the source onto the ML storage volume and run the entry with the image's Python
# (which installs the locked environment first with setup uv). A constant: no value of the user's is in it. The
# shell stays the container's PID 1 for the whole job: the kernel drops a signal PID 1 has no handler for, and the
# entry needs a moment after its start to install its own, so the shell's trap keeps a stop and hands it to the
# entry once the entry handles SIGTERM (SigCgt), then passes on the entry's exit status. It polls (0.2 s) rather
# than `wait`, which a trap arriving just before it would not interrupt.
BOOTSTRAP = """\
set -euo pipefail
trap 'echo "[dskit-sagemaker] SIGTERM before the entry started: stopped"; exit 143' TERM
base=${DSKIT_SM_BASE:-/opt/ml}
src="$base/input/dskit/src"
mkdir -p "$src" "${TMPDIR:-/tmp}"
tar -xzf "$base/input/data/code/sourcedir.tar.gz" -C "$src"
cd "$src"
export PYTHONPATH="$src/src${PYTHONPATH:+:$PYTHONPATH}"
entry_handles_term() {  # the entry itself (not this shell's fork before its exec) with its handler in
  local mask
  grep -qxzF dskit.sagemaker.entry "/proc/$1/cmdline" 2>/dev/null || return 1
  mask=$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$1/status" 2>/dev/null) || return 1
  (( (0x${mask:-0} >> 14) & 1 ))
}
stop=0
trap 'stop=1' TERM
python3 -m dskit.sagemaker.entry &
entry=$!
while kill -0 "$entry" 2>/dev/null; do
  if (( stop == 1 )) && entry_handles_term "$entry"; then
    kill -TERM "$entry" 2>/dev/null || true
    stop=2
  fi
  sleep 0.2
done
status=0
wait "$entry" || status=$?
exit "$status"
"""
# SageMaker metric definitions: regexes over the rank-0 step and validation lines, made by step_line, which renders
# those lines (so the two cannot drift apart).
METRIC_DEFINITIONS = [
    {"Name": name, "Regex": step_line.metric_regex(label)}
    for name, label in (
        ("train:loss", "Loss"),
        ("train:lr", "lr"),
        ("train:grad_norm", "grad_norm"),
        ("train:tokens_per_s", "tokens/s"),
        ("train:mfu_percent", "MFU"),
        ("validation:loss", "Validation Loss"),
        ("validation:perplexity", "Perplexity"),
        ("validation:bits_per_byte", "bits/byte"),
    )
]

USAGE = """\
usage: dskit sagemaker submit [--values FILE] [--wait] [--dry_run] [TRAINING FLAGS...]
       dskit sagemaker status JOB
       dskit sagemaker logs JOB
       dskit sagemaker stop JOB

submit: check the values file (YAML, see docs/sagemaker.md) and the training flags, upload the kit's source to
S3 and create a SageMaker training job that runs them on every instance. --wait: poll until the job ends (exit 0
when it completed); --dry_run: print the request (account masked) and stop before anything is uploaded or
created. The options come before the training flags (or --config run.yaml), which pass through to the job
(every training flag: dskit config --help).
status: the job's state; logs: its CloudWatch log; stop: ask SageMaker to stop it (the ranks save a checkpoint).
AWS region and credentials: the standard chain (AWS_DEFAULT_REGION, AWS_PROFILE, ~/.aws), or region: in the
values file for submit."""


SUBMIT_OPTIONS = ("--values", "--wait", "--dry_run")  # submit's own, before the training flags; in USAGE


# --- the training flags -------------------------------------------------------------------------------------


def training_hyperparameters(train_args: list[str]) -> tuple[dict[str, str], Path | None]:
    """The training flags as hyperparameters {flag: value}, and the run file (--config) if one is given."""
    hps: dict[str, str] = {}
    i = 0
    while i < len(train_args):
        token = train_args[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"{token!r} is not a training flag: give training flags as --name VALUE")
        name, sep, value = token[2:].partition("=")
        if not sep:
            if i + 1 >= len(train_args):
                raise ConfigError(f"--{name} needs a value (every training flag takes one)")
            value = train_args[i + 1]
            i += 1
        i += 1
        if name in job_contract.OWNED_FLAGS:
            raise ConfigError(
                f"--{name} is set by the job ({job_contract.OWNED_FLAGS[name]}): "
                + ("set the channel in the values file" if name != "checkpoint_dir" else "drop it")
            )
        hps[name] = value  # the last occurrence wins, as on the command line
    run_file = Path(hps["config"]).expanduser().resolve() if "config" in hps else None
    if run_file is not None:
        if not run_file.is_file():
            raise ConfigError(f"run file {hps['config']} not found: check --config")
        hps["config"] = RUN_FILE_IN_SOURCE
    return hps, run_file


def check_training_flags(hps: dict[str, str], run_file: Path | None, values: SageMakerValues) -> None:
    """The trainer's own parser and DeepSpeed check on the flags as the job will run them (the channels stand in
    for the model and data, which are in S3), from the source root like the job."""
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import train_settings

    argv: list[str] = []
    for name, value in hps.items():
        argv += [f"--{name}", str(run_file) if name == "config" and run_file else value]
    argv += ["--model", "sagemaker-model-channel", "--dataset", "sagemaker-train-channel"]
    if "validation" in values.channels:
        argv += ["--validation_dataset", "sagemaker-validation-channel"]
    with contextlib.chdir(REPO):
        cfg = parse_args(argv)
        train_settings.resolve(cfg)
    if run_file is not None:
        from model_utils.config import run_file as run_files
        from model_utils.config.arguments import SECTIONS

        overridden = sorted(
            set(run_files.load(str(run_file), SECTIONS).values) & set(job_contract.OWNED_FLAGS)
        )
        if overridden:
            print(f"note: the job sets {', '.join(overridden)} (from its channels), not the run file")


# --- the request --------------------------------------------------------------------------------------------


def job_environment(values: SageMakerValues) -> dict[str, str]:
    scratch = f"{job_contract.DEFAULT_BASE}/input/dskit"  # the ML storage volume (see sagemaker_entry)
    env = {
        launch_env.SAGEMAKER_SETUP: values.setup,
        launch_env.SAGEMAKER_CPU_RANKS: str(values.cpu_ranks_per_instance),
        # The model and data come from the channels: never the hub.
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # The root volume is small: temp files and caches on the ML storage volume.
        "TMPDIR": f"{scratch}/tmp",
        "HF_HOME": f"{scratch}/hf",
        "TORCH_EXTENSIONS_DIR": f"{scratch}/torch_extensions",
        "TRITON_CACHE_DIR": f"{scratch}/triton",
    }
    if values.efa:
        env |= {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
    return env | values.env  # the values file's env wins


def build_request(
    values: SageMakerValues, job_name: str, region: str, hyperparameters: dict[str, str]
) -> dict[str, Any]:
    """The CreateTrainingJob request."""
    prefix = values.s3_prefix
    assert prefix is not None and values.role is not None  # SageMakerValues requires both
    prefix = prefix.rstrip("/")

    def channel(name: str, uri: str, mode: str) -> dict[str, Any]:
        source = {"S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}
        return {"ChannelName": name, "DataSource": {"S3DataSource": source}, "InputMode": mode}

    request: dict[str, Any] = {
        "TrainingJobName": job_name,
        "RoleArn": values.role,
        "AlgorithmSpecification": {
            "TrainingImage": values.image or DEFAULT_IMAGE.format(region=region),
            "TrainingInputMode": "File",
            "ContainerEntrypoint": ["/bin/bash", "-c", BOOTSTRAP],
            "MetricDefinitions": METRIC_DEFINITIONS,
        },
        "HyperParameters": hyperparameters,
        "InputDataConfig": [
            channel(CODE_CHANNEL, source_uri(values, job_name), "File"),  # the bootstrap untars it
            *(channel(name, uri, values.input_mode) for name, uri in sorted(values.channels.items())),
        ],
        "OutputDataConfig": {"S3OutputPath": f"{prefix}/output"},
        "ResourceConfig": {
            "InstanceType": values.instance_type,
            "InstanceCount": values.instance_count,
            "VolumeSizeInGB": values.volume_size_gb,
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": values.max_runtime_s},
        "CheckpointConfig": {
            "S3Uri": values.checkpoint_s3_uri or f"{prefix}/{job_name}/checkpoints",
            "LocalPath": f"{job_contract.DEFAULT_BASE}/checkpoints",
        },
        "Environment": job_environment(values),
        "EnableManagedSpotTraining": values.spot,
        "Tags": [{"Key": k, "Value": v} for k, v in sorted(values.tags.items())],
    }
    wait_s = values.wait_s()
    if wait_s is not None:
        request["StoppingCondition"]["MaxWaitTimeInSeconds"] = wait_s
    if values.subnets:
        request["VpcConfig"] = {"Subnets": values.subnets, "SecurityGroupIds": values.security_group_ids}
    return request


def source_uri(values: SageMakerValues, job_name: str) -> str:
    assert values.s3_prefix is not None
    return f"{values.s3_prefix.rstrip('/')}/{job_name}/source/"


def redacted(request: dict[str, Any]) -> dict[str, Any]:
    """The request for printing (observe/redact.py): the role's account masked, the values of secret-named
    environment variables and hyperparameters hidden, credentials in every URI removed. Tags are kept as they
    are ("Key" names a tag, not a secret); the rest only has its URIs redacted."""
    out = {k: v if k == "Tags" else redact.tree(v) for k, v in request.items()}
    out["RoleArn"] = redact.arn(request["RoleArn"])
    return out


# --- S3: checks and the source ------------------------------------------------------------------------------


def _aws_error(err: Exception, what: str, fix: str) -> ConfigError:
    code = getattr(err, "response", {}).get("Error", {}).get("Code", type(err).__name__)
    return ConfigError(f"{what}: {code} ({first_line(err)}): {fix}")


def check_s3(s3: Any, values: SageMakerValues) -> None:
    """Every bucket the job touches exists and is ours to use, every channel prefix holds objects: before
    anything is uploaded or created."""
    from botocore.exceptions import ClientError

    assert values.s3_prefix is not None
    buckets = {bucket_of(values.s3_prefix, "s3_prefix"): "s3_prefix"}
    if values.checkpoint_s3_uri:
        buckets.setdefault(bucket_of(values.checkpoint_s3_uri, "checkpoint_s3_uri"), "checkpoint_s3_uri")
    for name, uri in values.channels.items():
        buckets.setdefault(bucket_of(uri, f"channels.{name}"), f"channels.{name}")
    for bucket, key in buckets.items():
        try:
            s3.head_bucket(Bucket=bucket)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code"))
            if code in ("404", "NoSuchBucket"):
                raise ConfigError(
                    f"bucket {bucket} ({key}) does not exist: create it (aws s3 mb s3://{bucket}) or fix {key}"
                ) from None
            if code in ("403", "AccessDenied"):
                raise ConfigError(
                    f"access denied to bucket {bucket} ({key}): use credentials that may list and write it, or "
                    f"another bucket in {key}"
                ) from None
            raise _aws_error(e, f"bucket {bucket} ({key})", "check the bucket and your credentials") from None
    for name, uri in sorted(values.channels.items()):
        bucket, _, key = uri[len("s3://") :].partition("/")
        try:
            listed = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
        except ClientError as e:
            raise _aws_error(e, f"channels.{name} {uri}", "use credentials that may list it") from None
        if not listed.get("KeyCount"):
            raise ConfigError(
                f"channels.{name} {uri} holds no objects: upload it first (aws s3 sync LOCAL_DIR {uri})"
            )


def source_files() -> tuple[list[str], list[str]]:
    """The kit's files, as they are in the working tree: what git tracks, and what it would track (untracked, not
    ignored) up to UNTRACKED_LIMIT_BYTES; and the untracked files left out for their size. What runs and commands
    write where the kit puts it (checkpoints/, logs/, out/, .cache/, .venv/, ...) is git-ignored (.gitignore)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "-t", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        raise ConfigError(
            f"{REPO} is not a git checkout: submit from a clone of the kit (its source is what git tracks)"
        ) from None
    # -t tags each name ("?": untracked); a dict, as an unmerged file is listed once per stage
    tags = {name: tag for tag, name in (e.split(" ", 1) for e in listed.decode().split("\0") if e)}
    files, left_out = [], []
    for name, tag in sorted(tags.items()):
        path = REPO / name
        if not path.is_file():  # deleted but still tracked: skipped
            continue
        if tag == "?" and path.lstat().st_size > UNTRACKED_LIMIT_BYTES:
            left_out.append(name)
        else:
            files.append(name)
    return files, left_out


def pack_source(out: Path, run_file: Path | None) -> tuple[int, int]:
    """Write the source tarball; (files, bytes)."""
    files, left_out = source_files()
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        print(
            f"note: left out {len(left_out)} untracked file(s) over {UNTRACKED_LIMIT_BYTES / 1e6:g} MB, outputs "
            f"rather than code: {shown} (git-ignore them or move them out of the checkout)"
        )
    with tarfile.open(out, "w:gz") as tar:
        for name in files:
            tar.add(REPO / name, arcname=name, recursive=False)
        if run_file is not None:
            tar.add(run_file, arcname=RUN_FILE_IN_SOURCE)
    return len(files) + (run_file is not None), out.stat().st_size


# --- commands -----------------------------------------------------------------------------------------------


def _session(region: str | None = None) -> Any:
    import boto3

    session = boto3.session.Session(region_name=region)
    if session.region_name is None:
        raise ConfigError(
            "no AWS region: set region: in the values file, or AWS_DEFAULT_REGION (e.g. us-east-1)"
        )
    return session


def _client(session: Any, service: str) -> Any:
    client = session.client(service)
    if session.get_credentials() is None:
        raise ConfigError(
            "no AWS credentials: configure them (aws configure, AWS_PROFILE, or an instance role), then retry"
        )
    return client


def submit(args: list[str]) -> int:
    values_file, wait, dry_run = None, False, False
    while args and args[0] in SUBMIT_OPTIONS:  # ours come first; the rest is training's
        option, args = args[0], args[1:]
        if option == "--values":
            if not args:
                raise ConfigError("--values needs a file (dskit sagemaker --help)")
            values_file, args = args[0], args[1:]
        elif option == "--wait":
            wait = True
        else:
            dry_run = True
    values = load(values_file)
    hps, run_file = training_hyperparameters(args)
    check_training_flags(hps, run_file, values)
    session = _session(values.region)
    job_name = f"{values.job_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    request = build_request(values, job_name, session.region_name, hps)
    if dry_run:
        print(json.dumps(redacted(request), indent=2))
        print(
            "dry run: nothing uploaded or created, and nothing asked of AWS: not checked are the buckets and the "
            "channels (a submit checks them before it uploads), what the role may do, the instance quota and "
            "spot capacity"
        )
        return 0
    s3 = _client(session, "s3")
    sagemaker = _client(session, "sagemaker")
    from botocore.exceptions import BotoCoreError, ClientError

    check_s3(s3, values)
    uri = source_uri(values, job_name)
    bucket, _, key = uri[len("s3://") :].partition("/")
    with tempfile.TemporaryDirectory(prefix="dskit-sagemaker-") as tmp:
        archive = Path(tmp) / SOURCE_ARCHIVE
        count, size = pack_source(archive, run_file)
        started = time.perf_counter()
        try:
            s3.upload_file(str(archive), bucket, key + SOURCE_ARCHIVE)
        except (ClientError, BotoCoreError) as e:
            raise _aws_error(
                e, f"uploading the source to {uri}", "check the bucket and your credentials"
            ) from None
        seconds = time.perf_counter() - started
    print(f"source: {count} files, {size / 1e6:.2f} MB uploaded to {uri}{SOURCE_ARCHIVE} in {seconds:.2f} s")
    try:
        arn = sagemaker.create_training_job(**request)["TrainingJobArn"]
    except (ClientError, BotoCoreError) as e:
        raise _aws_error(e, f"creating training job {job_name}", "fix what SageMaker says above") from None
    print(
        f"created {redact.arn(arn)}: {values.instance_count} x {values.instance_type}"
        f"{' (spot)' if values.spot else ''}, checkpoints {request['CheckpointConfig']['S3Uri']}, "
        f"model {request['OutputDataConfig']['S3OutputPath']}/{job_name}/output/model.tar.gz"
    )
    print(f"follow it: dskit sagemaker status {job_name}; dskit sagemaker logs {job_name}")
    return _wait(sagemaker, job_name) if wait else 0


def _describe(sagemaker: Any, job: str) -> dict[str, Any]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return sagemaker.describe_training_job(TrainingJobName=job)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("ValidationException", "ResourceNotFound"):
            raise ConfigError(
                f"no training job {job!r} in {sagemaker.meta.region_name}: check the name (aws sagemaker "
                "list-training-jobs) and the region"
            ) from None
        raise _aws_error(e, f"describing {job}", "check your credentials and region") from None
    except BotoCoreError as e:
        raise _aws_error(e, f"describing {job}", "check your credentials and region") from None


def _wait(sagemaker: Any, job: str) -> int:
    seen = None
    while True:
        described = _describe(sagemaker, job)
        state = (described["TrainingJobStatus"], described.get("SecondaryStatus"))
        if state != seen:
            print(f"{job}: {state[0]} ({state[1]})", flush=True)
            seen = state
        if state[0] in TERMINAL:
            if described.get("FailureReason"):
                print(f"failure reason: {described['FailureReason']}")
            return 0 if state[0] == "Completed" else 1
        time.sleep(POLL_S)


def status(job: str) -> int:
    d = _describe(_client(_session(), "sagemaker"), job)
    resources = d.get("ResourceConfig", {})
    lines = [
        f"job: {d['TrainingJobName']}",
        f"status: {d['TrainingJobStatus']} ({d.get('SecondaryStatus', '-')})",
        f"instances: {resources.get('InstanceCount')} x {resources.get('InstanceType')}"
        + (" (spot)" if d.get("EnableManagedSpotTraining") else ""),
        f"role: {redact.arn(d.get('RoleArn', '-'))}",
    ]
    if d.get("CheckpointConfig"):
        lines.append(f"checkpoints: {d['CheckpointConfig'].get('S3Uri')}")
    if d.get("ModelArtifacts"):
        lines.append(f"model: {d['ModelArtifacts'].get('S3ModelArtifacts')}")
    for key, label in (("TrainingTimeInSeconds", "training s"), ("BillableTimeInSeconds", "billable s")):
        if key in d:
            lines.append(f"{label}: {d[key]}")
    if d.get("FailureReason"):
        lines.append(f"failure reason: {d['FailureReason']}")
    for t in d.get("SecondaryStatusTransitions", []):
        lines.append(f"  {t.get('StartTime')} {t.get('Status')}: {t.get('StatusMessage', '')}")
    print("\n".join(lines))
    return 0


def logs(job: str) -> int:
    session = _session()
    _describe(_client(session, "sagemaker"), job)  # an unknown job is one line, not an empty log
    cw = _client(session, "logs")
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        streams = cw.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=f"{job}/")["logStreams"]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ResourceNotFoundException":
            streams = []
        else:
            raise _aws_error(
                e, f"reading the log of {job}", "use credentials that may read CloudWatch Logs"
            ) from None
    except BotoCoreError as e:
        raise _aws_error(e, f"reading the log of {job}", "check your credentials and region") from None
    if not streams:
        print(f"no log yet for {job} (its instances may still be starting): try again in a minute")
        return 0
    for stream in sorted(streams, key=lambda s: s["logStreamName"]):
        name, token = stream["logStreamName"], None
        while True:
            kwargs = {"logGroupName": LOG_GROUP, "logStreamName": name, "startFromHead": True}
            page = cw.get_log_events(**kwargs, **({"nextToken": token} if token else {}))
            for event in page["events"]:
                print(f"[{name.split('/', 1)[-1]}] {event['message']}")
            if page.get("nextForwardToken") in (None, token):
                break
            token = page["nextForwardToken"]
    return 0


def stop(job: str) -> int:
    from botocore.exceptions import BotoCoreError, ClientError

    sagemaker = _client(_session(), "sagemaker")
    state = _describe(sagemaker, job)["TrainingJobStatus"]
    if state in TERMINAL:
        print(f"{job} is already {state}: nothing to stop")
        return 0
    try:
        sagemaker.stop_training_job(TrainingJobName=job)
    except (ClientError, BotoCoreError) as e:
        raise _aws_error(e, f"stopping {job}", "check your credentials and region") from None
    print(
        f"stop requested for {job}: SageMaker sends SIGTERM, the ranks save a checkpoint and stop "
        "(it is in the job's checkpoint S3 URI)"
    )
    return 0


def job_parser(name: str) -> CommandParser:
    """The parser of `dskit sagemaker status|logs|stop JOB`."""
    parser = CommandParser(prog=f"dskit sagemaker {name}")
    parser.add_argument("job", metavar="JOB", help="the training job's name")
    return parser


def _job_command(name: str, fn: Any) -> Any:
    def run(args: list[str]) -> int:
        return fn(job_parser(name).parse_args(args).job)

    return run


SUBCOMMANDS = {
    "submit": submit,
    "status": _job_command("status", status),
    "logs": _job_command("logs", logs),
    "stop": _job_command("stop", stop),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "submit" and argv[1:2] in (["-h"], ["--help"])):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        raise ConfigError(
            f"unknown sagemaker command {command!r}: use {', '.join(SUBCOMMANDS)} (dskit sagemaker --help)"
        )
    return SUBCOMMANDS[command](rest)
