"""The engine registry: its names are the --backend choices, an engine's module is imported only when asked for,
each engine recognises the checkpoint tags it wrote, a new engine is one module and one registry line, and the
engines sit below the packages that use them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import import_graph
from model_utils import engines
from model_utils.checkpoint import protocol
from model_utils.config.arguments import BACKENDS, OptimArgs
from model_utils.engines import deepspeed_engine, fsdp_engine, memory
from model_utils.errors import ConfigError
from support.estimates import layout

REPO = Path(__file__).resolve().parents[3]


def test_names_are_the_backend_choices_and_the_first_is_the_default() -> None:
    assert engines.NAMES == ("deepspeed", "fsdp") == BACKENDS
    assert engines.DEFAULT == "deepspeed" == OptimArgs().backend
    assert engines.engine_class("deepspeed") is deepspeed_engine.DeepSpeedEngine
    assert engines.engine_class("fsdp") is fsdp_engine.FsdpEngine
    with pytest.raises(
        ConfigError, match="--backend 'zero' is not a training engine: use one of deepspeed, fsdp"
    ):
        engines.engine_class("zero")


def _modules_after(code: str) -> dict[str, bool]:
    """Which of torch and the engine modules a fresh interpreter holds after `code`."""
    probe = textwrap.dedent(code) + textwrap.dedent("""
        import json, sys
        names = ("torch", "model_utils.engines.deepspeed_engine", "model_utils.engines.fsdp_engine")
        print(json.dumps({n: n in sys.modules for n in names}))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_registry_and_the_config_parser_import_no_engine_and_no_torch() -> None:
    loaded = _modules_after("import model_utils.engines, model_utils.config.arguments")
    assert not any(loaded.values()), loaded


@pytest.mark.parametrize("name, other", [("deepspeed", "fsdp"), ("fsdp", "deepspeed")])
def test_asking_for_one_engine_imports_it_and_not_the_other(name: str, other: str) -> None:
    loaded = _modules_after(f"from model_utils import engines; engines.engine_class({name!r})")
    assert loaded[engines.engine_module(name)] and not loaded[engines.engine_module(other)], loaded


def _tag(root: Path, *files: str) -> Path:
    tag = root / "tiny_qwen3-3steps"
    tag.mkdir(parents=True)
    for name in files:
        (tag / name).parent.mkdir(parents=True, exist_ok=True)
        (tag / name).write_bytes(b"x")
    return tag


# What each engine writes into a tag (beside dskit's own rng_state_rank<R>.pt, hf_config/, launch.json).
TAGS = {
    "zero2": (
        "deepspeed",
        deepspeed_engine.MODEL_STATES,
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ),
    "zero3": (
        "deepspeed",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ),
    "fsdp": (
        "fsdp",
        fsdp_engine.STATE_FILE,
        f"{fsdp_engine.DCP_DIR}/.metadata",
        f"{fsdp_engine.DCP_DIR}/__0_0.distcp",
        f"{fsdp_engine.DCP_DIR}/__1_0.distcp",
    ),
    "nobody's": (None, "rng_state_rank0.pt", "launch.json", "hf_config/config.json"),
}


@pytest.mark.parametrize("kind", sorted(TAGS))
def test_each_engine_recognises_its_own_tags_and_no_other(tmp_path: Path, kind: str) -> None:
    owner, *files = TAGS[kind]
    tag = _tag(tmp_path, *files, "rng_state_rank0.pt", "launch.json")
    assert engines.engine_of_tag(tag) == owner
    for name in engines.NAMES:
        assert engines.checkpoint_format(name).owns_tag(tag) == (name == owner), name
    assert protocol.is_tag_dir(tag) == (owner is not None)
    assert not protocol.is_tag_dir(tmp_path)  # the dir of tags is none


def test_only_an_engine_that_does_not_reshard_names_a_converted_copy() -> None:
    assert deepspeed_engine.DeepSpeedEngine.converted_tag("t-4steps") == "t-4steps-universal"
    assert fsdp_engine.FsdpEngine.converted_tag("t-4steps") is None
    for name in engines.NAMES:
        fmt = engines.checkpoint_format(name)
        assert (fmt.converted_tag("t-4steps") is None) == fmt.reshards_on_load


def test_a_third_engine_is_one_module_and_one_registry_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each caller reaches the new engine through the registry by the protocol it needs: its checkpoint tags, the
    ops its config loads, its memory model (a layout naming it is estimated and described by it)."""
    (tmp_path / "toy_engine.py").write_text(
        textwrap.dedent("""
            class ToyEngine:
                reshards_on_load = True
                zero_stages = False

                @staticmethod
                def owns_tag(tag_dir):
                    return (tag_dir / "toy.state").is_file()

                @staticmethod
                def jit_ops(ds, device_type):
                    return ("ToyBuilder",)

                @staticmethod
                def estimate_memory(shape, layout):
                    return f"toy memory of {shape}"

                @staticmethod
                def describe_layout(layout):
                    return "one toy rank"
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(engines.ENGINES, "toy", "toy_engine:ToyEngine")
    toy = engines.engine_class("toy")
    assert toy.__name__ == "ToyEngine"
    assert (
        engines.checkpoint_format("toy") is engines.memory_model("toy") is engines.config_rules("toy") is toy
    )
    assert engines.engine_of_tag(_tag(tmp_path / "ck", "toy.state")) == "toy"
    assert engines.jit_ops("toy", {}, "cpu") == ("ShareMemCommBuilder", "ToyBuilder")
    lay = layout(7, "optimizer+params", backend="toy")  # no ZeRO stages: not checked as one
    assert (memory.estimate("a shape", lay), lay.describe()) == ("toy memory of a shape", "one toy rank")


def test_the_engines_import_nothing_above_them() -> None:
    """engines/ sits below checkpoint/, resolve/ and loop/ (which import it): none of its modules imports them, not
    under TYPE_CHECKING nor inside a function either."""
    _, edges, _ = import_graph.graph()
    above = ("model_utils.checkpoint", "model_utils.resolve", "model_utils.loop", "dskit")
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in edges.items()
        if source == "model_utils.engines" or source.startswith("model_utils.engines.")
        for target in targets
        if target.startswith(above)
    )
    assert upward == []
    assert (
        "model_utils.engines.memory" in edges["model_utils.resolve.memory_estimate"]
    )  # the model, from below


# --- the DeepSpeed ops a resolved run JIT-loads (built and announced by the ranks, checked by dskit doctor) ---


def run_ops(flags: list[str], device_type: str) -> tuple[str, ...]:
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import train_settings

    ts = train_settings.resolve(parse_args(flags))
    return engines.jit_ops(ts.backend, ts.deepspeed_json(1, 10), device_type)


@pytest.mark.parametrize(
    ("flags", "device_type", "ops"),
    [
        # ZeRO-2 without offload: torch's AdamW on CPU ranks (torch_adam_on_cpu); on GPUs the kit's GPU-only
        # config asks for torch's fused AdamW, a config that does not for DeepSpeed's FusedAdam
        (["--deepspeed_config", "DEEPSPEEDS_ADAM"], "cpu", ("ShareMemCommBuilder",)),
        (["--deepspeed_config", "DEEPSPEEDS_ADAM"], "cuda", ("FusedAdamBuilder",)),
        (["--deepspeed_config", "deepspeed/ds_config_gpu.json"], "cpu", ("ShareMemCommBuilder",)),
        (["--deepspeed_config", "deepspeed/ds_config_gpu.json"], "cuda", ()),
        # the default: the optimizer offloaded to the CPU (DeepSpeedCPUAdam) on either
        ([], "cpu", ("ShareMemCommBuilder", "CPUAdamBuilder")),
        ([], "cuda", ("CPUAdamBuilder",)),
        (
            ["--config", str(REPO / "configs" / "zero3-offload.yaml")],
            "cpu",
            ("ShareMemCommBuilder", "CPUAdamBuilder"),
        ),
        # FSDP: torch's AdamW and collectives; CPU ranks still start DeepSpeed's process group
        (["--backend", "fsdp"], "cpu", ("ShareMemCommBuilder",)),
        (["--backend", "fsdp"], "cuda", ()),
    ],
)
def test_the_ops_a_run_builds_follow_its_config_and_device(
    flags: list[str], device_type: str, ops: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    gpu_only = json.loads((REPO / "deepspeed" / "ds_config_gpu.json").read_text())
    for key in ("torch_adam", "fused"):  # the config as DeepSpeed's docs write it: DeepSpeed's own Adam
        del gpu_only["optimizer"]["params"][key]
    (tmp_path / "adam.json").write_text(json.dumps(gpu_only))
    flags = [str(tmp_path / "adam.json") if flag == "DEEPSPEEDS_ADAM" else flag for flag in flags]
    assert run_ops(flags, device_type) == ops


def test_the_engine_names_the_ops_of_its_optimizer_and_nvme_offload() -> None:
    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}
    ds = deepspeed_engine.DeepSpeedEngine
    assert ds.jit_ops({"optimizer": {"type": "AdamW"}, "zero_optimization": nvme}, "cuda") == (
        "CPUAdamBuilder",
        "AsyncIOBuilder",
    )
    assert ds.jit_ops({"optimizer": {"type": "Lamb"}}, "cuda") == ("FusedLambBuilder",)
    # torch_adam set in the config: torch.optim's Adam, nothing to build; off: FusedAdam even on CPU ranks
    assert ds.jit_ops({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, "cuda") == ()
    assert ds.jit_ops({"optimizer": {"type": "Adam", "params": {"torch_adam": False}}}, "cpu") == (
        "FusedAdamBuilder",
    )
    assert ds.jit_ops({"optimizer": {"type": "SGD"}}, "cuda") == ()  # a torch.optim optimizer
