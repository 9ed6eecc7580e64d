"""The engine registry: its names are the --backend choices, an engine's module is imported only when asked for,
and each engine recognises the checkpoint tags it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from model_utils import engines
from model_utils.checkpoint import protocol
from model_utils.config.arguments import BACKENDS, OptimArgs
from model_utils.engines import deepspeed_engine, fsdp_engine
from model_utils.errors import ConfigError

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
        assert engines.engine_class(name).owns_tag(tag) == (name == owner), name
    assert protocol.is_tag_dir(tag) == (owner is not None)
    assert not protocol.is_tag_dir(tmp_path)  # the dir of tags is none


def test_only_an_engine_that_does_not_reshard_names_a_converted_copy() -> None:
    assert deepspeed_engine.DeepSpeedEngine.converted_tag("t-4steps") == "t-4steps-universal"
    assert fsdp_engine.FsdpEngine.converted_tag("t-4steps") is None
    for name in engines.NAMES:
        engine = engines.engine_class(name)
        assert (engine.converted_tag("t-4steps") is None) == engine.reshards_on_load


def test_a_third_engine_is_one_module_and_one_registry_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "toy_engine.py").write_text(
        textwrap.dedent("""
            class ToyEngine:
                reshards_on_load = True

                @staticmethod
                def owns_tag(tag_dir):
                    return (tag_dir / "toy.state").is_file()
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(engines.ENGINES, "toy", "toy_engine:ToyEngine")
    assert engines.engine_class("toy").__name__ == "ToyEngine"
    assert engines.engine_of_tag(_tag(tmp_path / "ck", "toy.state")) == "toy"
