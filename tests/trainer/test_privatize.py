"""privatize(TrainerClass), end to end: the private subclass of a Trainer keeps the class's own evaluation, metrics,
callbacks and collator, and trains privately.

- `privatize(Seq2SeqTrainer)` with `predict_with_generate=True` on decoder-only models: training rows right-padded,
  prompts left-padded (as generation wants) by the tokenizer, one `DataCollatorForLanguageModeling` for both;
  `evaluate()` (during and after training) and `predict()` hand compute_metrics what `model.generate` gives.
- A user's Trainer subclass with its own logged metric and a callback, privatized.
- What privatize() accepts and returns; encoder-decoder models build a private Seq2SeqTrainer.
- The docs' "Any Trainer: privatize()" script (docs/guides/privatize.md), run as written.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from huggingface_hub import ModelCard
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainerCallback,
)

import hf_private.trainer.mixin as trainer_module
from hf_private import DPConfig, PrivateTrainer, privatize
from hf_private.demos.sentiment import sentiment_texts
from hf_private.optimizer import NoisyOptimizer, noisy_optimizer
from hf_private.trainer.mixin import PrivateTrainingMixin
from tests.support import tiny
from tests.support.helpers import run_doc_block, training_args

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = 5  # prompt tokens: the first 2-4 words of a review, left-padded to this length
GENERATED = PROMPT + 4  # generation_max_length: prompt and 4 new tokens
TRAIN_SIZE, BATCH = 64, 8  # 8 steps of an expected 8 examples


# ---------------------------------------------------------------- privatize(Seq2SeqTrainer) on a decoder-only model
def prompts(n: int = 10, seed: int = 7) -> Dataset:
    """Openings of reviews the training set does not hold, left-padded to PROMPT tokens when tokenized."""
    texts, _ = sentiment_texts(n, seed)
    openings = [" ".join(text.split()[: 2 + i % 3]) for i, text in enumerate(texts)]
    encoded = tiny.tokenizer()(openings, padding="max_length", max_length=PROMPT, padding_side="left")
    return Dataset.from_dict(dict(encoded))


def repeats(token_ids: np.ndarray) -> float:
    """The metric: how often a new token repeats the prompt's last token (any function of the generated ids)."""
    return float((token_ids[:, PROMPT:] == token_ids[:, PROMPT - 1 : PROMPT]).mean())


def generate(model, dataset: Dataset, width: int, pad: int, **generation) -> np.ndarray:
    """`model.generate` on the prompts, padded on the right to `width` as Seq2SeqTrainer pads its predictions."""
    model.eval()
    with torch.no_grad():
        ids = model.generate(
            input_ids=torch.tensor(dataset["input_ids"]),
            attention_mask=torch.tensor(dataset["attention_mask"]),
            **generation,
        ).numpy()
    return np.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=pad)


@pytest.mark.parametrize("make_model, beams", [(tiny.gpt2, 1), (tiny.llama, 2)], ids=["gpt2-greedy", "llama-beams"])
def test_seq2seq_trainer_evaluates_a_decoder_only_model_by_generation(tmp_path, make_model, beams):
    tok = tiny.tokenizer()
    evaluation = prompts()
    received = []  # the EvalPrediction of every compute_metrics call

    def compute_metrics(prediction):
        received.append(prediction)
        return {"repeats": repeats(prediction.predictions)}

    args = Seq2SeqTrainingArguments(
        str(tmp_path),
        predict_with_generate=True,
        generation_max_length=GENERATED,
        generation_num_beams=beams,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=4,
        num_train_epochs=1,
        learning_rate=5e-3,
        eval_strategy="steps",
        eval_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    model = make_model()
    trainer = privatize(Seq2SeqTrainer)(
        model=model,
        args=args,
        train_dataset=tiny.lm_dataset(TRAIN_SIZE),
        eval_dataset=evaluation,
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        compute_metrics=compute_metrics,
        dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
    )
    assert isinstance(trainer, Seq2SeqTrainer)
    trainer.train()

    report = trainer.privacy_report()
    assert trainer.training_steps() == trainer.state.global_step == TRAIN_SIZE // BATCH
    assert report["guarantee"] == "formal" and math.isfinite(report["epsilon"]) and report["epsilon"] > 0
    # evaluated at steps 4 and 8, during training, by generation
    assert [entry["step"] for entry in trainer.state.log_history if "eval_repeats" in entry] == [4, 8]
    assert len(received) == 2

    width = max(GENERATED, model.generation_config.max_length)  # Seq2SeqTrainer pads to the generation config's
    expected = generate(model, evaluation, width, tok.pad_token_id, max_length=GENERATED, num_beams=beams)

    metrics = trainer.evaluate()
    generated = received[-1].predictions  # token ids, not teacher-forced logits [N, T, vocab]
    assert generated.dtype.kind == "i" and generated.shape == (len(evaluation), width)
    assert (generated[:, :PROMPT] == np.array(evaluation["input_ids"])).all()  # the prompt, then new tokens
    np.testing.assert_array_equal(generated, expected)
    assert metrics["eval_repeats"] == pytest.approx(repeats(expected))

    # evaluate's generation keywords reach Seq2SeqTrainer through the private class
    trainer.evaluate(max_new_tokens=2)
    shorter = received[-1].predictions
    np.testing.assert_array_equal(
        shorter, generate(model, evaluation, width, tok.pad_token_id, max_new_tokens=2, num_beams=beams)
    )

    predicted = trainer.predict(evaluation)
    np.testing.assert_array_equal(predicted.predictions, expected)
    assert predicted.metrics["test_repeats"] == pytest.approx(repeats(expected))

    trainer.save_model(str(tmp_path / "final"))
    card = ModelCard.load(tmp_path / "final" / "README.md")
    assert card.data.to_dict()["privacy"]["epsilon"] == pytest.approx(report["epsilon"])
    published = {m["name"]: m["value"] for m in card.data.to_dict()["model-index"][0]["results"][0]["metrics"]}
    # the card holds the last evaluate() on this set: the one with max_new_tokens=2
    assert published["eval_repeats"] == pytest.approx(round(repeats(shorter), 4))


# ---------------------------------------------------------------- a user's Trainer subclass: its metric and callback
class StepsAndEvaluations(TrainerCallback):
    """Counts Trainer's events."""

    def __init__(self) -> None:
        self.steps = 0
        self.evaluations: list[dict[str, float]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations.append(dict(metrics))


class PerplexityTrainer(Trainer):
    """A user's Trainer: the evaluation perplexity next to the evaluation loss it logs."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "eval_loss" in logs:
            logs["eval_perplexity"] = math.exp(logs["eval_loss"])
        super().log(logs, start_time)


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def test_a_user_trainer_keeps_its_metric_and_callback_and_trains_privately(tmp_path):
    tok = tiny.tokenizer()
    counter = StepsAndEvaluations()
    trainer = privatize(PerplexityTrainer)(
        model=tiny.bert(),
        args=training_args(tmp_path, eval_strategy="steps", eval_steps=3),
        train_dataset=tiny.sentiment_dataset(TRAIN_SIZE),
        eval_dataset=tiny.sentiment_dataset(24, seed=5),
        processing_class=tok,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=accuracy,
        callbacks=[counter],
        dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
    )
    assert isinstance(trainer, PerplexityTrainer)
    trainer.train()
    metrics = trainer.evaluate()

    # private: every step Trainer took is a noised step in the ledger
    steps = TRAIN_SIZE // BATCH
    assert trainer.training_steps() == trainer.state.global_step == counter.steps == steps
    assert trainer.ledger.total_steps == steps
    optimizer = noisy_optimizer(trainer.optimizer)
    assert isinstance(optimizer, NoisyOptimizer) and optimizer.noise_multiplier == 1.0
    assert trainer.privacy_report()["guarantee"] == "formal"
    training_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(training_logs) == steps and all("epsilon" in e and "grad_norm" not in e for e in training_logs)

    # the user's metric: in what evaluate() returns, in the logs, and what the callback saw, at every evaluation
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    # during training at steps 3 and 6 and at its last step (Trainer's own rule), then the evaluate() call
    assert [entry["step"] for entry in evaluations] == [3, 6, steps, steps]
    assert len(counter.evaluations) == len(evaluations)
    for logged, seen in zip(evaluations, counter.evaluations):
        assert logged["eval_perplexity"] == pytest.approx(math.exp(logged["eval_loss"]))
        assert seen["eval_perplexity"] == logged["eval_perplexity"] and "eval_accuracy" in seen
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))


class FlaggedTrainer(Trainer):
    """A user's Trainer that passes Trainer's arguments on as *args, **kwargs and takes a keyword of its own."""

    def __init__(self, *args, shout: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shout = shout


def test_a_user_trainer_with_args_and_its_own_keyword_gets_both(tmp_path):
    """Positional arguments are named as Trainer names them (the model is wrapped in its place), the user's own
    keyword reaches the user's __init__."""
    tok = tiny.tokenizer()
    trainer = privatize(FlaggedTrainer)(
        tiny.bert(),
        training_args(tmp_path),
        DataCollatorWithPadding(tok),
        tiny.sentiment_dataset(TRAIN_SIZE),
        processing_class=tok,
        shout=True,
        dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
    )
    assert trainer.shout and trainer.dataset_size == TRAIN_SIZE and trainer.args.output_dir == str(tmp_path)
    trainer.train()
    assert trainer.training_steps() > 0


# ---------------------------------------------------------------- a user's compute_loss: what trains is what is probed
CLIP = 0.01  # below every example's gradient norm here: each clipped term has norm C


def hardest_half_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """Online hard-example mining as a compute_loss: the sum of the batch's larger half of losses (couples examples)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    losses = F.cross_entropy(outputs.logits, labels, reduction="none")
    loss = losses.topk(max(1, len(losses) // 2)).values.sum()
    return (loss, outputs) if return_outputs else loss


def cross_entropy(model, outputs, labels):
    return F.cross_entropy(outputs.logits, labels, reduction="none")


class HardExampleMixin:
    """A plain mixin (not a Trainer) with the hard-example loss."""

    compute_loss = hardest_half_loss


LOSS_SETUPS = {
    "subclass": type("HardExampleTrainer", (PrivateTrainer,), {"compute_loss": hardest_half_loss}),
    "mixin-first": type("MixedHardExampleTrainer", (HardExampleMixin, PrivateTrainer), {}),
}


def released_sum(tmp_path, trainer_class: type, dataset: Dataset, **trainer_kwargs) -> torch.Tensor:
    """Σ of the clipped per-example gradients plus the replayed noise: one SGD step at q = 1, (θ0 − θ1)·B/lr."""
    model = tiny.bert()
    trained = [p for p in model.parameters() if p.requires_grad]
    before = torch.cat([p.detach().flatten() for p in trained]).double()
    tok = tiny.tokenizer()
    trainer = trainer_class(
        model=model,
        args=training_args(
            tmp_path,
            per_device_train_batch_size=len(dataset),
            max_steps=1,
            learning_rate=1.0,
            optim="sgd",
            lr_scheduler_type="constant",
            weight_decay=0.0,
        ),
        train_dataset=dataset,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=DPConfig(noise_multiplier=0.5, max_grad_norm=CLIP, noise_seed=0),
        **trainer_kwargs,
    )
    assert trainer.sample_rate == 1.0
    trainer.train()
    return (before - torch.cat([p.detach().flatten() for p in trained]).double()) * len(dataset)


def moved_by_one_example(tmp_path, trainer_class: type, **trainer_kwargs) -> float:
    """How far adding one mislabelled example moves the release (the noise replayed by noise_seed), in units of C."""
    rows = [dict(row) for row in tiny.sentiment_dataset(9, seed=5)]
    rows[-1]["label"] = 1 - rows[-1]["label"]  # a hard example: it enters the hardest half
    with_it = released_sum(tmp_path / "with", trainer_class, Dataset.from_list(rows), **trainer_kwargs)
    without = released_sum(tmp_path / "without", trainer_class, Dataset.from_list(rows[:-1]), **trainer_kwargs)
    return float((with_it - without).norm()) / CLIP


@pytest.mark.parametrize("setup", sorted(LOSS_SETUPS))
def test_an_overridden_compute_loss_never_trains_when_per_example_loss_is_given(tmp_path, setup):
    """The hard-example loss serves evaluation only: training's loss is per_example_loss, so one example moves the
    release by at most C (the hard-example loss moved it by 1.88·C: the example enters the hardest half, another
    leaves it)."""
    assert 0.5 < moved_by_one_example(tmp_path, LOSS_SETUPS[setup], per_example_loss=cross_entropy) <= 1 + 1e-4


def test_mutation_training_through_compute_loss_moves_the_release_by_more_than_C(tmp_path, monkeypatch):
    """Each chunk through Trainer.training_step (and so self.compute_loss), as before: the sensitivity exceeds C."""
    monkeypatch.setattr(
        PrivateTrainingMixin, "_chunk_step", lambda self, model, inputs: Trainer.training_step(self, model, inputs)
    )
    assert moved_by_one_example(tmp_path, LOSS_SETUPS["subclass"], per_example_loss=cross_entropy) > 1.5


def larger_half_losses(model, outputs, labels):
    """A coupled per_example_loss: the losses of the chunk's smaller half zeroed (hard-example mining)."""
    losses = F.cross_entropy(outputs.logits, labels, reduction="none")
    return losses * (losses >= losses.median())


def coupled_loss_trainer(tmp_path) -> PrivateTrainer:
    tok = tiny.tokenizer()
    return PrivateTrainer(
        model=tiny.bert(),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=tiny.sentiment_dataset(TRAIN_SIZE),
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
        per_example_loss=larger_half_losses,
    )


def test_the_independence_probe_recomputes_the_loss_that_trains(tmp_path):
    """One code path: a coupled per_example_loss is what the probe recomputes, and is refused before any release."""
    trainer = coupled_loss_trainer(tmp_path)
    with pytest.raises(ValueError, match="depends on the other examples"):
        trainer.train()
    assert trainer.ledger.total_steps == 0


def test_mutation_a_probe_on_another_loss_lets_the_coupled_loss_train(tmp_path, monkeypatch):
    """The probe given the default loss instead of the one that trains: the coupled loss passes and is released."""

    def default_loss(model, batch):
        batch = dict(batch)
        labels = batch.pop("labels")
        return F.cross_entropy(model(**batch).logits, labels, reduction="sum")

    probe = trainer_module.probe_example_independence
    monkeypatch.setattr(
        trainer_module,
        "probe_example_independence",
        lambda engine, model, chunks, summed_loss, low: probe(engine, model, chunks, default_loss, low),
    )
    trainer = coupled_loss_trainer(tmp_path)
    trainer.train()
    assert trainer.ledger.total_steps == 1


# ---------------------------------------------------------------- what privatize() takes and returns
def test_privatize_returns_one_private_subclass_per_trainer_class():
    assert privatize(Trainer) is PrivateTrainer
    private = privatize(Seq2SeqTrainer)
    assert privatize(Seq2SeqTrainer) is private and privatize(private) is private
    assert issubclass(private, Seq2SeqTrainer) and private.__name__ == "PrivateSeq2SeqTrainer"
    assert privatize(PerplexityTrainer) is not privatize(Trainer)


@pytest.mark.parametrize(
    "not_a_trainer",
    [torch.nn.Module, TrainerCallback, "Trainer", Trainer.__init__],
    ids=["nn.Module", "TrainerCallback", "str", "function"],
)
def test_privatize_refuses_what_is_not_a_trainer_class(not_a_trainer):
    with pytest.raises(TypeError, match="privatize takes a transformers.Trainer subclass"):
        privatize(not_a_trainer)


def test_a_refused_override_is_named_with_its_class(tmp_path):
    class StepCountingTrainer(Seq2SeqTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch)

    with pytest.raises(TypeError, match=r"StepCountingTrainer overrides training_step\(\)"):
        privatize(StepCountingTrainer)(
            model=tiny.gpt2(),
            args=training_args(tmp_path),
            train_dataset=tiny.lm_dataset(32),
            dp_config=DPConfig(noise_multiplier=1.0),
        )


def _t5():
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=tiny.VOCAB_SIZE,
            d_model=32,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            decoder_start_token_id=0,
        )
    )


def _bart():
    return BartForConditionalGeneration(
        BartConfig(
            vocab_size=tiny.VOCAB_SIZE,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=32,
        )
    )


@pytest.mark.parametrize("make_model", [_t5, _bart], ids=["t5", "bart"])
def test_encoder_decoder_models_build_a_private_seq2seq_trainer(tmp_path, make_model):
    """Refused whole until issue 47; trained and evaluated by generation in tests/models/test_encoder_decoder.py."""
    args = Seq2SeqTrainingArguments(str(tmp_path), predict_with_generate=True, use_cpu=True, report_to="none")
    trainer = privatize(Seq2SeqTrainer)(
        model=make_model(),
        args=args,
        train_dataset=tiny.lm_dataset(32).map(lambda row: {"labels": row["input_ids"]}),  # copy the source
        data_collator=DataCollatorForSeq2Seq(tiny.tokenizer()),
        dp_config=DPConfig(noise_multiplier=1.0),
    )
    assert type(trainer).__name__ == "PrivateSeq2SeqTrainer"


# ---------------------------------------------------------------- the docs' script


def test_docs_privatize_script_runs_as_written(tmp_path, monkeypatch, capsys):
    """The python block under "Any Trainer: privatize()", executed unchanged: a decoder-only model trained privately
    with privatize(Seq2SeqTrainer), evaluated by generation, and a card publishing that metric with ε."""
    namespace = run_doc_block("guides/privatize.md", tmp_path, monkeypatch)

    assert "'eval_verdict_accuracy':" in capsys.readouterr().out
    trainer = namespace["trainer"]
    report = trainer.privacy_report()
    assert type(trainer).__name__ == "PrivateSeq2SeqTrainer" and trainer.args.predict_with_generate
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] <= 8.0
    card = ModelCard.load(next(tmp_path.glob("*/README.md")))
    assert card.data.to_dict()["privacy"]["epsilon"] == pytest.approx(report["epsilon"])
    assert "eval_verdict_accuracy" in card.text
