"""`dskit eval`: the shipped task, lm-eval on a tiny model dir offline against a direct computation of the same
multiple-choice scores, and bad input (one line, nothing written). A checkpoint's export and its results in the
training run's trackers: tests/e2e/test_trainer.py (real TensorBoard, MLflow stores)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dskit import cli
from dskit import eval as dskit_eval
from support.pretrained import save_tiny_qwen3

TASK = dskit_eval.TASKS_DIR / "dskit_tiny_mc"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("eval") / "model")


def items() -> list[dict]:
    return [json.loads(line) for line in (TASK / "dskit_tiny_mc.jsonl").read_text().splitlines()]


def test_the_shipped_task_is_a_few_dozen_well_formed_items() -> None:
    assert dskit_eval.shipped_tasks() == {"dskit_tiny_mc": TASK / "dskit_tiny_mc.yaml"}
    questions = items()
    assert len(questions) == 40 and len({q["question"] for q in questions}) == 40
    for q in questions:
        assert len(q["choices"]) == 4 and len(set(q["choices"])) == 4 and 0 <= q["answer"] < 4, q
    # The gold answer is spread over the positions: a model that always picks one position scores 25%.
    assert sorted({q["answer"] for q in questions}) == [0, 1, 2, 3]


def direct_accuracy(model_dir: Path) -> float:
    """The task's accuracy computed here from the model's token log-probabilities: the choice whose tokens
    (after "Question: ...\\nAnswer:" and a space) are the most likely, against the gold index."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0
    for q in items():
        context = f"Question: {q['question']}\nAnswer:"
        scores = []
        for choice in q["choices"]:
            whole = tokenizer(context + " " + choice)["input_ids"]
            n_context = len(tokenizer(context)["input_ids"])
            with torch.no_grad():
                logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
            scores.append(sum(logprobs[i - 1, whole[i]].item() for i in range(n_context, len(whole))))
        right += max(range(4), key=scores.__getitem__) == q["answer"]
    return right / len(items())


def test_eval_of_a_model_dir_offline_scores_what_the_model_says(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the task's data_files are found from the YAML's folder, not the cwd
    out = tmp_path / "result.json"
    argv = ["eval", str(tiny_model_dir), "--tasks", "dskit_tiny_mc", "--dtype", "fp32", "--output", str(out)]
    assert cli.main(argv) == 0
    result = dskit_eval.EvalResult.from_dict(json.loads(out.read_text()))
    assert result.samples == {"dskit_tiny_mc": 40}
    metrics = result.metrics["dskit_tiny_mc"]
    assert set(metrics) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert metrics["acc"] == pytest.approx(direct_accuracy(tiny_model_dir))
    # an export names no training run: nothing recorded, and the model evaluated is the dir given
    assert result.checkpoint is None and result.step is None and result.recorded == []
    assert result.model == str(tiny_model_dir) and result.seconds > 0
    stdout = capsys.readouterr().out
    assert f"dskit_tiny_mc: acc {metrics['acc']:.4f} ± {metrics['acc_stderr']:.4f}, acc_norm " in stdout
    assert "(40 items)" in stdout and "evaluated 1 task(s) in " in stdout


def test_task_metrics_keep_finite_numbers_and_name_filters() -> None:
    results = {
        "t": {"alias": "t", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": "N/A", "ppl,none": math.inf},
        "g": {"exact_match,strict-match": 0.25, "exact_match,none": 1},
    }
    assert dskit_eval.task_metrics(results) == {
        "t": {"acc": 0.5},
        "g": {"exact_match_strict-match": 0.25, "exact_match": 1.0},
    }
    assert dskit_eval.tracker_record({"t": {"acc": 0.5}}) == {"eval/t/acc": 0.5}


BAD_INPUT = {
    "missing path": (["{tmp}/nope", "--tasks", "dskit_tiny_mc"], "{tmp}/nope does not exist: pass a run's"),
    "a file, not a dir": (["{tmp}/file", "--tasks", "dskit_tiny_mc"], "{tmp}/file is not a directory"),
    "missing task file": (["{model}", "--tasks", "{tmp}/t.yaml"], "task file {tmp}/t.yaml not found"),
    "no tasks": (["{model}", "--tasks", " , "], "--tasks is empty: name one or more tasks"),
    "tracker for an export": (
        ["{model}", "--tasks", "dskit_tiny_mc", "--report_to", "mlflow"],
        "is an exported model dir, which names no training run to record into",
    ),
    "unknown tracker": (
        ["{model}", "--tasks", "dskit_tiny_mc", "--report_to", "neptune"],
        "'neptune' is not a",
    ),
    "export dir for an export": (
        ["{model}", "--tasks", "dskit_tiny_mc", "--export_dir", "{tmp}/x"],
        "is already a model dir: drop --export_dir",
    ),
    "no checkpoint in the dir": (
        ["{tmp}/empty", "--tasks", "dskit_tiny_mc"],
        "{tmp}/empty holds no verified checkpoint and is not a checkpoint tag dir",
    ),
    "zero batch": (["{model}", "--tasks", "dskit_tiny_mc", "--batch_size", "0"], "--batch_size and --limit"),
    "unknown dtype": (["{model}", "--tasks", "dskit_tiny_mc", "--dtype", "fp8"], "invalid choice: 'fp8'"),
    "chat tasks of a model without a template": (
        ["{model}", "--tasks", "dskit_tiny_mc", "--apply_chat_template"],
        "{model} has no chat template (its run trained with none and its tokenizer has none): drop "
        "--apply_chat_template",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_writes_nothing(
    case: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "empty").mkdir()
    args, needle = BAD_INPUT[case]
    fill = {"tmp": tmp_path, "model": tiny_model_dir}
    before = sorted(tiny_model_dir.iterdir())
    out = tmp_path / "result.json"
    assert cli.main(["eval", *(a.format(**fill) for a in args), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle.format(**fill) in err[0], err
    assert not out.exists() and not (tmp_path / "x").exists() and sorted(tiny_model_dir.iterdir()) == before


def test_an_interpreter_without_lm_eval_is_told_how_to_get_it(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A container's DSKIT_PYTHON: the training needs no lm-eval (dskit.env.python_env does not ask for it).
    monkeypatch.setattr(dskit_eval, "LM_EVAL", "lm_eval_not_installed")
    assert cli.main(["eval", str(tiny_model_dir), "--tasks", "dskit_tiny_mc"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("error: lm-eval (lm-evaluation-harness) is not installed in ")
    assert "`uv sync --frozen` installs it" in err


def test_an_unknown_task_name_says_what_names_are_taken(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not shipped, not a file: looked up in lm-eval's own registry (its index of a few thousand tasks).
    assert cli.main(["eval", str(tiny_model_dir), "--tasks", "dskit_tiny_mcq"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err == (
        "error: unknown task 'dskit_tiny_mcq': did you mean dskit_tiny_mc? use a task shipped with dskit "
        "(dskit_tiny_mc), an lm-eval task name, or the path of a task YAML file"
    )


TEXT_TASK = """\
task: tiny_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: text.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""
DOCS = [
    "The cat sat on the mat and looked at the birds in the garden.",
    "Rain fell all night, and in the morning the river was high and brown.",
]


def test_a_text_tasks_loglikelihood_is_the_validation_loss_of_its_tokens(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relation between the job's numbers and the in-loop validation loss, on the same text: lm-eval scores
    a document's tokens after one EOS (this tokenizer has no BOS), as a validation block scores a document that
    follows an EOS (with --packing documents nothing before it is seen). So the sum of the documents' token
    losses, nats, is bits_per_byte x bytes x ln 2 = ln(word_perplexity) x words: the validation loss of those
    tokens x their count. A YAML file of the user's, its data relative to it, loaded from another cwd."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "tiny_text.yaml").write_text(TEXT_TASK)
    (task_dir / "text.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    result = dskit_eval.evaluate(
        tiny_model_dir, ["tasks/tiny_text.yaml"], dtype="fp32", on_line=lambda _: None
    )
    metrics = result.metrics["tiny_text"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert tokenizer.bos_token_id is None
    total_nats, tokens = 0.0, 0
    for doc in DOCS:
        ids = torch.tensor([[tokenizer.eos_token_id, *tokenizer(doc)["input_ids"]]])
        with torch.no_grad():
            loss = model(
                input_ids=ids, labels=ids
            ).loss.item()  # a validation block's loss: mean over targets
        total_nats += loss * (ids.shape[1] - 1)
        tokens += ids.shape[1] - 1
    n_bytes = sum(len(d.encode()) for d in DOCS)
    n_words = sum(len(d.split()) for d in DOCS)
    assert metrics["bits_per_byte"] * n_bytes * math.log(2) == pytest.approx(total_nats, rel=1e-4)
    assert math.log(metrics["word_perplexity"]) * n_words == pytest.approx(total_nats, rel=1e-4)
    assert total_nats / tokens > 0  # the validation loss those tokens would log


CHAT_TASK = """\
task: tiny_chat
dataset_path: json
dataset_kwargs:
  data_files:
    test: qa.jsonl
test_split: test
output_type: loglikelihood
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: perplexity
metadata:
  version: 1.0
"""
QA = [
    {"question": "What color is the sky on a clear day?", "answer": "Blue."},
    {"question": "How many legs does a spider have?", "answer": "Eight."},
]


def perplexity(model_dir: Path, chat: bool) -> float:
    """exp(-mean log-likelihood of each answer right after its question): plain, or in the model's chat template
    (the question as the user's turn, then the generation prompt), the context's trailing space moved to the
    answer as lm-eval's HFLM does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0.0
    for doc in QA:
        context = doc["question"]
        if chat:
            turn = [{"role": "user", "content": doc["question"]}]
            context = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        whole = tokenizer(context + doc["answer"])["input_ids"]
        n_context = len(tokenizer(context.rstrip())["input_ids"])
        with torch.no_grad():
            logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
        total += sum(logprobs[i - 1, whole[i]].item() for i in range(n_context, len(whole)))
    return math.exp(-total / len(QA))


def test_chat_tasks_prompt_the_model_in_the_template_its_export_carries(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--apply_chat_template: each request in the chat template the model dir's tokenizer holds (what a run's
    export carries: the template the run trained with), not the plain prompt."""
    import shutil

    from transformers import AutoTokenizer

    from model_utils.assets import CHAT_TEMPLATE_PATH

    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE_PATH.read_text()
    tokenizer.save_pretrained(model_dir)
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "tiny_chat.yaml").write_text(CHAT_TASK)
    (task_dir / "qa.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in QA))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = [str(task_dir / "tiny_chat.yaml")]
    chat = dskit_eval.evaluate(
        model_dir, task, dtype="fp32", apply_chat_template=True, on_line=lambda _: None
    )
    plain = dskit_eval.evaluate(model_dir, task, dtype="fp32", on_line=lambda _: None)
    in_template = chat.metrics["tiny_chat"]["perplexity"]
    assert in_template == pytest.approx(perplexity(model_dir, chat=True), rel=1e-5)
    assert plain.metrics["tiny_chat"]["perplexity"] == pytest.approx(
        perplexity(model_dir, chat=False), rel=1e-5
    )
    assert abs(in_template / plain.metrics["tiny_chat"]["perplexity"] - 1) > 1e-3  # the template changes it
