"""LoRA (--lora_r) end to end: real 2-rank runs on a "pretrained" tiny Qwen3 (saved locally, no hub), resumed
exactly, and `dskit export` of the result (merged, and the adapter alone) reproducing the trained engine.

Per ZeRO stage (module-scoped): an uninterrupted run of STEPS steps, a second run resumed from its STEPS/2
checkpoint, and one run of tests/support/engine_logits.py on the resumed run's last tag (ranks of the rank pool,
tests/support/rank_pool.py). ZeRO-3 runs through
the shipped configs/zero3-offload.yaml (optimizer and parameters offloaded to the CPU,
stage3_param_persistence_threshold 0 so the tiny model's parameters really are partitioned) with activation
checkpointing on. FSDP (--backend fsdp) runs with activation checkpointing too.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dskit import cli
from dskit.export import export
from model_utils.config.presets import PRESETS
from support.metrics_file import step_records
from support.pretrained import save_tiny_qwen3
from support.rank_pool import train

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {
    "zero2": ["--deepspeed_config", "deepspeed/ds_config.json"],
    "zero3-offload": ["--config", str(REPO / "configs" / "zero3-offload.yaml"), "--activation_checkpointing", "full"],
    # FSDP2: peft before sharding, the frozen base sharded with the adapters, activation checkpointing on.
    "fsdp": ["--deepspeed_config", "deepspeed/fsdp.json", "--backend", "fsdp", "--activation_checkpointing", "full"],
}  # fmt: skip
STEPS = 6
# A high lr so that six steps move the adapters far from their zero-initialised B (the logits checks need a
# trained adapter to tell merged from base).
LORA = ["--lora_r", "4", "--lora_alpha", "8", "--lr", "2e-2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("lora-base") / "base")


def losses(path: Path) -> dict[int, float]:
    return {step: r["loss"] for step, r in step_records(path).items()}


@dataclass(frozen=True)
class Trained:
    stage: str
    base: Path
    straight_log: str
    straight: dict[int, float]
    resumed: dict[int, float]
    checkpoint_dir: Path  # the resumed run's
    tag: str
    reference: dict[str, torch.Tensor]  # the engine's {"input_ids", "logits"} at `tag`


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trained(request: pytest.FixtureRequest, base: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    stage = request.param
    work = tmp_path_factory.mktemp(f"lora-{stage}")

    def run(ckpt: Path, name: str) -> str:
        return train(
            [
                *CONFIGS[stage], "--model", str(base), *LORA, "--max_steps", str(STEPS),
                "--checkpoint_freq", str(STEPS // 2), "--logging_freq", "1", "--seq_length", "64",
                "--validation_fraction", "0", "--checkpoint_dir", str(ckpt), "--data_cache_dir", str(work / "cache"),
                "--metrics_file", str(work / f"{name}.jsonl"),
            ],
            cwd=work,
            timeout=900,
        )  # fmt: skip

    straight_log = run(work / "straight", "straight")
    # "Stopped" after the first half: a checkpoint dir holding only that checkpoint, trained again to the end.
    half = f"base-{STEPS // 2}steps"
    shutil.copytree(work / "straight" / half, work / "resumed" / half)
    (work / "resumed" / "latest").write_text(half)
    assert f"Resumed from {work / 'resumed' / half}" in run(work / "resumed", "resumed")
    tag = f"base-{STEPS}steps"
    config = CONFIGS[stage][1] if CONFIGS[stage][0] == "--config" else str(REPO / CONFIGS[stage][1])
    train(
        [
            str(work / "resumed"),
            tag,
            config,
            str(work / "engine.pt"),
            "--model",
            str(base),
            *LORA,
            *CONFIGS[stage][2:],
        ],
        script=REPO / "tests" / "support" / "engine_logits.py",
        timeout=900,
    )
    return Trained(
        stage,
        base,
        straight_log,
        losses(work / "straight.jsonl"),
        losses(work / "resumed.jsonl"),
        work / "resumed",
        tag,
        torch.load(work / "engine.pt"),
    )


def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def base_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def test_only_the_adapters_train_and_a_resume_continues_exactly(trained: Trained) -> None:
    # 4 targets x 2 layers x (A: r x in + B: out x r); q/o: 64 -> 64, k/v: 64 -> 32 (2 kv heads x 16).
    adapters = 2 * 4 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64)
    assert adapters == 3584
    assert "LoRA r=4 alpha=8 on q_proj,k_proj,v_proj,o_proj: 3.58K of 233K parameters train (1.5%)" in (
        trained.straight_log
    )
    # The optimizer's groups, counted before DeepSpeed partitions anything: the adapters' matrices, nothing frozen.
    assert (
        "Weight decay 0.1 on 16 tensors (3,584 parameters), none on 0 (0; norms, biases)"
        in trained.straight_log
    )
    assert sorted(trained.straight) == list(range(1, STEPS + 1))
    assert sorted(trained.resumed) == list(range(STEPS // 2 + 1, STEPS + 1))
    for step, loss in trained.resumed.items():
        assert abs(loss - trained.straight[step]) < 1e-4, (step, loss, trained.straight[step])


def tolerance(reference: torch.Tensor) -> float:
    """Four bf16 ulps at the largest reference logit.

    The engine computes base(x) + B(A(x)) alpha/r in bf16; the merged export has W + B A alpha/r rounded to bf16
    once, and PeftModel on the bf16 base runs the adapter in fp32 (peft's autocast of adapter weights): neither
    is the engine's arithmetic bit for bit. The untrained base is checked to be far outside this tolerance.
    """
    return 4 * 2.0 ** (torch.floor(torch.log2(reference.abs().max())).item() - 7)


def test_merged_export_reproduces_the_trained_engine(trained: Trained, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = export(trained.checkpoint_dir, tmp_path / "merged")
    keys = load_file(out / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in keys), sorted(keys)[:5]
    ref = trained.reference
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    diff = (logits(merged, ref["input_ids"]) - ref["logits"]).abs().max().item()
    assert diff <= tolerance(ref["logits"]), diff
    # The adapters matter: the base alone is far off, so the tolerance cannot hide a missing merge.
    untrained = (logits(base_model(trained.base), ref["input_ids"]) - ref["logits"]).abs().max().item()
    assert untrained > 10 * tolerance(ref["logits"]), (untrained, diff)


def test_adapter_export_on_the_base_reproduces_the_trained_engine(trained: Trained, tmp_path: Path) -> None:
    from peft import PeftModel

    assert (
        cli.main(
            ["export", str(trained.checkpoint_dir / trained.tag), str(tmp_path / "adapter"), "--adapter_only"]
        )
        == 0
    )
    out = tmp_path / "adapter"
    adapter = load_file(out / "adapter_model.safetensors")
    # Whole tensors, not ZeRO-3 partitions: every A is r x in, every B out x r.
    assert len(adapter) == 16 and all(t.numel() > 0 and 4 in t.shape for t in adapter.values()), {
        k: tuple(t.shape) for k, t in adapter.items()
    }
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        trained.base
    )
    ref = trained.reference
    model = PeftModel.from_pretrained(base_model(trained.base), out)
    diff = (logits(model, ref["input_ids"]) - ref["logits"]).abs().max().item()
    assert diff <= tolerance(ref["logits"]), diff


def test_a_partitioned_tensor_is_refused_before_anything_is_written(base: Path, tmp_path: Path) -> None:
    """What a plain save_pretrained of a live ZeRO-3 PeftModel writes (0-element adapters) is never exported."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from dskit.export import _check_complete
    from model_utils.config.arguments import LoraArgs
    from model_utils.errors import ConfigError
    from model_utils.model import lora

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora.peft_config(LoraArgs(lora_r=4)))
    state = dict(model.state_dict())
    _check_complete(model, state, tmp_path)  # whole tensors pass
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.default.weight"
    state[name] = torch.empty(0)
    with pytest.raises(ConfigError, match=rf"holds {name} with 0 of its 256 elements"):
        _check_complete(model, state, tmp_path)


def test_adapter_only_of_a_run_without_lora_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from model_utils.storage import file_manifest

    tag = tmp_path / "ck" / "tiny_qwen3-3steps"
    (tag / "hf_config").mkdir(parents=True)
    PRESETS["tiny-qwen3"].build_config().save_pretrained(tag / "hf_config")
    (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tag / "launch.json").write_text(json.dumps({"config": {"lora": {"lora_r": None}}}))
    file_manifest.write(tag, file_manifest.build(tag, {"tag": tag.name, "step": 3}))
    assert cli.main(["export", str(tag), str(tmp_path / "out"), "--adapter_only"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and "trained without LoRA (--lora_r)" in err
        and "drop --adapter_only" in err
    )
    assert not (tmp_path / "out").exists()
