"""What the model set-up does under the real training path: --compile and --activation_checkpointing through
the real Trainer in this process (one gloo rank), each engine, against eager. Moved out of the unit tier (each
builds engines and trains): the decisions and the checkpointed layers themselves are in
tests/unit/model/test_kernels.py and test_activation_checkpointing.py."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from support.compiled import compiled_in_place
from support.pretrained import checkpointed
from support.small_trainer import make_trainer

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_compile_trains_like_eager_through_each_engine(
    backend: str, tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compile true through the real Trainer (ZeRO-2 with CPU Adam; FSDP2, compiled before sharding): the same
    losses as eager, the same state_dict keys. Dynamo and AOTAutograd run for real; the backend is aot_eager
    because inductor's cold C++ build takes ~90 s on 2 cores (inductor runs in tests/unit/model/test_kernels.py's
    GPU test)."""
    losses = {}
    for compiled in (False, True):
        if compiled:
            aot_eager = functools.partialmethod(torch.nn.Module.compile, backend="aot_eager")
            monkeypatch.setattr(torch.nn.Module, "compile", aot_eager)
        trainer = make_trainer(
            tmp_path / f"{backend}-{compiled}",
            single_rank,
            "--compile",
            str(compiled).lower(),
            "--backend",
            backend,
        )
        module = trainer.engine.module
        assert compiled_in_place(module) is compiled
        assert not any(key.startswith("_orig_mod") for key in module.state_dict())
        trainer.engine.train()
        losses[compiled] = [trainer.step().loss for _ in range(3)]
        trainer.close()
    # Steps 2 and 3 ran after optimizer updates: the compiled module trained exactly as the eager one did.
    assert losses[True] == pytest.approx(losses[False], abs=2e-3)
    assert len(set(losses[True])) == 3


def test_trainer_checkpoints_under_deepspeed_and_compile(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the real Trainer (ZeRO-2, CPU Adam): every_2 with torch.compile trains as eager without
    checkpointing. Dynamo and AOTAutograd trace the checkpointed layer for real; the backend is aot_eager, as in
    the compile test above (inductor's cold C++ build takes minutes on 2 cores)."""
    losses = {}
    for value, compiled in (("none", False), ("every_2", True)):
        if compiled:
            aot_eager = functools.partialmethod(torch.nn.Module.compile, backend="aot_eager")
            monkeypatch.setattr(torch.nn.Module, "compile", aot_eager)
        trainer = make_trainer(
            tmp_path, single_rank, "--activation_checkpointing", value, "--compile", str(compiled).lower()
        )
        module = trainer.engine.module
        assert checkpointed(module) == ([True, False] if value == "every_2" else [False, False])
        assert compiled_in_place(module) is compiled
        trainer.engine.train()
        losses[value] = [trainer.step().loss for _ in range(3)]
        trainer.close()
    assert "Activation checkpointing: 1 of 2 decoder layers (every_2)" in capsys.readouterr().out
    # bf16 training: the compiled graph may fuse differently, as in the compile test above.
    assert losses["every_2"] == pytest.approx(losses["none"], abs=2e-3)
