"""Model sources (a preset, a local directory, a hub id) resolve or fail clearly; the attention that keeps the
documents of a pack apart. The presets themselves: tests/unit/config/test_presets.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from model_utils.config.presets import PRESETS
from model_utils.data.step_batches import Batch, gather
from model_utils.data.token_shards import TokenBlocks
from model_utils.errors import ConfigError
from model_utils.model import models
from support.pretrained import tiny_model


def test_short_names_for_checkpoint_tags() -> None:
    assert models.resolve_model_source("Qwen/Qwen3-0.6B").short_name == "qwen3_0_6b"
    assert models.resolve_model_source("tiny-qwen3").short_name == "tiny_qwen3"


def test_local_model_dir_round_trip(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = PRESETS["tiny-qwen3"].build_config()
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    source = models.resolve_model_source(str(tmp_path / "m"))
    assert source.local_dir == tmp_path / "m"
    assert models.load_model_config(source).hidden_size == 64


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tiny-qwen4", "unknown model 'tiny-qwen4': not a preset"),
        ("/no/such/model", "does not exist"),
        ("./relative/missing", "does not exist"),
    ],
)
def test_unknown_models(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        models.resolve_model_source(name)


def test_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        models.resolve_model_source(str(tmp_path))


def test_sequence_length_limits() -> None:
    config = PRESETS["tiny-qwen3"].build_config()
    assert models.resolve_seq_length(None, config) == 256
    assert models.resolve_seq_length(None, PRESETS["qwen3-0.6b"].build_config()) == 2048
    with pytest.raises(ConfigError, match="above the model's maximum positions"):
        models.resolve_seq_length(257, config)


def test_hub_models_fail_fast_and_clearly_offline(monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The hub reads the variable once, at its import: without it (a process started without HF_HUB_OFFLINE, as
    # tools/test_tiers.py run by hand) this would try huggingface.co and fail only after 25 s of DNS retries.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="could not load model config 'nobody/nothing'"):
        models.load_model_config(models.resolve_model_source("nobody/nothing"))


# --- attention that keeps documents apart (--packing documents) ---

EOS = 1


def packed_rows(doc_b: list[int]) -> np.ndarray:
    """Two rows of 16 tokens from the text stream: row 0 holds documents B, A (each ending with EOS) and the start
    of C; row 1 holds A, then D to the end of the row."""
    doc_a = [5, 9, 14, 3, 7, EOS]
    doc_c = [11, 12]
    doc_d = [20, 21, 22, 23, 24, 25, 26, 27, 28, EOS]
    return np.array([doc_b + doc_a + doc_c[: 16 - len(doc_b) - len(doc_a)], doc_a + doc_d], dtype=np.int64)


DOC_B = [30, 31, 32, 33, 34, 35, 36, EOS]
OTHER_B = [40, 41, 42, 43, 44, 45, 46, EOS]  # another document B of the same length
DOC_A = slice(8, 14)  # where A sits in row 0


def batch_of(rows: np.ndarray, documents_apart: bool, flatten: bool = False) -> Batch:
    blocks = TokenBlocks([rows.reshape(-1)], seq_length=16, document_end=EOS if documents_apart else None)
    return gather(blocks, np.arange(len(rows)), pin=False, flatten=flatten)


def token_losses(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The loss of each token given the tokens before it (0 where it is not a target), shaped like the rows."""
    inputs = batch.model_inputs()
    inputs.pop("labels")
    logits = model(**inputs).logits.float()
    labels = batch.labels[:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none", ignore_index=-100
    )
    return torch.nn.functional.pad(losses.reshape(labels.shape), (1, 0))


def alone(model: torch.nn.Module, document: list[int]) -> torch.Tensor:
    """Each token's loss in the unpacked forward of one document (every token but its first predicted)."""
    ids = torch.tensor([document])
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")


@pytest.mark.parametrize("flatten", [False, True], ids=["rows", "flattened"])
def test_each_document_in_a_pack_has_its_unpacked_loss(flatten: bool) -> None:
    model = tiny_model().eval()
    assert not models.attend_within_documents(model, torch.device("cpu"))  # SDPA on CPU, as built
    batch = batch_of(packed_rows(DOC_B), documents_apart=True, flatten=flatten)
    with torch.no_grad():
        packed = token_losses(model, batch).reshape(2, 16)
        want = {"B": alone(model, DOC_B), "A": alone(model, packed_rows(DOC_B)[1, :6].tolist())}
        want["D"] = alone(model, packed_rows(DOC_B)[1, 6:].tolist())
    # A document's first token is no target: 0 there, its own tokens' losses after it.
    torch.testing.assert_close(packed[0, 1:8], want["B"], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[0, 9:14], want["A"], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1, 1:6], want["A"], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1, 7:16], want["D"], atol=1e-5, rtol=0)
    assert packed[0, 8] == 0 and packed[1, 6] == 0 and packed[0, 14] == 0  # starts of A, D and C
    assert packed[0, 15] > 0  # C's second token, predicted from its first


def loss_of_a_gradients(rows: np.ndarray, documents_apart: bool) -> dict[str, torch.Tensor]:
    """The gradients of document A's summed loss in row 0 with respect to every weight (the embedding's rows are
    the gradient with respect to the inputs)."""
    model = tiny_model()
    losses = token_losses(model, batch_of(rows, documents_apart))
    losses[0, DOC_A].sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_changing_one_document_changes_no_gradient_of_another() -> None:
    kept = loss_of_a_gradients(packed_rows(DOC_B), documents_apart=True)
    changed = loss_of_a_gradients(packed_rows(OTHER_B), documents_apart=True)
    assert kept.keys() == changed.keys() and len(kept) > 10
    for name in kept:
        torch.testing.assert_close(changed[name], kept[name], atol=1e-6, rtol=0, msg=name)
    # The stream (attention across the row) is what this guards against: there A's gradients depend on B.
    streamed = loss_of_a_gradients(packed_rows(DOC_B), documents_apart=False)
    streamed_other = loss_of_a_gradients(packed_rows(OTHER_B), documents_apart=False)
    assert any(not torch.allclose(streamed[n], streamed_other[n], atol=1e-4) for n in streamed)


@pytest.mark.gpu
def test_flash_attention_keeps_documents_apart_in_a_flattened_pack() -> None:
    """On CUDA with flash-attn: the variable-length kernels read the documents from the flattened positions."""
    pytest.importorskip("flash_attn")
    cuda = torch.device("cuda")
    model = tiny_model(torch.bfloat16).to(cuda).eval()
    assert models.attend_within_documents(model, cuda) and models.flattens_documents(model)
    batch = batch_of(packed_rows(DOC_B), documents_apart=True, flatten=True).to(cuda)
    with torch.no_grad():
        packed = token_losses(model, batch).reshape(2, 16).cpu()
        a_alone = alone(model, packed_rows(DOC_B)[1, :6].tolist()).cpu()  # flash too: a one-row batch
    torch.testing.assert_close(packed[0, 9:14], a_alone, atol=2e-2, rtol=0)  # bf16
    torch.testing.assert_close(packed[1, 1:6], a_alone, atol=2e-2, rtol=0)


class AttentionRecorder:
    """A model's attention switch, as transformers' set_attn_implementation; refuses when told to."""

    def __init__(self, refuse: bool) -> None:
        self.config = type("Config", (), {"_attn_implementation": "sdpa"})()
        self.refuse = refuse

    def set_attn_implementation(self, name: str) -> None:
        if self.refuse:
            raise ImportError(
                "FlashAttention2 has been toggled on, but it cannot be used: no GPU kernel for sm_70"
            )
        self.config._attn_implementation = name


def test_cuda_with_flash_attn_switches_to_varlen_attention_or_keeps_sdpa_saying_why(
    monkeypatch, capsys
) -> None:
    import importlib.util

    cuda = torch.device("cuda", 0)  # a device name only: nothing runs on it
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    switched = AttentionRecorder(refuse=False)
    assert models.attend_within_documents(switched, cuda) and models.flattens_documents(switched)
    refused = AttentionRecorder(refuse=True)
    assert not models.attend_within_documents(refused, cuda) and not models.flattens_documents(refused)
    assert (
        "SDPA with a block-diagonal mask per document (flash_attention_2 unusable: "
        in capsys.readouterr().out
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # not installed: SDPA, silently
    untouched = AttentionRecorder(refuse=False)
    assert not models.attend_within_documents(untouched, cuda) and not models.flattens_documents(untouched)


def test_qwen3_0_6b_flops_per_token_matches_the_hand_count() -> None:
    """6N + causal attention: N = 596.0M (tied embedding counted once, as the output projection)."""
    config = PRESETS["qwen3-0.6b"].build_config()
    n = 596_049_920
    attention = 6 * 28 * 16 * 128 * 2048  # layers x heads x head_dim x seq
    assert models.flops_per_token(config, 2048) == 6 * n + attention
    assert models.flops_per_token(config, 2048) / 1e9 == pytest.approx(4.281, abs=1e-3)


def test_untied_input_embedding_is_not_a_matmul() -> None:
    config = PRESETS["tiny-qwen3"].build_config()
    config.tie_word_embeddings = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    assert models.matmul_parameters(model) == total - config.vocab_size * config.hidden_size
    config.tie_word_embeddings = True
    with torch.device("meta"):
        tied = AutoModelForCausalLM.from_config(config)
    assert models.matmul_parameters(tied) == sum(p.numel() for p in tied.parameters())


def test_lora_flops_count_no_weight_gradient_for_the_frozen_weights() -> None:
    """LoRA r=16 on q, k, v, o of Qwen3-0.6B: the 596.0M frozen weights cost 4 per token (forward, input
    gradient), the 4.59M adapter weights 6; counted from the architecture, so a ZeRO-3 engine's empty parameter
    placeholders cannot turn it into near zero."""
    from model_utils.config.arguments import LoraArgs

    config = PRESETS["qwen3-0.6b"].build_config()
    n = 596_049_920
    per_layer = 16 * ((1024 + 2048) + (1024 + 1024) + (1024 + 1024) + (2048 + 1024))  # r x (in + out)
    adapters = 28 * per_layer
    attention = 6 * 28 * 16 * 128 * 2048
    lora = models.flops_per_token(config, 2048, LoraArgs(lora_r=16))
    assert lora == 4 * n + 6 * adapters + attention
    assert models.flops_per_token(config, 2048, LoraArgs()) == 6 * n + attention  # LoRA off: full training
