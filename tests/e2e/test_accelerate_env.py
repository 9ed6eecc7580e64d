"""model_utils.config.accelerate_env against environments made by real `accelerate launch` runs.

Each accelerate config below is launched once (what `accelerate launch --config_file X dump_env.py` runs, on CPU:
accelerate's own parser, launch_command and launchers, one launch after the other in one process); the tiny
script dumps rank 0's environment as JSON, which is what a training rank would read. Nothing is
mocked: if accelerate renames a variable or stops passing a setting, these tests fail. (Out of the unit tier for
its launches; training through `accelerate launch`: test_accelerate_launch.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_utils.config import accelerate_env
from model_utils.config.accelerate_env import AccelerateRequest
from model_utils.config.arguments import parse_args
from model_utils.config.deepspeed_file import load_deepspeed_json
from model_utils.errors import ConfigError
from model_utils.resolve import resolver

REPO = Path(__file__).resolve().parents[2]
ZERO3 = str(REPO / "deepspeed" / "ds_config_zero3.json")
SHIPPED = REPO / "configs" / "accelerate" / "deepspeed-zero2.yaml"

pytestmark = pytest.mark.e2e

DUMP_ENV = """\
import json, os, sys
if os.environ.get("RANK", "0") == "0":
    with open(sys.argv[1], "w") as f:
        json.dump(dict(os.environ), f)
"""

COMMON = "compute_environment: LOCAL_MACHINE\nnum_machines: 1\nuse_cpu: false\n"
# name -> (accelerate config YAML, processes). One process where accelerate allows it: faster.
CONFIGS = {
    # the shipped one: DeepSpeed with the kit's deepspeed/ds_config.json (a path relative to the repo)
    "deepspeed_file": (SHIPPED.read_text(), 2),
    "deepspeed_stage": (
        "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n"
        "  offload_optimizer_device: cpu\n  offload_param_device: none\n  gradient_accumulation_steps: 4\n"
        "  gradient_clipping: 1.0\n  zero3_init_flag: false\n",
        1,
    ),
    "fsdp2": (
        "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: Qwen3DecoderLayer\n"
        "  fsdp_offload_params: true\n  fsdp_reshard_after_forward: true\n"
        "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_activation_checkpointing: true\n",
        1,
    ),
    "multi_gpu": (
        "distributed_type: MULTI_GPU\nmixed_precision: fp16\ndynamo_config:\n  dynamo_backend: INDUCTOR\n",
        2,
    ),
    "megatron": (
        "distributed_type: MEGATRON_LM\nmixed_precision: bf16\nmegatron_lm_config:\n"
        "  megatron_lm_tp_degree: 2\n  megatron_lm_pp_degree: 1\n",
        1,
    ),
    "plain": ("distributed_type: 'NO'\nmixed_precision: 'no'\n", 1),
    "fsdp1_grad_op": (
        "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 1\n"
        "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n",
        1,
    ),
    "deepspeed_file_and_stage": (
        f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {ZERO3}\n  zero_stage: 2\n",
        1,
    ),
}


@pytest.fixture(scope="module")
def envs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Rank 0's environment under each config: every launch through accelerate's own launch code, one after the
    other in one process (tests/support/accelerate_launches.py: accelerate and torch imported once)."""
    tmp = tmp_path_factory.mktemp("accelerate")
    script = tmp / "dump_env.py"
    script.write_text(DUMP_ENV)
    # No default config from the developer's ~/.cache/huggingface/accelerate, offline, on CPU.
    env = {**os.environ, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    launches = []
    for name, (yaml_text, nproc) in CONFIGS.items():
        if name != "deepspeed_file":
            yaml_text = COMMON + f"num_processes: {nproc}\n" + yaml_text
        (tmp / f"{name}.yaml").write_text(yaml_text)
        launches.append(f"{name}={tmp / f'{name}.yaml'}:{tmp / f'{name}.json'}")
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "accelerate_launches.py"), str(script), *launches],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in CONFIGS}


def one_line_error(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as e:
        accelerate_env.from_environment(env)
    text = str(e.value)
    assert "\n" not in text
    return text


def test_deepspeed_with_a_config_file(envs: dict[str, dict[str, str]]) -> None:
    """The shipped configs/accelerate/deepspeed-zero2.yaml: DeepSpeed with the kit's own ZeRO-2 file."""
    request = accelerate_env.from_environment(envs["deepspeed_file"])
    ds_file = "deepspeed/ds_config.json"
    assert request == AccelerateRequest("DEEPSPEED", "deepspeed", "no", deepspeed_config_file=ds_file)
    assert accelerate_env.flag_values(request) == {"backend": "deepspeed", "deepspeed_config": ds_file}
    # accelerate's default "no" leaves the file's precision (bf16): no constraint, nothing else to compare
    accelerate_env.check_deepspeed(request, load_deepspeed_json(ds_file), ds_file)
    # the same file named another way agrees; another file is a conflict
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert accelerate_env.check_against(request, {"deepspeed_config": str(REPO / ds_file)})
        with pytest.raises(ConfigError) as e:
            accelerate_env.check_against(request, {"deepspeed_config": ZERO3})
    finally:
        os.chdir(cwd)
    assert str(e.value) == (
        f"--deepspeed_config {ZERO3} disagrees with the accelerate config, which asks for {ds_file} "
        "(deepspeed_config_file): drop --deepspeed_config or change the accelerate config"
    )
    with pytest.raises(
        ConfigError, match=r"^--backend fsdp disagrees .* asks for deepspeed .distributed_type DEEP"
    ):
        accelerate_env.check_against(request, {"backend": "fsdp"})


def test_deepspeed_settings_without_a_file(envs: dict[str, dict[str, str]]) -> None:
    request = accelerate_env.from_environment(envs["deepspeed_stage"])
    assert request == AccelerateRequest(
        "DEEPSPEED", "deepspeed", "bf16", zero_stage=3, offload_optimizer_device="cpu",
        offload_param_device="none", gradient_accumulation_steps=4, gradient_clipping=1.0,
    )  # fmt: skip
    assert accelerate_env.flag_values(request) == {"backend": "deepspeed", "gradient_accumulation_steps": 4}
    # The kit's ZeRO-3 config is exactly this (bf16, optimizer on CPU, parameters not offloaded, clip 1.0).
    accelerate_env.check_deepspeed(request, load_deepspeed_json(ZERO3), ZERO3)
    # Its default config is ZeRO-2: named, with the shipped file that fits.
    with pytest.raises(ConfigError) as e:
        accelerate_env.check_deepspeed(
            request, load_deepspeed_json("deepspeed/ds_config.json"), "ds_config.json"
        )
    assert str(e.value) == (
        "the accelerate config asks for zero_stage 3, but ds_config.json has zero_optimization.stage 2: make "
        "them agree, or give accelerate that file as deepspeed_config_file (or pass --deepspeed_config "
        "deepspeed/ds_config_zero3.json)"
    )
    offloaded = load_deepspeed_json(ZERO3)
    offloaded["zero_optimization"]["offload_param"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match=r"offload_param_device none, but x has .*offload_param.device cpu"):
        accelerate_env.check_deepspeed(request, offloaded, "x")
    fp16 = {**load_deepspeed_json(ZERO3), "bf16": {"enabled": False}, "fp16": {"enabled": True}}
    with pytest.raises(ConfigError, match="mixed_precision bf16, but x trains in fp16"):
        accelerate_env.check_deepspeed(request, fp16, "x")
    with pytest.raises(ConfigError, match=r"gradient_clipping 1.0, but x has gradient_clipping 0.5"):
        accelerate_env.check_deepspeed(request, {**load_deepspeed_json(ZERO3), "gradient_clipping": 0.5}, "x")


def test_fsdp_settings(envs: dict[str, dict[str, str]]) -> None:
    request = accelerate_env.from_environment(envs["fsdp2"])
    assert request == AccelerateRequest(
        "FSDP", "fsdp", "bf16", fsdp_version=2, fsdp_offload_params=True, fsdp_activation_checkpointing=True,
        fsdp_state_dict_type="SHARDED_STATE_DICT", fsdp_layer_classes=("Qwen3DecoderLayer",),
    )  # fmt: skip
    assert accelerate_env.flag_values(request) == {
        "backend": "fsdp",
        "fsdp_cpu_offload": True,
        "activation_checkpointing": "full",
    }
    accelerate_env.check_precision(request, "bf16", "the FSDP engine")
    with pytest.raises(ConfigError, match="mixed_precision bf16, but the FSDP engine trains in fp32"):
        accelerate_env.check_precision(request, "fp32", "the FSDP engine")
    accelerate_env.check_wrapped_layers(request, ["Qwen3DecoderLayer"])
    with pytest.raises(
        ConfigError, match=r"wraps Qwen3DecoderLayer .* this model's decoder layers .LlamaDecoder"
    ):
        accelerate_env.check_wrapped_layers(request, ["LlamaDecoderLayer"])
    with pytest.raises(ConfigError, match=r"^--activation_checkpointing every_2 disagrees .* asks for full"):
        accelerate_env.check_against(request, {"activation_checkpointing": "every_2"})
    assert accelerate_env.check_against(request, {"activation_checkpointing": "full"})["backend"] == "fsdp"


def test_multi_gpu_is_the_kits_default_engine(envs: dict[str, dict[str, str]]) -> None:
    env = envs["multi_gpu"]
    assert env["WORLD_SIZE"] == "2"  # a real 2-process launch on CPU
    request = accelerate_env.from_environment(env)
    assert request == AccelerateRequest("MULTI_GPU", None, "fp16", compile=True)
    assert accelerate_env.flag_values(request) == {"compile": True}  # no --backend: the kit's default
    with pytest.raises(
        ConfigError, match=r"mixed_precision fp16, but deepspeed/ds_config.json trains in bf16"
    ):
        accelerate_env.check_deepspeed(
            request, load_deepspeed_json("deepspeed/ds_config.json"), "deepspeed/ds_config.json"
        )
    # What a rank's config becomes under that environment (resolution joins it): set and counted as given.
    parsed = parse_args(["--max_steps", "3"])
    assert parsed.accelerate is None and not parsed.model.compile  # parsing reads no environment
    cfg = accelerate_env.join(parsed, env)
    assert cfg.model.compile is True and "compile" in cfg.explicit and "max_steps" in cfg.explicit
    assert cfg.accelerate == request and accelerate_env.join(parsed, {}).accelerate is None
    with pytest.raises(
        ConfigError, match=r"^--compile False disagrees .* asks for True .dynamo_backend INDUCTOR"
    ):
        accelerate_env.join(parse_args(["--compile", "false"]), env)


def test_a_given_flag_that_contradicts_the_config_is_refused(
    envs: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as e:
        accelerate_env.join(parse_args(["--gradient_accumulation_steps", "2"]), envs["deepspeed_stage"])
    assert str(e.value) == (
        "--gradient_accumulation_steps 2 disagrees with the accelerate config, which asks for 4 "
        "(gradient_accumulation_steps): drop --gradient_accumulation_steps or change the accelerate config"
    )
    # The same value from a run file is named as the run file's key, and a value the accelerate config gave
    # as the accelerate config's.
    run = tmp_path / "run.yaml"
    run.write_text("optim: {gradient_accumulation_steps: 2}\n")
    with pytest.raises(ConfigError) as e:
        accelerate_env.join(parse_args(["--config", str(run)]), envs["deepspeed_stage"])
    assert str(e.value) == (
        f"optim.gradient_accumulation_steps (run file {run}) 2 disagrees with the accelerate config, which asks "
        "for 4 (gradient_accumulation_steps): drop optim.gradient_accumulation_steps or change the accelerate "
        "config"
    )
    joined = accelerate_env.join(parse_args([]), envs["fsdp2"])
    assert joined.origin_of("backend") == "the accelerate config's distributed_type FSDP"
    assert joined.setting("backend") == "--backend (the accelerate config's distributed_type FSDP)"


def test_resolution_joins_the_accelerate_config(envs: dict[str, dict[str, str]]) -> None:
    """Parsing reads no environment; resolving the settings joins the accelerate config first (its backend makes
    --fsdp_cpu_offload apply) and checks the resolved settings against it."""
    cfg = parse_args(["--fsdp_cpu_offload", "true", "--seq_length", "32"])  # fsdp: from the accelerate config
    assert cfg.optim.backend == "deepspeed" and cfg.accelerate is None
    settings = resolver.resolve_settings(cfg, env=envs["fsdp2"])
    joined = settings.config
    assert joined.optim.backend == "fsdp" and joined.model.activation_checkpointing == "full"
    assert joined.accelerate == accelerate_env.from_environment(envs["fsdp2"])
    assert (settings.train.backend, settings.train.fsdp_cpu_offload, settings.train.precision) == (
        "fsdp",
        True,
        "bf16",
    )
    with pytest.raises(ConfigError, match="--fsdp_cpu_offload applies to --backend fsdp only"):
        resolver.resolve_settings(cfg, env={})  # without accelerate: the default engine, DeepSpeed
    with pytest.raises(
        ConfigError, match=r"mixed_precision fp16, but deepspeed/ds_config\.json trains in bf16"
    ):
        resolver.resolve_settings(parse_args(["--seq_length", "32"]), env=envs["multi_gpu"])


REFUSED = {
    "megatron": "the accelerate config asks for Megatron-LM (distributed_type MEGATRON_LM), which dskit does "
    "not do: set distributed_type to DEEPSPEED or FSDP",
    "plain": "accelerate started one plain process (distributed_type NO, or use_cpu / --cpu)",
    "fsdp1_grad_op": "FSDP sharding SHARD_GRAD_OP (fsdp_version 1), which dskit does not do: dskit's FSDP2 "
    "engine shards fully",
    "deepspeed_file_and_stage": f"sets zero_stage beside deepspeed_config_file {ZERO3}: set them in that "
    "DeepSpeed file instead",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_kit_cannot_honour_is_one_line(envs: dict[str, dict[str, str]], name: str) -> None:
    assert REFUSED[name] in one_line_error(envs[name])


def test_refused_variants_of_real_environments(envs: dict[str, dict[str, str]]) -> None:
    """Settings accelerate cannot launch on this CPU box (fp8 needs Transformer Engine, other dynamo backends
    or parallelism sizes need GPUs), as the variables its launcher would set, on top of a real environment."""
    base = envs["multi_gpu"]
    assert "mixed_precision fp8" in one_line_error(base | {"ACCELERATE_MIXED_PRECISION": "fp8"})
    assert "dynamo_backend CUDAGRAPHS" in one_line_error(base | {"ACCELERATE_DYNAMO_BACKEND": "CUDAGRAPHS"})
    assert "dynamo_mode max-autotune" in one_line_error(base | {"ACCELERATE_DYNAMO_MODE": "max-autotune"})
    tp = base | {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    assert "a parallelism_config with tp_size 2" in one_line_error(tp)
    assert "TPU/XLA" in one_line_error(base | {"XLA_USE_BF16": "1"})
    fsdp = envs["fsdp2"]
    state_dict = fsdp | {"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}
    assert "fsdp_state_dict_type FULL_STATE_DICT, which dskit does not do" in one_line_error(state_dict)
    assert "SIZE_BASED_WRAP" in one_line_error(fsdp | {"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"})
    assert "FSDP sharding FALSE (fsdp_version 2)" in one_line_error(
        fsdp | {"FSDP_RESHARD_AFTER_FORWARD": "false"}
    )
