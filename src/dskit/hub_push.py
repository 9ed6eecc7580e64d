"""An exported model dir to the Hugging Face hub (`dskit export ... --push_to_hub REPO`, and the opt-in push at
the end of training, `--push_to_hub` there): the repo created if missing (private if asked), a branch made for
`--revision`, one commit of every file with a model card (README.md) that states the base model, the data, the
chat template it was trained with (which its tokenizer carries), the steps, the tokens and the final losses, read
from the exported checkpoint's own records.

The client is huggingface_hub's (HF_ENDPOINT and HF_TOKEN as everywhere); the tests point it at a loopback
stand-in hub (tests/support/hub_server.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from model_utils.errors import ConfigError, first_line

CARD = "README.md"


def model_card(launch: dict[str, Any] | None, facts: dict[str, Any], repo: str) -> str:
    """The card's YAML header (base_model, library, tags) and what the run was, as far as its records say."""
    config = (launch or {}).get("config") or {}
    model, data = config.get("model") or {}, config.get("data") or {}
    base = model.get("model")
    header = ["---", "library_name: transformers", "tags:", "- dskit"]
    if base and "/" in str(base) and not str(base).startswith(("/", ".")):  # a hub id, not a local path
        header.append(f"base_model: {base}")
    header.append("---")
    lora_r = (config.get("lora") or {}).get("lora_r")
    rows = [
        ("base model", base),
        ("data", data.get("dataset")),
        ("chat template", _chat_template(launch or {}, data)),
        ("optimizer steps", facts.get("step")),
        ("tokens trained", f"{facts['tokens']:,}" if facts.get("tokens") else None),
        ("last training loss (rank 0's share of its step)", _loss(facts.get("loss"))),
        ("final validation loss", _loss(facts.get("val_loss"))),
        ("LoRA", f"r={lora_r}, merged into the weights" if lora_r else None),
    ]
    table = [f"| {name} | {value} |" for name, value in rows if value not in (None, "")]
    return "\n".join(
        [
            *header,
            "",
            f"# {repo.split('/')[-1]}",
            "",
            "Trained with dskit.",
            "",
            "| | |",
            "|---|---|",
            *table,
            "",
        ]
    )


def _chat_template(launch: dict[str, Any], data: dict[str, Any]) -> str | None:
    """Which chat template the run trained with (launch.json records it: checkpoint/protocol.py), if any."""
    from model_utils.checkpoint import launch_record

    if launch.get(launch_record.CHAT_TEMPLATE) is None:
        return None
    given = data.get("chat_template")
    carried = "carried in the tokenizer: `tokenizer.apply_chat_template` prompts the model as it was trained"
    return f"`--chat_template {given}`, {carried}" if given else carried


def _loss(value: Any) -> str | None:
    return None if value is None else f"{float(value):.4f}"


def push(
    model_dir: Path,
    repo: str,
    *,
    card: str,
    private: bool = False,
    revision: str | None = None,
    message: str = "Upload model trained with dskit",
) -> str:
    """Create the repo (and branch) if missing and commit every file of model_dir plus the card; returns the
    commit's URL. Errors are ConfigErrors of one line."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != CARD)
    if not files:
        raise ConfigError(f"{model_dir} has no files to push: export the model there first")
    operations = [CommitOperationAdd(p.relative_to(model_dir).as_posix(), str(p)) for p in files]
    operations.append(CommitOperationAdd(CARD, card.encode()))
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo, branch=revision, exist_ok=True)
        info = api.create_commit(repo, operations=operations, commit_message=message, revision=revision)
    except HfHubHTTPError as e:
        raise ConfigError(
            f"pushing {model_dir} to the hub repo {repo} failed: {first_line(e)}: check HF_TOKEN (a write token) "
            "and the repo name"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"pushing {model_dir} to the hub repo {repo} failed: {first_line(e)}") from None
    return str(info.commit_url)


def card_for_checkpoint(tag_dir: Path, repo: str) -> str:
    """The card of an export of `tag_dir`: its launch.json, and the run's ledger beside it (tokens, losses)."""
    from dskit import cost
    from model_utils.checkpoint import launch_record, protocol
    from model_utils.observe.ledger_file import LEDGER

    step = protocol.tag_step(tag_dir.name)
    facts: dict[str, Any] = {"step": step}
    ledger = tag_dir.parent / LEDGER
    if step is not None and ledger.is_file():
        records = cost.read(ledger)
        per_step = next((r.get("tokens_per_step") for r in reversed(records) if r["event"] == "start"), None)
        facts["tokens"] = per_step * step if per_step else None
        # The last values logged at or before the exported step (a later attempt may have gone further).
        for record in records:
            if (
                record["event"] == "steps"
                and record.get("last")
                and record["last"] <= step
                and "loss" in record
            ):
                facts["loss"] = record["loss"]
            if record["event"] == "validation" and record["step"] <= step:
                facts["val_loss"] = record.get("loss")
    return model_card(launch_record.read(tag_dir), facts, repo)
