"""What a Trainer user sets is honoured, and the run says what it does (refusals: tests/trainer/test_preflight.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import (
    BertForTokenClassification,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    Trainer,
)
from transformers.trainer_pt_utils import LabelSmoother
from transformers.utils import logging as transformers_logging

from hf_private import DPConfig, PrivateTrainer
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny
from tests.support.helpers import doc_block, make_trainer, snapshot, training_args

HF_LOGGER = "transformers.hf_private"


def test_group_by_length_sorts_each_poisson_batch_into_chunks(tmp_path):
    """Same Poisson batches (same test seed), each ordered by length before it is cut into chunks: less padding,
    the same examples, and training runs on them."""
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=3)

    def steps(strategy: str) -> list[list[torch.Tensor]]:
        trainer = make_trainer(
            tmp_path / strategy,
            dp=dp,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            train_sampling_strategy=strategy,
        )
        batches = iter(trainer.get_train_dataloader())
        return [[next(batches)["attention_mask"] for _ in range(4)] for _ in range(6)]

    plain, grouped = steps("random"), steps("group_by_length")
    padded = {"random": 0, "group_by_length": 0}
    for plain_chunks, grouped_chunks in zip(plain, grouped):
        lengths = [int(n) for chunk in grouped_chunks for n in chunk.sum(1)]
        assert lengths == sorted(lengths)
        assert lengths == sorted(int(n) for chunk in plain_chunks for n in chunk.sum(1))
        padded["random"] += sum(c.numel() for c in plain_chunks)
        padded["group_by_length"] += sum(c.numel() for c in grouped_chunks)
    assert padded["group_by_length"] < padded["random"]
    trainer = make_trainer(tmp_path / "train", dp=dp, train_sampling_strategy="group_by_length", max_steps=2)
    trainer.train()
    assert trainer.privacy_report()["steps"] == 2


# ---------------------------------------------------------------- max_grad_norm: replaced, and said so
def test_user_max_grad_norm_is_replaced_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=HF_LOGGER):
        trainer = make_trainer(tmp_path, max_grad_norm=0.1)
    assert trainer.args.max_grad_norm == 0
    assert "max_grad_norm=0.1 is not used" in caplog.text and "C=1" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=HF_LOGGER):
        default = make_trainer(tmp_path)  # TrainingArguments' own default 1.0, never set by the user
    assert default.args.max_grad_norm == 0 and "max_grad_norm" not in caplog.text


# ---------------------------------------------------------------- the default per-example loss is the model's own
def _multi_label_bert():
    model = tiny.bert(num_labels=3, problem_type="multi_label_classification")
    return model, {"labels": torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])}


def _regression_bert():
    return tiny.bert(num_labels=1), {"labels": torch.tensor([0.5, -1.0, 2.0])}


def _token_bert():
    torch.manual_seed(0)
    model = BertForTokenClassification(tiny.bert().config)
    return model, {"labels": torch.tensor([[-100, 1, 0, 1, -100], [-100, 0, 0, 1, -100], [-100, 1, 1, 0, -100]])}


def _causal_gpt2():
    ids = torch.tensor([[5, 9, 12, 7, 30], [6, 8, 20, 22, 31], [4, 11, 13, 25, 26]])
    return tiny.gpt2(), {"labels": ids.clone()}


@pytest.mark.parametrize("build", [_multi_label_bert, _regression_bert, _token_bert, _causal_gpt2])
def test_default_per_example_loss_is_the_models_own_loss_per_example(build):
    model, extra = build()
    model.eval()
    inputs = {"input_ids": torch.tensor([[2, 5, 9, 12, 3], [2, 6, 8, 20, 3], [2, 4, 11, 13, 3]])}
    if "ForCausalLM" in type(model).__name__ or "LMHead" in type(model).__name__:
        inputs = {"input_ids": extra["labels"]}
    labels = extra["labels"]
    with torch.no_grad():
        ours = default_per_example_loss(model, model(**inputs), labels)
        own = torch.stack(
            [
                model(**{k: v[i : i + 1] for k, v in inputs.items()}, labels=labels[i : i + 1]).loss
                for i in range(len(labels))
            ]
        )
    torch.testing.assert_close(ours, own.float(), rtol=1e-5, atol=1e-6)


def test_label_smoothing_is_applied_per_example_as_trainer_does(tmp_path):
    trainer = make_trainer(tmp_path, label_smoothing_factor=0.2)
    model = trainer.model.eval()
    inputs = {"input_ids": torch.tensor([[2, 5, 9, 3], [2, 6, 8, 3]]), "labels": torch.tensor([1, 0])}
    with torch.no_grad():
        outputs = model(input_ids=inputs["input_ids"])
        ours = trainer.per_example_loss(model, outputs, inputs["labels"])
        smoother = LabelSmoother(epsilon=0.2)
        hf = torch.stack(
            [smoother(type(outputs)(logits=outputs.logits[i : i + 1]), inputs["labels"][i : i + 1]) for i in range(2)]
        )
        plain = default_per_example_loss(model, outputs, inputs["labels"])
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours, plain)
    regression = tiny.bert(num_labels=1)
    with pytest.raises(ValueError, match="no meaning for regression"):
        default_per_example_loss(
            regression, regression(input_ids=inputs["input_ids"]), torch.tensor([0.1, 0.2]), label_smoothing=0.2
        )


# ---------------------------------------------------------------- the run says what it does
def test_messages_follow_transformers_verbosity():
    logger = logging.getLogger(f"{HF_LOGGER}.trainer")
    before = transformers_logging.get_verbosity()
    own_level = logging.getLogger(HF_LOGGER).level  # a script (the recipe) may set hf_private's level itself
    logging.getLogger(HF_LOGGER).setLevel(logging.NOTSET)
    try:
        transformers_logging.set_verbosity_error()
        assert not logger.isEnabledFor(logging.WARNING)
        transformers_logging.set_verbosity_warning()  # transformers' default
        assert logger.isEnabledFor(logging.WARNING) and not logger.isEnabledFor(logging.INFO)
        transformers_logging.set_verbosity_info()
        assert logger.isEnabledFor(logging.INFO)
    finally:
        transformers_logging.set_verbosity(before)
        logging.getLogger(HF_LOGGER).setLevel(own_level)


def test_plan_is_logged_and_heavy_noise_is_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=HF_LOGGER):
        make_trainer(tmp_path, dp=DPConfig(target_epsilon=8.0), per_device_train_batch_size=16, num_train_epochs=2)
    plan = [r for r in caplog.records if "Private training plan" in r.getMessage()]
    assert len(plan) == 1 and plan[0].levelno == logging.WARNING  # transformers' default verbosity shows it
    for field in ("N=96", "q=0.16667", "expected logical batch 16", "σ=", "C=1", "δ=", "prv accountant", "target ε=8"):
        assert field in plan[0].getMessage()
    assert not [r for r in caplog.records if "mostly noise" in r.getMessage()]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=HF_LOGGER):
        make_trainer(tmp_path, dp=DPConfig(target_epsilon=0.5), per_device_train_batch_size=4, num_train_epochs=3)
    noisy = [r for r in caplog.records if "mostly noise" in r.getMessage()]
    assert len(noisy) == 1 and noisy[0].levelno == logging.WARNING
    assert "larger logical batch" in noisy[0].getMessage()


# ---------------------------------------------------------------- the budget
def test_resuming_with_the_budget_spent_says_so_and_takes_no_step(tmp_path, caplog):
    dp = DPConfig(target_epsilon=2.0)
    first = make_trainer(tmp_path, dp=dp, max_steps=4, save_strategy="steps", save_steps=2)
    first.args.max_steps = 40
    first.train()
    spent = first.ledger.total_steps
    checkpoint = tmp_path / f"checkpoint-{spent}"
    first.save_model(str(checkpoint))  # what the budget stop leaves, whatever save_steps hit
    trained = snapshot(first.model)

    resumed = make_trainer(tmp_path, dp=dp, max_steps=40)
    with caplog.at_level(logging.WARNING, logger=HF_LOGGER):
        output = resumed.train(resume_from_checkpoint=str(checkpoint))
    assert "budget is already spent" in caplog.text and "takes no step" in caplog.text
    assert resumed.ledger.total_steps == spent and output.global_step == spent
    assert output.metrics["steps_taken"] == 0 and math.isnan(output.training_loss)
    assert output.metrics["epsilon"] == pytest.approx(first.ledger.epsilon(), rel=1e-12)
    reloaded = snapshot(resumed.model)
    assert all(torch.equal(reloaded[k], v) for k, v in trained.items() if k.startswith("param:"))


def test_causal_lm_collator_and_plain_trainer_interface_still_work(tmp_path):
    """The refusals look at settings, not at ordinary use: a GPT-2 LM run constructs and trains one step."""
    tok = tiny.tokenizer()
    trainer = PrivateTrainer(
        tiny.gpt2(),
        training_args(tmp_path, max_steps=1),
        train_dataset=tiny.lm_dataset(32),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        dp_config=DPConfig(noise_multiplier=1.0, noise_seed=0),
    )
    assert isinstance(trainer, Trainer)
    trainer.train()
    assert trainer.ledger.total_steps == 1


def test_docs_per_example_loss_example_trains(tmp_path):
    """The custom-loss example of docs/guides/custom-losses.md, executed as written (so the documentation stays
    true)."""
    block = doc_block("guides/custom-losses.md")
    namespace = {
        "PrivateTrainer": PrivateTrainer,
        "model": tiny.bert(),
        "args": training_args(tmp_path, max_steps=2),
        "train": tiny.sentiment_dataset(32),
        "cfg": DPConfig(noise_multiplier=1.0, noise_seed=0),
    }
    exec(block, namespace)
    trainer = namespace["trainer"]
    trainer.data_collator = DataCollatorWithPadding(tiny.tokenizer())
    before = snapshot(trainer.model)
    trainer.train()
    assert trainer.ledger.total_steps == 2
    assert any(not torch.equal(before[f"param:{n}"], p) for n, p in trainer.model.named_parameters())
