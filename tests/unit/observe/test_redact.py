"""The one redaction (observe/redact.py): which names are secret, credentials in URIs, in free text and in
command lines, and the trees (configs, environments, requests) that printers and recorders pass through it. Each
place that uses it has its own test: the sagemaker dry run, `dskit config`, rank-0 log lines and the error file,
launch.json, the trackers' params and the SageMaker failure file."""

from __future__ import annotations

import pytest

from model_utils.observe import redact


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN", "hf_token", "WANDB_API_KEY", "api_key", "apiKey", "GITHUB_PAT", "HF_AUTH", "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD", "DB_PASSWD", "X-Amz-Signature",
        "X-Amz-Credential", "X-Amz-Security-Token", "sig", "token", "GOOGLE_APPLICATION_CREDENTIALS", "PRIVATE_PEM",
    ],
)  # fmt: skip
def test_secret_names(name: str) -> None:
    assert redact.is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "tokenizer", "KEY_COLUMN", "max_tokens", "PATH", "PWD", "TOKENIZERS_PARALLELISM", "SSH_AUTH_SOCK",
        "sort_keys", "tracking_uri", "monkey", "KEYBOARD", "PATTERN", "tokens_per_step",
    ],
)  # fmt: skip
def test_harmless_names_stay_readable(name: str) -> None:
    assert not redact.is_secret_name(name)


def test_every_config_key_of_the_trainer_stays_readable() -> None:
    from model_utils.config.arguments import parse_args

    def keys(tree: dict, prefix: str = "") -> list[str]:
        out = []
        for k, v in tree.items():
            out += [prefix + k] + (keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [])
        return out

    config = parse_args(["--model", "m", "--dataset", "d"]).to_dict()
    assert [k for k in keys(config) if redact.is_secret_name(k.rsplit(".", 1)[-1])] == []


def test_uris_lose_their_credentials_and_keep_the_server() -> None:
    assert redact.uri("https://admin:pw@mlflow.example:5000/x") == "https://mlflow.example:5000/x"
    assert redact.uri("https://ghp_token@github.com/o/r.git") == "https://github.com/o/r.git"
    assert redact.uri("sqlite:////abs/mlflow.db") == "sqlite:////abs/mlflow.db"
    signed = "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abc&X-Amz-Expires=60"
    assert redact.uri(signed) == (
        "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"
    )
    assert redact.uri("https://acct.blob.core.windows.net/c?sv=2020&sig=s3cr3t") == (
        "https://acct.blob.core.windows.net/c?sv=2020&sig=***"
    )
    assert redact.uri("http://h/?token=abc&page=2") == "http://h/?token=***&page=2"
    assert redact.uri("s3://bucket/prefix/") == "s3://bucket/prefix/"


def test_free_text_and_command_lines() -> None:
    line = (
        "MLFLOW_TRACKING_URI=https://admin:pw@h.example/ --tracking_uri https://bob:pw2@h2 --hf_token=hf_abc "
        "--wandb_api_key wk_1 --lr 1e-4 GITHUB_PAT=ghp_x --tokenizer t/x KEY_COLUMN=text"
    )
    assert redact.text(line) == (
        "MLFLOW_TRACKING_URI=https://h.example/ --tracking_uri https://h2 --hf_token=*** --wandb_api_key *** "
        "--lr 1e-4 GITHUB_PAT=*** --tokenizer t/x KEY_COLUMN=text"
    )
    argv = [
        "--hf_token",
        "hf_abc",
        "--lr",
        "1",
        "--tracking_uri",
        "https://b:p@h",
        "--api_key=z",
        "--tokenizer",
        "t",
    ]
    assert redact.arguments(argv) == [
        "--hf_token", "***", "--lr", "1", "--tracking_uri", "https://h", "--api_key=***", "--tokenizer", "t",
    ]  # fmt: skip


def test_trees_mask_secret_keys_and_uris_at_any_depth() -> None:
    env = {"HF_TOKEN": "hf_x", "HF_AUTH": "a", "GH_PAT": "p", "MLFLOW_TRACKING_URI": "https://u:p@h/", "N": 3}
    config = {
        "report": {"tracking_uri": "https://u:p@h/x", "run_name": "r"},
        "data": {"tokenizer": "t"},
        "env": env,
    }
    assert redact.tree(config) == {
        "report": {"tracking_uri": "https://h/x", "run_name": "r"},
        "data": {"tokenizer": "t"},
        "env": {
            "HF_TOKEN": "***",
            "HF_AUTH": "***",
            "GH_PAT": "***",
            "MLFLOW_TRACKING_URI": "https://h/",
            "N": 3,
        },
    }
    assert config["env"]["HF_TOKEN"] == "hf_x"  # a copy: the caller's tree is unchanged
    assert redact.tree({"hf_token": None, "api_key": ""}) == {
        "hf_token": None,
        "api_key": "",
    }  # nothing to hide


def test_arns_keep_the_last_four_digits_of_the_account() -> None:
    assert redact.arn("arn:aws:iam::123456789012:role/X") == "arn:aws:iam::****9012:role/X"
    assert redact.arn("arn:aws:sagemaker:us-east-1:123456789012:training-job/j") == (
        "arn:aws:sagemaker:us-east-1:****9012:training-job/j"
    )
