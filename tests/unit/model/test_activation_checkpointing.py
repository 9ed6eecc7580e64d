"""--activation_checkpointing none|full|every_N: the same training, fewer saved activations, bad values refused,
and the resolved run. Through the real Trainer with torch.compile: tests/e2e/test_model_setup.py. The estimate's
activation memory per level: tests/unit/engines/test_memory.py; `dskit estimate`'s recommendation:
tests/unit/dskit/test_estimate.py.

On CPU in fp32 with the tiny preset (2 decoder layers: every_2 checkpoints layer 0 of 2). Liger's kernels need a
GPU and are not run here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from dskit import cli
from model_utils.config.arguments import CHECKPOINTING_FORMS, parse_args
from model_utils.errors import ConfigError
from model_utils.model import activation_checkpointing as ac
from support.pretrained import checkpointed, tiny_model

LEVELS = ("none", "full", "every_2")


# --- the model: what is checkpointed, and the same training --------------------------------------------------


def test_levels_pick_decoder_layers_as_transformers_does(capsys: pytest.CaptureFixture[str]) -> None:
    picks = {}
    for value in LEVELS:
        model = ac.apply(tiny_model(), value)
        picks[value] = checkpointed(model)
    assert picks == {"none": [False, False], "full": [True, True], "every_2": [True, False]}
    out = capsys.readouterr().out
    assert "Activation checkpointing: 2 of 2 decoder layers (full)" in out
    assert "Activation checkpointing: 1 of 2 decoder layers (every_2)" in out
    assert out.count("Activation checkpointing") == 2  # nothing logged for none
    assert (ac.checkpointed_layers(28, "every_2"), ac.checkpointed_layers(28, "every_3")) == (14, 10)
    assert (
        ac.describe("every_2", 28) == "14 of 28 decoder layers (every_2)"
        and ac.describe("none", 28) == "none"
    )


def test_transformers_before_5_23_is_switched_through_its_older_name() -> None:
    """transformers 5.17-5.22 (an H200 image's 5.17) has the switch, every_n_layers too, as
    gradient_checkpointing_enable only: a model class without activation_checkpointing_enable stands in."""

    def absent(self: object) -> None:
        raise AttributeError("activation_checkpointing_enable")

    model = tiny_model()
    newer = type(model)
    calls = []

    def gradient_checkpointing_enable(self: object, **kwargs: object) -> None:
        calls.append(sorted(kwargs))
        newer.gradient_checkpointing_enable(self, **kwargs)  # 5.23's alias: the switch behind both names

    model.__class__ = type(
        "Older",
        (newer,),
        {
            "activation_checkpointing_enable": property(absent),
            "gradient_checkpointing_enable": gradient_checkpointing_enable,
        },
    )
    with pytest.warns(FutureWarning, match="gradient_checkpointing_enable"):  # 5.23 keeps it as an alias
        ac.apply(model, "every_2", announce=False)
    assert calls == [["every_n_layers", "gradient_checkpointing_kwargs"]]
    assert checkpointed(model) == [True, False]


def test_same_losses_and_gradients_as_without_checkpointing() -> None:
    """fp32 on CPU, three AdamW steps from the same weights and batches: the recompute is exact."""
    base = tiny_model()
    torch.manual_seed(1)
    batches = [torch.randint(0, 2048, (2, 64)) for _ in range(3)]
    losses, grads = {}, {}
    for value in LEVELS:
        model = ac.apply(copy.deepcopy(base), value, announce=False).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[value] = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if len(losses[value]) == 0:
                grads[value] = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            losses[value].append(loss.item())
    for value in ("full", "every_2"):
        assert losses[value] == pytest.approx(losses["none"], abs=1e-5)
        for a, b in zip(grads[value], grads["none"], strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert len(set(losses["none"])) == 3  # the steps trained


def saved_for_backward(model, ids: torch.Tensor) -> tuple[int, int]:
    """(count, bytes) of the tensors autograd saves for backward in one forward, outside checkpointed regions
    (the checkpoint's own hooks take the ones inside: they are recomputed, not kept)."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    return len(sizes), sum(sizes)


def test_checkpointing_saves_fewer_activations() -> None:
    base = tiny_model()
    ids = torch.randint(0, 2048, (2, 64))
    saved = {
        v: saved_for_backward(ac.apply(copy.deepcopy(base), v, announce=False).train(), ids) for v in LEVELS
    }
    assert saved["full"][0] < saved["every_2"][0] < saved["none"][0]
    assert saved["full"][1] < saved["every_2"][1] < saved["none"][1]
    # In eval (validation) nothing is checkpointed: transformers checkpoints only in training mode.
    model = ac.apply(copy.deepcopy(base), "full", announce=False).eval()
    assert saved_for_backward(model, ids) == saved_for_backward(copy.deepcopy(base).eval(), ids)


# --- bad values ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["partial", "Full", "every_0", "every_", "every_two", "every_-2", "every 2"]
)
def test_bad_values_are_one_line_naming_the_forms(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--activation_checkpointing", value])
    message = str(err.value)
    assert "\n" not in message
    assert message == f"--activation_checkpointing {value!r} is not one of {CHECKPOINTING_FORMS}"
    assert cli.main(["config", "--activation_checkpointing", value]) == 2
    assert cli.main(["estimate", "--activation_checkpointing", value]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines == [f"error: {message}"] * 2


def test_models_without_checkpointing_are_refused() -> None:
    class NoCheckpointing(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(ConfigError, match="no activation checkpointing for NoCheckpointing: use"):
        ac.apply(NoCheckpointing(), "full")


# --- the resolved run ----------------------------------------------------------------------------------------------


def test_resolved_run_says_what_is_checkpointed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for value, resolved in (("none", "none"), ("every_2", "1 of 2 decoder layers (every_2)")):
        argv = ["config", "--activation_checkpointing", value, "--data_cache_dir", str(tmp_path / "cache")]
        assert cli.main(argv) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["config"]["model"]["activation_checkpointing"] == value  # as given
        assert printed["resolved"]["activation_checkpointing"] == resolved
