"""`dskit sagemaker`: submission, status, logs and stop against moto's server on loopback (real S3, SageMaker and
CloudWatch Logs APIs), the values file's checks, the job's bootstrap and metric regexes. No AWS, no Docker.

Mocked, and why: StopTrainingJob (moto 5.2.5 answers 500 NotImplemented) and a running job's status (moto reports
every job Completed at once) are answered by tests/support/sagemaker_proxy.py, which also records the requests as
sent (moto keeps no Environment and replaces MetricDefinitions)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dskit import cli, sagemaker
from dskit.sagemaker.values import DEFAULT_IMAGE, SageMakerValues, load
from model_utils.errors import ConfigError
from model_utils.observe import step_line
from support.s3_server import FAKE_SECRET, S3Env
from support.sagemaker_proxy import SageMakerProxy

ROLE = "arn:aws:iam::123456789012:role/DskitTraining"


@pytest.fixture
def proxy(s3: S3Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[SageMakerProxy]:
    recorder = SageMakerProxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", recorder.url)
    yield recorder
    recorder.close()


def channels(s3: S3Env, validation: bool = True) -> dict[str, str]:
    s3.client.put_object(Bucket=s3.bucket, Key="models/tiny/config.json", Body=b"{}")
    s3.client.put_object(Bucket=s3.bucket, Key="data/train/part-0.jsonl", Body=b'{"text": "a"}\n')
    out = {"model": s3.uri("models/tiny/"), "train": s3.uri("data/train/")}
    if validation:
        s3.client.put_object(Bucket=s3.bucket, Key="data/val/part-0.jsonl", Body=b'{"text": "b"}\n')
        out["validation"] = s3.uri("data/val/")
    return out


def values_file(tmp_path: Path, **values: object) -> Path:
    import yaml

    path = tmp_path / "sm.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def submit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(["sagemaker", "submit", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_submit_sends_the_job_and_uploads_the_kit(
    s3: S3Env, proxy: SageMakerProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_file = tmp_path / "run.yaml"
    run_file.write_text("loop: {max_steps: 40}\ndata: {seq_length: 32}\n")
    values = values_file(
        tmp_path,
        role=ROLE,
        s3_prefix=s3.uri("dskit"),
        channels=channels(s3),
        job_name="sm-test",
        instance_type="ml.p5.48xlarge",
        instance_count=2,
        spot=True,
        max_runtime_s=7200,
        env={"NCCL_DEBUG": "INFO", "WANDB_API_KEY": "hush-123"},
        tags={"team": "ml"},
        subnets=["subnet-0abc"],
        security_group_ids=["sg-0def"],
    )
    status, out, err = submit(capsys, "--values", str(values), "--config", str(run_file), "--lr", "2e-5")
    assert status == 0, err
    (req,) = proxy.sent("CreateTrainingJob")
    job = req["TrainingJobName"]
    assert re.fullmatch(r"sm-test-\d{8}-\d{6}", job)
    algo = req["AlgorithmSpecification"]
    assert algo["TrainingImage"] == DEFAULT_IMAGE.format(region="us-east-1")
    assert algo["ContainerEntrypoint"] == ["/bin/bash", "-c", sagemaker.BOOTSTRAP]
    assert algo["MetricDefinitions"] == sagemaker.METRIC_DEFINITIONS
    assert req["ResourceConfig"] == {
        "InstanceType": "ml.p5.48xlarge",
        "InstanceCount": 2,
        "VolumeSizeInGB": 500,
    }
    assert req["HyperParameters"] == {"config": sagemaker.RUN_FILE_IN_SOURCE, "lr": "2e-5"}
    uris = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in req["InputDataConfig"]}
    assert uris == {
        "code": s3.uri(f"dskit/{job}/source/"),
        "model": s3.uri("models/tiny/"),
        "train": s3.uri("data/train/"),
        "validation": s3.uri("data/val/"),
    }
    assert req["CheckpointConfig"] == {
        "S3Uri": s3.uri(f"dskit/{job}/checkpoints"),
        "LocalPath": "/opt/ml/checkpoints",
    }
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200, "MaxWaitTimeInSeconds": 14400}
    assert req["EnableManagedSpotTraining"] is True
    assert req["VpcConfig"] == {"Subnets": ["subnet-0abc"], "SecurityGroupIds": ["sg-0def"]}
    assert req["Tags"] == [{"Key": "team", "Value": "ml"}]
    env = req["Environment"]
    assert env["FI_PROVIDER"] == "efa" and env["HF_HUB_OFFLINE"] == "1" and env["NCCL_DEBUG"] == "INFO"
    assert env["TMPDIR"].startswith("/opt/ml/input/") and env["HF_HOME"].startswith("/opt/ml/input/")
    assert env["DSKIT_SM_SETUP"] == "uv"

    # What moto stored matches (a real CreateTrainingJob went through).
    described = cli.main(["sagemaker", "status", job])
    status_out = capsys.readouterr().out
    assert described == 0 and "instances: 2 x ml.p5.48xlarge (spot)" in status_out
    assert f"checkpoints: {s3.uri(f'dskit/{job}/checkpoints')}" in status_out

    # The source tarball holds the kit and the run file, not the environment or local runs.
    (key,) = s3.keys(f"dskit/{job}/source/")
    body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = set(tar.getnames())
        packed_run_file = tar.extractfile(sagemaker.RUN_FILE_IN_SOURCE).read()  # type: ignore[union-attr]
    for required in (
        "pyproject.toml", "uv.lock", "src/train_deepspeed.py", "src/model_utils/loop/trainer.py",
        "src/dskit/sagemaker/entry.py", "deepspeed/ds_config.json",
    ):  # fmt: skip
        assert required in names, required
    assert not any(n.startswith((".venv/", "checkpoints/tiny", ".git/")) for n in names)
    assert packed_run_file == run_file.read_bytes()
    m = re.search(r"source: (\d+) files, ([\d.]+) MB uploaded to .* in ([\d.]+) s", out)
    assert m and int(m[1]) == len(names), out

    # Never the account in full, a secret-looking value or a credential.
    shown = out + err + status_out
    assert "123456789012" not in shown and "****9012" in shown and FAKE_SECRET not in shown


def test_the_source_is_the_kits_code_never_what_runs_and_commands_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkout with the kit's .gitignore, some code committed and a new module not yet, holding what runs and
    commands write where the docs put it (checkpoints, logs, an export to out/, the schedules plot, caches,
    .venv) and an export where nothing ignores it: the tarball is the code, a few kB."""
    checkout = tmp_path / "checkout"
    code = {
        ".gitignore": (sagemaker.REPO / ".gitignore").read_bytes(),
        "pyproject.toml": b"[project]\nname = 'dskit'\n",
        "src/dskit/__init__.py": b"",
        "configs/run.yaml": b"loop: {max_steps: 40}\n",
        "checkpoints/.gitkeep": b"",
        "logs/.gitkeep": b"",
        "docs/lr-schedules.png": b"\x89PNG tracked",  # a tracked file keeps going, whatever its name
    }
    weights = b"\0" * (sagemaker.UNTRACKED_LIMIT_BYTES + 1)
    written = {
        "checkpoints/run/global_step40/mp_rank_00_model_states.pt": weights,
        "checkpoints/run/latest": b"global_step40",
        "logs/tiny_qwen3-deepspeed_20261129-120000.out": b"Step 40/40 | Loss 5.1\n",
        "logs/tiny_qwen3-deepspeed_20261129-120000.png": b"\x89PNG",
        "out/tiny-base/model.safetensors": weights,
        "out/tiny-base/config.json": b"{}",
        "lr-schedules.png": b"\x89PNG",
        ".venv/bin/python": b"#!",
        ".cache/torch_extensions/py311_cpu/cpu_adam/cpu_adam.so": weights,
        ".cache/data/blocks.bin": weights,
        "data/prepared/train/00000.bin": weights,
        "src/dskit/__pycache__/__init__.cpython-311.pyc": b"pyc",
        "my-export/model.safetensors": weights,  # no rule ignores it: left out for its size, and named
    }
    for name, body in {**code, **written, "src/dskit/new_tool.py": b"print('new')\n"}.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_bytes(body)
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", *code], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "the kit"], check=True)
    monkeypatch.setattr(sagemaker, "REPO", checkout)

    archive = tmp_path / sagemaker.SOURCE_ARCHIVE
    count, size = sagemaker.pack_source(archive, None)
    note = capsys.readouterr().out
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert names == {*code, "src/dskit/new_tool.py"} and count == len(names)
    print(f"source tarball: {count} files, {size} bytes")  # what was written: 7 MB
    assert size < 4096, size
    assert note.startswith(
        "note: left out 1 untracked file(s) over 1 MB, outputs rather than code: my-export/"
    )


def test_dry_run_prints_the_redacted_request_and_touches_nothing(
    s3: S3Env, proxy: SageMakerProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = values_file(
        tmp_path, role=ROLE, s3_prefix=s3.uri("dskit"), channels=channels(s3, validation=False),
        instance_type="ml.g5.2xlarge",
        env={
            "HF_TOKEN": "hf_secret", "MLFLOW_TRACKING_URI": "https://admin:pw_env@mlflow.example/",
            "GITHUB_PAT": "ghp_secret", "HF_AUTH": "auth_secret", "TOKENIZERS_PARALLELISM": "false",
        },
    )  # fmt: skip
    before = s3.keys()
    status, out, err = submit(
        capsys, "--values", str(values), "--dry_run", "--max_steps", "5",
        "--tracking_uri", "https://bob:pw_hp@mlflow.example/", "--report_to", "mlflow",
    )  # fmt: skip
    assert status == 0, err
    printed = json.loads(out[: out.rindex("}") + 1])
    assert printed["RoleArn"] == "arn:aws:iam::****9012:role/DskitTraining"
    assert printed["Environment"]["HF_TOKEN"] == "***"
    assert printed["Environment"]["GITHUB_PAT"] == printed["Environment"]["HF_AUTH"] == "***"
    assert printed["Environment"]["MLFLOW_TRACKING_URI"] == "https://mlflow.example/"
    assert printed["Environment"]["TOKENIZERS_PARALLELISM"] == "false"  # not a secret: shown
    assert "FI_PROVIDER" not in printed["Environment"]  # g5.2xlarge has no EFA
    assert printed["HyperParameters"] == {
        "max_steps": "5", "tracking_uri": "https://mlflow.example/", "report_to": "mlflow",
    }  # fmt: skip
    for secret in ("hf_secret", "pw_env", "pw_hp", "ghp_secret", "auth_secret", "admin", "bob"):
        assert secret not in out + err, secret
    assert "dry run: nothing uploaded or created" in out
    assert s3.keys() == before and proxy.requests == []


def test_wait_status_and_logs(
    s3: S3Env, proxy: SageMakerProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import boto3

    values = values_file(tmp_path, role=ROLE, s3_prefix=s3.uri("p"), channels=channels(s3), job_name="waited")
    status, out, err = submit(capsys, "--values", str(values), "--wait")
    assert status == 0, err  # moto completes every job at once
    job = proxy.sent("CreateTrainingJob")[0]["TrainingJobName"]
    assert f"{job}: Completed (Completed)" in out
    logs = boto3.session.Session().client("logs")
    with contextlib.suppress(logs.exceptions.ResourceAlreadyExistsException):  # one moto server per session
        logs.create_log_group(logGroupName=sagemaker.LOG_GROUP)
    for host, lines in (("algo-1", ["Step 1/2 | Loss 7.0000", "Done"]), ("algo-2", ["node 2 up"])):
        stream = f"{job}/{host}-1700000000"
        logs.create_log_stream(logGroupName=sagemaker.LOG_GROUP, logStreamName=stream)
        now_ms = int(time.time() * 1000)  # CloudWatch (and moto) drop events older than 14 days
        events = [{"timestamp": now_ms + i, "message": m} for i, m in enumerate(lines)]
        logs.put_log_events(logGroupName=sagemaker.LOG_GROUP, logStreamName=stream, logEvents=events)
    assert cli.main(["sagemaker", "logs", job]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "[algo-1-1700000000] Step 1/2 | Loss 7.0000",
        "[algo-1-1700000000] Done",
        "[algo-2-1700000000] node 2 up",
    ]
    assert cli.main(["sagemaker", "logs", "no-such-job"]) == 2
    assert capsys.readouterr().err.startswith("error: no training job 'no-such-job'")


def test_stop_asks_sagemaker_to_stop_a_running_job(
    s3: S3Env, proxy: SageMakerProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = values_file(tmp_path, role=ROLE, s3_prefix=s3.uri("p"), channels=channels(s3), job_name="stopme")
    assert submit(capsys, "--values", str(values))[0] == 0
    job = proxy.sent("CreateTrainingJob")[0]["TrainingJobName"]
    # moto: every job is Completed and StopTrainingJob is not implemented; see the module doc.
    assert cli.main(["sagemaker", "stop", job]) == 0
    assert "already Completed: nothing to stop" in capsys.readouterr().out and not proxy.sent(
        "StopTrainingJob"
    )
    proxy.rewrite["DescribeTrainingJob"] = lambda d: {**d, "TrainingJobStatus": "InProgress"}
    proxy.fake["StopTrainingJob"] = lambda body: {}
    assert cli.main(["sagemaker", "stop", job]) == 0
    assert proxy.sent("StopTrainingJob") == [{"TrainingJobName": job}]
    assert f"stop requested for {job}" in capsys.readouterr().out


# --- bad input: one line, exit 2, nothing uploaded or created ---------------------------------------------


@pytest.mark.parametrize(
    ("change", "train_args", "message"),
    [
        ({"role": None}, [], "error: no role: set role: arn:aws:iam::<account>:role/<name>"),
        (
            {"instance_type": "ml.p5.48xlarg"},
            [],
            "unknown instance type 'ml.p5.48xlarg': did you mean ml.p5.48xlarge?",
        ),
        (
            {"channels": {"model": "/data/model", "train": "s3://b/t/"}},
            [],
            "channels.model '/data/model' is not an S3 URI",
        ),
        ({"instance_count": "two"}, [], "instance_count = 'two' must be an integer"),
        ({"input_mode": "Pipe"}, [], "input_mode 'Pipe' is not one the kit can read"),
        ({"spot": False, "max_wait_s": 100}, [], "max_wait_s is for spot jobs"),
        ({}, ["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        ({}, ["--max_stepz", "3"], "unknown flag --max_stepz: did you mean --max_steps?"),
        ({}, ["--model", "Qwen/Qwen3-8B"], "--model is set by the job (the model channel)"),
        ({}, ["--validation_split", "val"], "--validation_dataset and --validation_split both given"),
    ],
)
def test_bad_input_is_one_line_and_touches_nothing(
    s3: S3Env,
    proxy: SageMakerProxy,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: dict,
    train_args: list[str],
    message: str,
) -> None:
    values = {"role": ROLE, "s3_prefix": s3.uri("p"), "channels": channels(s3)} | change
    before = s3.keys()
    status, _, err = submit(
        capsys,
        "--values",
        str(values_file(tmp_path, **{k: v for k, v in values.items() if v is not None})),
        *train_args,
    )
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert s3.keys() == before and proxy.requests == []


def test_unknown_values_key_names_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'instance_typ': did you mean instance_type"):
        load(str(values_file(tmp_path, role=ROLE, instance_typ="ml.p5.48xlarge")))


def test_missing_bucket_and_empty_channel_are_caught_before_any_upload(
    s3: S3Env, proxy: SageMakerProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uris = channels(s3)
    before = s3.keys()
    missing = values_file(tmp_path, role=ROLE, s3_prefix="s3://dskit-no-such-bucket/p", channels=uris)
    status, _, err = submit(capsys, "--values", str(missing))
    assert status == 2 and "bucket dskit-no-such-bucket (s3_prefix) does not exist: create it" in err
    empty = values_file(
        tmp_path, role=ROLE, s3_prefix=s3.uri("p"), channels={**uris, "train": s3.uri("nothing/")}
    )
    status, _, err = submit(capsys, "--values", str(empty))
    assert status == 2 and f"channels.train {s3.uri('nothing/')} holds no objects: upload it first" in err
    assert s3.keys() == before and proxy.requests == []


def test_access_denied_is_one_line(s3_denied, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = f"s3://{s3_denied.bucket}"
    values = values_file(
        tmp_path,
        role=ROLE,
        s3_prefix=f"{bucket}/p",
        channels={"model": f"{bucket}/m/", "train": f"{bucket}/t/"},
    )
    status, out, err = submit(capsys, "--values", str(values))
    assert status == 2 and err.startswith(f"error: access denied to bucket {s3_denied.bucket} (s3_prefix)")
    assert s3_denied.secret not in out + err


# --- the job's pieces -------------------------------------------------------------------------------------


def test_metric_definitions_scrape_the_trainers_lines() -> None:
    record = {
        "step": 12, "loss": 2.34567, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 4096.0,
        "tokens_per_s_per_device": 512.0, "mfu": 0.41, "val_loss": 2.5, "val_ppl": 12.18, "val_bpb": 1.25,
        "eta_s": 42.0,
    }  # fmt: skip
    text = step_line.step_line(record, 100) + "\n" + step_line.validation_line(record, 100)
    found = {}
    for metric in sagemaker.METRIC_DEFINITIONS:
        values = re.findall(metric["Regex"], text)
        assert len(values) == 1, (metric, text)
        found[metric["Name"]] = float(values[0])
    assert found == {
        "train:loss": 2.3457, "train:lr": 3e-4, "train:grad_norm": 0.5, "train:tokens_per_s": 4096.0,
        "train:mfu_percent": 41.0, "validation:loss": 2.5, "validation:perplexity": 12.18,
        "validation:bits_per_byte": 1.25,
    }  # fmt: skip


def test_bootstrap_is_shellcheck_clean_and_unpacks_the_source(tmp_path: Path) -> None:
    script = tmp_path / "bootstrap.sh"
    script.write_text("#!/usr/bin/env bash\n" + sagemaker.BOOTSTRAP)
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed: apt-get install shellcheck")
    check = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    # A source tarball whose entry module only reports where it runs from.
    code = tmp_path / "ml" / "input" / "data" / "code"
    code.mkdir(parents=True)
    with tarfile.open(code / sagemaker.SOURCE_ARCHIVE, "w:gz") as tar:
        entry = b"import os, sys; print('entry in', os.getcwd(), sys.argv[1:])\n"
        info = tarfile.TarInfo("src/dskit/sagemaker/entry.py")
        info.size = len(entry)
        tar.addfile(info, io.BytesIO(entry))
        tar.addfile(tarfile.TarInfo("src/dskit/__init__.py"), io.BytesIO(b""))
    env = {"PATH": "/usr/bin:/bin", "DSKIT_SM_BASE": str(tmp_path / "ml"), "TMPDIR": str(tmp_path / "ml/tmp")}
    proc = subprocess.run(["bash", "-c", sagemaker.BOOTSTRAP], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"entry in {tmp_path / 'ml/input/dskit/src'} []"


def _stop_bootstrap_at(marker: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run the bootstrap, SIGTERM it once `marker` exists; its exit status and output."""
    proc = subprocess.Popen(["bash", "-c", sagemaker.BOOTSTRAP], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    return proc.returncode, out


def test_a_stop_while_the_bootstrap_unpacks_is_kept_and_ends_it_with_143(tmp_path: Path) -> None:
    """The bootstrap shell is the container's PID 1 until its exec: without a trap the kernel drops SIGTERM."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    unpacking = tmp_path / "unpacking"
    (fake_bin / "tar").write_text(f"#!/bin/sh\ntouch {unpacking}\nsleep 1\n")
    (fake_bin / "tar").chmod(0o755)
    (fake_bin / "python3").write_text("#!/bin/sh\necho entry ran\n")
    (fake_bin / "python3").chmod(0o755)
    env = {
        "PATH": f"{fake_bin}:/usr/bin:/bin",
        "DSKIT_SM_BASE": str(tmp_path / "ml"),
        "TMPDIR": str(tmp_path),
    }
    assert _stop_bootstrap_at(unpacking, env) == (
        143,
        "[dskit-sagemaker] SIGTERM before the entry started: stopped\n",
    )  # and the entry never ran


def _bootstrap_with_entry(tmp_path: Path, entry_source: str) -> dict[str, str]:
    """An empty source tarball and a `python3` on PATH that runs entry_source (the kit's entry stands in)."""
    code = tmp_path / "ml" / "input" / "data" / "code"
    code.mkdir(parents=True)
    with tarfile.open(code / sagemaker.SOURCE_ARCHIVE, "w:gz"):
        pass
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text(f"#!{sys.executable}\n{entry_source}")
    (fake_bin / "python3").chmod(0o755)
    return {
        "PATH": f"{fake_bin}:/usr/bin:/bin",
        "DSKIT_SM_BASE": str(tmp_path / "ml"),
        "TMPDIR": str(tmp_path),
    }


def test_the_bootstrap_ends_with_the_entrys_exit_status(tmp_path: Path) -> None:
    env = _bootstrap_with_entry(tmp_path, "import sys; print('entry ran'); sys.exit(7)\n")
    proc = subprocess.run(
        ["bash", "-c", sagemaker.BOOTSTRAP], env=env, capture_output=True, text=True, timeout=30
    )
    assert (proc.returncode, proc.stdout) == (7, "entry ran\n"), proc.stderr


def test_a_stop_before_the_entry_handles_sigterm_waits_for_its_handler(tmp_path: Path) -> None:
    """The entry needs a moment to install its handler: a SIGTERM in that moment would kill it (or, the entry as
    PID 1, be dropped). The bootstrap shell holds it and hands it on once the entry handles SIGTERM."""
    started = tmp_path / "started"
    env = _bootstrap_with_entry(
        tmp_path,
        f"""import pathlib, signal, sys, time
pathlib.Path({str(started)!r}).touch()
time.sleep(1.0)  # the moment before the handler
signal.signal(signal.SIGTERM, lambda *_: (print("entry: stopped", flush=True), sys.exit(143)))
time.sleep(30)
print("entry: finished")
""",
    )
    assert _stop_bootstrap_at(started, env) == (143, "entry: stopped\n")


def test_values_defaults_are_a_p5_on_demand_job() -> None:
    values = SageMakerValues(
        role=ROLE, s3_prefix="s3://bkt/p", channels={"model": "s3://bkt/m/", "train": "s3://bkt/t/"}
    )
    assert (values.instance_type, values.instance_count, values.spot, values.wait_s()) == (
        "ml.p5.48xlarge", 1, False, None,
    )  # fmt: skip
    assert values.efa and values.gpus_per_instance == 8
    spot = SageMakerValues(**{**values.__dict__, "spot": True, "max_runtime_s": 3600})
    assert spot.wait_s() == 7200


def test_the_readmes_values_files_dry_run_on_a_machine_without_aws_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values files README.md shows, written as a user copies them, with the README's own dry-run flags:
    no AWS region, credentials or network needed, and the line says what a dry run does not check."""
    import re

    readme = (Path(__file__).resolve().parents[4] / "README.md").read_text()
    files = re.findall(r"```yaml\n(# (sm-[\w-]+\.yaml)\n.*?)```", readme, re.S)
    assert [name for _, name in files] == ["sm-p5.yaml", "sm-spot.yaml"]
    for var in (
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
        "AWS_PROFILE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    for body, name in files:
        (tmp_path / name).write_text(body)
        status, out, err = submit(
            capsys, "--values", str(tmp_path / name), "--dry_run", "--max_steps", "20000"
        )
        assert status == 0, (name, err)
        assert json.loads(out[: out.rindex("}") + 1])["HyperParameters"] == {"max_steps": "20000"}
        assert "not checked are the buckets and the channels" in out, out[-500:]


def test_the_input_mode_goes_to_every_data_channel_and_the_code_stays_a_file() -> None:
    values = SageMakerValues(
        role=ROLE,
        s3_prefix="s3://bkt/p",
        channels={"model": "s3://bkt/m/", "train": "s3://bkt/t/"},
        input_mode="FastFile",
    )
    request = sagemaker.build_request(values, "dskit-1", "us-east-1", {})
    modes = {c["ChannelName"]: c["InputMode"] for c in request["InputDataConfig"]}
    assert modes == {sagemaker.CODE_CHANNEL: "File", "model": "FastFile", "train": "FastFile"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"role: {ROLE}\ninstance_count: 1\ninstance_count: 4\n", r"sm\.yaml:3: key 'instance_count' is given twice"),
        (f"role: {ROLE}\nmax_runtime_s: .inf\n", r"sm\.yaml:2: '\.inf' is not a finite number"),
        ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
        ), r"sm\.yaml:5: its aliases expand to more than 100,000 values"),
    ],
)  # fmt: skip
def test_the_values_file_is_read_as_strictly_as_a_run_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "sm.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(str(path))
    path.write_bytes(b"role: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"sm\.yaml:1: values file is not UTF-8 text"):
        load(str(path))
