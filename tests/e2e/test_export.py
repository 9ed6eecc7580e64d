"""`dskit export`: real ZeRO-2, ZeRO-3 and FSDP (DCP) checkpoints -> Hugging Face dirs that reproduce the trained
engine.

Per ZeRO stage and for FSDP (module-scoped) a 2-rank run trained, stopped and resumed: for ZeRO-2 and FSDP the
session's reference run and its resumed twin (tests/support/reference_runs.py), for ZeRO-3 one of its own; plus
one run of tests/support/engine_logits.py that loads the resumed run's last tag into an engine and records its
logits on a fixed batch. The ranks are the rank pool's (tests/support/rank_pool.py). The bad-input cases use
small fake checkpoint dirs and need no training.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dskit import cli
from dskit.export import export
from model_utils.storage import file_manifest
from support import reference_runs
from support.hub_server import HubStandIn
from support.rank_pool import train
from support.reference_runs import Reference

REPO = Path(__file__).resolve().parents[2]
# ZeRO-3 through the shipped run file: optimizer and parameters offloaded to the CPU, the DeepSpeed config embedded.
# FSDP (--backend fsdp): its own default config; the tag holds DCP shards.
CONFIGS = {
    "zero2": "deepspeed/ds_config.json",
    "zero3-offload": str(REPO / "configs" / "zero3-offload.yaml"),
    "fsdp": "deepspeed/fsdp.json",
}
STEPS = 6
# Stages whose run is the session's reference run of that engine (the kit's default config of each).
REFERENCES = {"zero2": "deepspeed_reference", "fsdp": "fsdp_reference"}


def config_flag(path: str) -> list[str]:
    backend = ["--backend", "fsdp"] if path.endswith("fsdp.json") else []
    return ["--config" if path.endswith(".yaml") else "--deepspeed_config", path, *backend]


def logits_tolerance(reference: torch.Tensor) -> float:
    """One bf16 ulp at the largest reference logit.

    The exported bf16 weights are bit-identical to the engine's (both are the fp32 masters rounded to nearest)
    and the forward is the same module code in bf16 on CPU, so the logits should match exactly (they do: max
    diff 0.0 for ZeRO-2 and ZeRO-3 when this was written). One ulp allows a different reduction order in the
    bf16 GEMMs (the ranks run with OMP_NUM_THREADS=1, this process with more threads). The half-way
    checkpoint (3 or 4 steps earlier) is tens of ulps away (~70 at 3 steps when this was written);
    test_export_of_a_tag_dir_and_through_the_cli checks that margin, so a wrong tag, wrong dtype path or broken
    tie cannot hide inside the tolerance.
    """
    return 2.0 ** (math.floor(math.log2(reference.abs().max().item())) - 7)


@dataclass(frozen=True)
class Trained:
    stage: str
    checkpoint_dir: Path
    tag: str
    earlier: str  # the tag the run was resumed from, half-way
    reference: dict[str, torch.Tensor]  # the engine's {"input_ids", "logits"} at `tag`


def train_stopped_and_resumed(stage: str, work: Path) -> tuple[Path, str]:
    """ZeRO-3: STEPS // 2 steps, then resumed to STEPS in the same checkpoint dir. Its dir, the resumed log."""
    ckpt = work / "ck"
    for steps in (STEPS // 2, STEPS):  # trained, stopped, resumed: the export is of the resumed run
        log = train(
            [
                *config_flag(CONFIGS[stage]), "--max_steps", str(steps), "--checkpoint_freq", "3",
                "--logging_freq", "1", "--seq_length", "64", "--validation_fraction", "0",
                "--checkpoint_dir", str(ckpt), "--data_cache_dir", str(work / "cache"),
            ],
            cwd=work,
            timeout=900,
        )  # fmt: skip
    return ckpt, log


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    stage = request.param
    work = tmp_path_factory.mktemp(f"export-{stage}")
    if stage in REFERENCES:  # the reference run's twin: resumed at step 4, trained to 8 (read only here)
        reference: Reference = request.getfixturevalue(REFERENCES[stage])
        ckpt, log, steps = reference.twin, reference.twin_log, reference_runs.STEPS
    else:
        (ckpt, log), steps = train_stopped_and_resumed(stage, work), STEPS
    earlier = f"tiny_qwen3-{steps // 2}steps"
    assert f"Resumed from {ckpt / earlier}" in log, log[-3000:]
    tag = (ckpt / "latest").read_text().strip()
    assert tag == f"tiny_qwen3-{steps}steps"
    train(
        [str(ckpt), tag, CONFIGS[stage], str(work / "engine.pt"), *config_flag(CONFIGS[stage])[2:]],
        script=REPO / "tests" / "support" / "engine_logits.py",
        timeout=900,
    )
    return Trained(stage, ckpt, tag, earlier, torch.load(work / "engine.pt"))


@pytest.fixture(scope="module")
def exported(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp(f"exported-{trained.stage}")
    return {dtype: export(trained.checkpoint_dir, out / dtype, dtype) for dtype in ("bf16", "fp32")}


def load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors
    return model.eval()


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_export_loads_with_every_key_in_the_requested_dtype(exported: dict[str, Path], dtype: str) -> None:
    from transformers import AutoTokenizer

    model = load(exported[dtype])
    assert model.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    assert {p.dtype for p in model.parameters()} == {model.dtype}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie holds
    assert json.loads((exported[dtype] / "config.json").read_text())["tie_word_embeddings"] is True
    assert sorted(p.name for p in exported[dtype].iterdir() if p.suffix == ".safetensors") == [
        "model.safetensors"
    ]
    modes = {p.name: p.stat().st_mode & 0o777 for p in exported[dtype].iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as the rest (not mkstemp's 0600)
    tokenizer = AutoTokenizer.from_pretrained(exported[dtype])
    assert tokenizer("the sky was blue")["input_ids"]
    assert tokenizer.eos_token == "<|endoftext|>"


@pytest.mark.e2e
def test_bf16_export_reproduces_the_trained_engines_logits(
    trained: Trained, exported: dict[str, Path]
) -> None:
    model = load(exported["bf16"])
    with torch.no_grad():
        logits = model(input_ids=trained.reference["input_ids"]).logits.float()
    expected = trained.reference["logits"]
    assert logits.shape == expected.shape
    diff = (logits - expected).abs().max().item()
    assert diff <= logits_tolerance(expected), f"{trained.stage}: max |logit diff| {diff}"


@pytest.mark.e2e
def test_fp32_export_is_the_master_weights_the_bf16_export_rounds(exported: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    fp32 = load_file(exported["fp32"] / "model.safetensors")
    bf16 = load_file(exported["bf16"] / "model.safetensors")
    assert fp32.keys() == bf16.keys()
    for name in fp32:
        assert fp32[name].dtype == torch.float32 and bf16[name].dtype == torch.bfloat16
        assert torch.equal(fp32[name].to(torch.bfloat16), bf16[name]), name
    # The masters carry more than bf16 precision: a real fp32 copy, not bf16 weights widened.
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in fp32.values())


@pytest.mark.e2e
def test_export_of_a_tag_dir_and_through_the_cli(
    trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    earlier = trained.checkpoint_dir / trained.earlier
    assert cli.main(["export", str(earlier), str(tmp_path / "m3")]) == 0
    assert "exported" in capsys.readouterr().out
    # The tag, not `latest`, was exported: its logits are the half-way model's, many tolerances away from the
    # last tag's.
    with torch.no_grad():
        logits = load(tmp_path / "m3")(input_ids=trained.reference["input_ids"]).logits.float()
    expected = trained.reference["logits"]
    assert (logits - expected).abs().max().item() > 10 * logits_tolerance(expected)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind


@pytest.mark.e2e
def test_export_pushes_the_model_and_its_card_to_the_hub(
    deepspeed_reference: Reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`dskit export CKPT OUT --push_to_hub REPO --private --revision v1` against a loopback stand-in hub: the repo
    is made private, the branch made, and what the real client downloads from it loads as the exported model."""
    from huggingface_hub import snapshot_download

    ckpt = deepspeed_reference.twin  # resumed at step 4, trained to 8: its ledger has both attempts
    with HubStandIn() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        out = tmp_path / "model"
        args = [
            "export",
            str(ckpt),
            str(out),
            "--push_to_hub",
            "me/tiny-run",
            "--private",
            "--revision",
            "v1",
        ]
        assert cli.main(args) == 0
        said = capsys.readouterr().out
        assert f"pushed {out} to me/tiny-run (v1): {hub.url}/me/tiny-run/commit/" in said
        assert hub.private == {"me/tiny-run": True} and set(hub.repos["me/tiny-run"]) == {"main", "v1"}
        got = Path(
            snapshot_download("me/tiny-run", revision="v1", cache_dir=tmp_path / "hf-cache", endpoint=hub.url)
        )
    assert sorted(p.name for p in got.iterdir()) == sorted(
        [*(p.name for p in out.iterdir()), "README.md", ".gitattributes"]
    )
    for name in (p.name for p in out.iterdir()):
        assert (got / name).read_bytes() == (out / name).read_bytes(), name
    load(got)  # loads, every key present
    card = (got / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and hub.cards[-1]["tags"] == ["dskit"]
    assert "| optimizer steps | 8 |" in card and "| tokens trained | " in card
    ledger = [json.loads(line) for line in (ckpt / "dskit-ledger.jsonl").read_text().splitlines()]
    last_loss = [r["loss"] for r in ledger if r["event"] == "steps" and r.get("last") and r["last"] <= 8][-1]
    assert f"| last training loss (rank 0's share of its step) | {last_loss:.4f} |" in card


@pytest.mark.e2e
def test_a_refused_push_is_one_line_and_the_export_stays(
    deepspeed_reference: Reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    with HubStandIn() as hub:
        hub.fail_pushes_with = 403
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        out = tmp_path / "model"
        assert cli.main(["export", str(deepspeed_reference.twin), str(out), "--push_to_hub", "me/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: pushing ") and "check HF_TOKEN" in err[0], err
    assert (out / "config.json").is_file()  # the export itself is kept: push it again by hand


# --- bad input: one line, exit 2, nothing written -------------------------------------------------------


def fake_tag(root: Path, *, hf_config: bool = True, optim: bool = True) -> Path:
    """A tag dir with the layout export checks before reading any weights (empty shard files, real manifest)."""
    tag = root / "tiny_qwen3-3steps"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    if optim:
        (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    if hf_config:
        (tag / "hf_config").mkdir()
        (tag / "hf_config" / "config.json").write_text("{}")
    file_manifest.write(tag, file_manifest.build(tag, {}))
    (root / "latest").write_text(tag.name)
    return tag


def snapshot(path: Path) -> dict[str, bytes] | None:
    if not path.exists():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def expect_error(capsys: pytest.CaptureFixture[str], args: list[str], out_dir: Path, *needles: str) -> None:
    before = snapshot(out_dir)
    siblings = sorted(out_dir.parent.iterdir()) if out_dir.parent.exists() else []
    assert cli.main(["export", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert snapshot(out_dir) == before
    assert (sorted(out_dir.parent.iterdir()) if out_dir.parent.exists() else []) == siblings


def test_missing_checkpoint_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    expect_error(capsys, [str(tmp_path / "nope"), str(out)], out, "does not exist", "pass a checkpoint dir")


def test_dir_with_no_verified_checkpoint_that_is_not_a_tag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("hi")
    out = tmp_path / "out"
    expect_error(
        capsys,
        [str(tmp_path / "ck"), str(out)],
        out,
        "holds no verified checkpoint",
        "not a checkpoint tag dir",
    )


def test_a_checkpoint_dir_exports_what_resume_would_pick_not_latest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newest tag whose manifest verifies, as checkpoint.select_resume picks it; `latest` naming a
    missing or a damaged newer tag is reported and ignored."""
    from dskit.export import resolve_tag
    from model_utils.checkpoint.protocol import select_resume

    root = tmp_path / "ck"
    good = fake_tag(root)
    damaged = root / "tiny_qwen3-6steps"
    damaged.mkdir()
    (damaged / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    file_manifest.write(damaged, file_manifest.build(damaged, {}))
    (damaged / "mp_rank_00_model_states.pt").write_bytes(b"y" * 10)  # same size, another checksum
    (root / "latest").write_text(damaged.name)
    assert resolve_tag(root) == (root, good.name)
    assert select_resume(str(root), None).tag == good.name  # the same choice
    printed = capsys.readouterr().out
    assert f"skipping checkpoint {damaged}" in printed and "ignoring it" in printed
    (root / "latest").write_text("tiny_qwen3-9steps")
    assert resolve_tag(root) == (root, good.name)


def test_tag_without_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tag = fake_tag(tmp_path / "ck", hf_config=False)
    out = tmp_path / "out"
    for checkpoint in (tmp_path / "ck", tag):
        expect_error(capsys, [str(checkpoint), str(out)], out, "no hf_config/config.json", "copy the model's")


def test_tag_without_optimizer_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_tag(tmp_path / "ck", optim=False)
    out = tmp_path / "out"
    expect_error(capsys, [str(tmp_path / "ck"), str(out)], out, "no *optim_states.pt")


def test_damaged_tag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tag = fake_tag(tmp_path / "ck")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"torn")
    out = tmp_path / "out"
    expect_error(capsys, [str(tag), str(out)], out, "incomplete or damaged", "older tag")
    # Given the checkpoint dir, the damaged tag is skipped as resume skips it, and nothing else verifies.
    assert cli.main(["export", str(tmp_path / "ck"), str(out)]) == 2
    captured = capsys.readouterr()
    assert f"skipping checkpoint {tag}" in captured.out
    assert "holds no verified checkpoint" in captured.err and not out.exists()


@pytest.mark.parametrize("existing", ["dir", "file"])
def test_non_empty_out_dir_is_refused_and_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], existing: str
) -> None:
    fake_tag(tmp_path / "ck")
    out = tmp_path / "out"
    if existing == "dir":
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"the user's own file")
    else:
        out.write_text("a file, not a dir")
    expect_error(capsys, [str(tmp_path / "ck"), str(out)], out, "already exists and is not empty")
    assert out.exists()


def test_unknown_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_tag(tmp_path / "ck")
    out = tmp_path / "out"
    expect_error(capsys, [str(tmp_path / "ck"), str(out), "--dtype", "fp16"], out, "--dtype", "bf16")
    with pytest.raises(ValueError, match="unknown dtype 'fp16': use one of bf16, fp32"):
        export(tmp_path / "ck", out, "fp16")
    assert not out.exists()


@pytest.mark.parametrize("args", [[], ["only-one"], ["a", "b", "--dtyp", "bf16"], ["a", "b", "c"]])
def test_bad_command_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    expect_error(capsys, args, tmp_path / "out", "dskit export --help")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--private"], "the hub flags (--revision, --private) need --push_to_hub REPO"),
        (["--revision", "v1"], "the hub flags (--revision, --private) need --push_to_hub REPO"),
        (["--push_to_hub", "no-namespace"], "--push_to_hub 'no-namespace' is not a hub repo: give user/name"),
    ],
)
def test_bad_hub_flags_fail_before_the_export(tmp_path: Path, capsys, flags: list[str], needle: str) -> None:
    fake_tag(tmp_path / "ck")
    expect_error(capsys, [str(tmp_path / "ck"), str(tmp_path / "out"), *flags], tmp_path / "out", needle)
