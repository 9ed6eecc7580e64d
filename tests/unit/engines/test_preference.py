"""The preference objectives against TRL's own trainer code (TRL 1.16, the oracle): DPOTrainer._compute_loss for each
DPO loss type and CPOTrainer's SimPO loss, on the same tiny model, batch and settings, loss and metrics within 1e-5;
and DPO's first step, where the policy is its reference: loss ln 2 and every reward 0. Engines end to end (ranks,
accumulation, resume): tests/e2e/test_preference.py."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

from model_utils import assets
from model_utils.data.step_batches import IGNORE_INDEX, Batch
from model_utils.engines import preference
from model_utils.engines.base import EVAL, TRAIN
from support.pretrained import tiny_model

ROWS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green, or so they say."},
    {"prompt": "Two and two make", "chosen": " four.", "rejected": " five."},
    {"prompt": "Water boils at", "chosen": " one hundred degrees.", "rejected": " ten."},
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets.TOKENIZER_DIR))


def trl_dpo(tokenizer, loss_type: str, beta: float, label_smoothing: float = 0.0):
    """TRL's DPOTrainer on the tiny model (its reference log-probabilities precomputed, as the kit's are), and the
    collated batch of ROWS it trains on."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    args = DPOConfig(
        output_dir="unused",
        report_to="none",
        use_cpu=True,
        beta=beta,
        loss_type=[loss_type],
        label_smoothing=label_smoothing,
        precompute_ref_log_probs=True,
        per_device_train_batch_size=len(ROWS),
        save_strategy="no",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=tiny_model(), args=args, train_dataset=Dataset.from_list(ROWS), processing_class=tokenizer
        )
    rows = list(trainer.train_dataset)
    collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id or 0)
    inputs = collate([{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows])
    # References apart from the policy, so that the rewards and margins are not all 0.
    inputs["ref_chosen_logps"] = torch.tensor([r["ref_chosen_logps"] for r in rows]) - torch.tensor(
        [1.0, -3.0, 0.5]
    )
    inputs["ref_rejected_logps"] = torch.tensor([r["ref_rejected_logps"] for r in rows]) + torch.tensor(
        [0.5, -1.5, 1.0]
    )
    return trainer, inputs


def kit_batch(inputs: dict, with_reference: bool = True) -> Batch:
    """TRL's collated batch as the kit's step batches gather pairs: chosen rows, then rejected; labels the
    completion tokens."""
    ids = inputs["input_ids"]
    labels = ids.masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)
    labels[:, 0] = IGNORE_INDEX
    reference = (
        torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]) if with_reference else None
    )
    pairs = len(ids) // 2
    return Batch(ids, labels, None, int((labels != IGNORE_INDEX).sum()), pairs=pairs, reference=reference)


TRL_NAMES = dict(preference.METRICS)


@pytest.mark.parametrize(
    ("loss_type", "beta", "smoothing"),
    [("sigmoid", 0.1, 0.0), ("robust", 0.3, 0.2), ("ipo", 0.1, 0.0), ("hinge", 0.5, 0.0)],
)
def test_each_dpo_loss_and_its_metrics_equal_trl(tokenizer, loss_type, beta, smoothing) -> None:
    trainer, inputs = trl_dpo(tokenizer, loss_type, beta, smoothing)
    torch.manual_seed(0)
    expected = trainer._compute_loss(trainer.model, inputs, False)
    theirs = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    settings = preference.Settings("dpo", beta=beta, loss_type=loss_type, label_smoothing=smoothing)
    objective = preference.Preference(settings)
    batch = kit_batch(inputs)
    got = objective.summed_loss(trainer.model, batch, torch.tensor(float(batch.pairs)))
    assert abs(float(got) - float(expected)) <= TOLERANCE * max(1.0, abs(float(expected))), (got, expected)
    ours = objective.means(objective.take(TRAIN))
    for trl_name, key in preference.METRICS:
        assert abs(ours[key] - theirs[trl_name]) <= TOLERANCE * max(1.0, abs(theirs[trl_name])), (
            key,
            ours,
            theirs,
        )
    assert (
        0 < ours["reward_accuracy"] < 1
    )  # the references make the pairs disagree: the test can see a mix-up


def test_gradients_equal_trl(tokenizer) -> None:
    trainer, inputs = trl_dpo(tokenizer, "sigmoid", 0.1)
    trainer._compute_loss(trainer.model, inputs, False).backward()
    theirs = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()
    objective = preference.Preference(preference.Settings("dpo"))
    batch = kit_batch(inputs)
    objective.summed_loss(trainer.model, batch, torch.tensor(float(batch.pairs))).backward()
    for name, p in trainer.model.named_parameters():
        scale = max(1e-6, float(theirs[name].abs().max()))
        assert float((p.grad - theirs[name]).abs().max()) <= TOLERANCE * scale, name


@pytest.mark.parametrize(("beta", "gamma", "smoothing"), [(2.0, 0.5, 0.0), (0.5, 1.0, 0.1)])
def test_simpo_equals_trl_cpo_simpo(tokenizer, beta, gamma, smoothing) -> None:
    """SimPO as TRL's CPOTrainer computes it (loss_type simpo, cpo_alpha 0: no NLL term): its own get_batch_logps
    (length-averaged) and cpo_loss."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    _, inputs = trl_dpo(tokenizer, "sigmoid", 0.1)
    model = tiny_model()
    batch = kit_batch(inputs, with_reference=False)
    logits = model(input_ids=batch.input_ids).logits
    logps = CPOTrainer.get_batch_logps(logits, batch.labels, average_log_prob=True)
    cpo = types.SimpleNamespace(
        alpha=0.0,
        beta=beta,
        simpo_gamma=gamma,
        label_smoothing=smoothing,
        loss_type="simpo",
        accelerator=types.SimpleNamespace(device=logits.device),
    )
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(cpo, *logps.chunk(2))

    settings = preference.Settings("simpo", beta=beta, label_smoothing=smoothing, simpo_gamma=gamma)
    objective = preference.Preference(settings)
    got = objective.summed_loss(model, batch, torch.tensor(float(batch.pairs)))
    assert abs(float(got) - float(losses.mean())) <= TOLERANCE * max(1.0, float(losses.mean()))
    ours = objective.means(objective.take(TRAIN))
    assert abs(ours["reward_chosen"] - float(chosen_rewards.mean())) <= TOLERANCE
    assert abs(ours["reward_rejected"] - float(rejected_rewards.mean())) <= TOLERANCE
    accuracy = float((chosen_rewards > rejected_rewards).float().mean())
    assert ours["reward_accuracy"] == pytest.approx(accuracy)


def test_at_the_first_step_the_policy_is_its_reference_loss_ln2_rewards_0(tokenizer) -> None:
    _, inputs = trl_dpo(tokenizer, "sigmoid", 0.1)
    model = tiny_model()
    batch = kit_batch(inputs, with_reference=False)
    with torch.no_grad():
        reference = preference.sequence_logps(model, batch)[0]
    batch = kit_batch(inputs, with_reference=False)
    batch = Batch(batch.input_ids, batch.labels, None, batch.targets, pairs=batch.pairs, reference=reference)
    objective = preference.Preference(preference.Settings("dpo"))
    loss = objective.summed_loss(model, batch, torch.tensor(float(batch.pairs)))
    assert float(loss) == pytest.approx(math.log(2), abs=1e-7)
    metrics = objective.means(objective.take(TRAIN))
    for key in ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"):
        assert metrics[key] == 0.0, (key, metrics)


def test_training_and_validation_metrics_are_kept_apart_and_uncounted_pairs_left_out(tokenizer) -> None:
    _, inputs = trl_dpo(tokenizer, "sigmoid", 0.1)
    model = tiny_model()
    objective = preference.Preference(preference.Settings("dpo"))
    batch = kit_batch(inputs)
    with torch.no_grad():
        objective.eval_summed_loss(model, batch)
        objective.eval_summed_loss(model, Batch(**{**batch.__dict__, "uncounted": True}))
    assert objective.take(TRAIN)[-1] == 0.0  # no training pair seen
    sums = objective.take(EVAL)
    assert sums[-1] == batch.pairs  # the repeated batch is not counted
    assert objective.take(EVAL)[-1] == 0.0  # taken: the next interval starts empty
    assert objective.means([0.0] * (len(preference.KEYS) + 1)) == {}
