"""Private adapters: each method saves only what it trained and reloads onto a fresh base with identical logits."""

from __future__ import annotations

import os

import pytest
import torch
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import DataCollatorWithPadding, TrainerCallback

from hf_private import BitFitConfig, DPConfig, PrivateTrainer, load_private_adapter
from hf_private.methods import MethodConfig
from hf_private.release.adapters import ADAPTER_WEIGHTS_NAME
from tests.support import tiny
from tests.support.helpers import KillAtStep, eval_logits, make_trainer, training_args


def _frozen_embeddings_bert():
    model = tiny.bert()
    model.bert.embeddings.requires_grad_(False)
    return model


def _lora_roberta():
    return get_peft_model(tiny.roberta(), LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8))


# name: (model factory, fresh-base factory, dp config, extra TrainingArguments, expected format, files that must exist)
CASES = {
    "dpsgd-full": (
        tiny.bert,
        tiny.bert,
        DPConfig(noise_multiplier=1.0),
        dict(max_steps=2),
        "full",
        {"model.safetensors", "config.json"},
    ),
    "dpsgd-partial": (
        _frozen_embeddings_bert,
        tiny.bert,
        DPConfig(noise_multiplier=1.0),
        dict(max_steps=2),
        "private_adapter",
        {ADAPTER_WEIGHTS_NAME},
    ),
    "lora": (
        _lora_roberta,
        tiny.roberta,
        DPConfig(noise_multiplier=1.0),
        dict(max_steps=2),
        "peft",
        {"adapter_model.safetensors", "adapter_config.json"},
    ),
    "bitfit": (
        tiny.roberta,
        tiny.roberta,
        BitFitConfig(noise_multiplier=1.0),
        dict(max_steps=2),
        "private_adapter",
        {ADAPTER_WEIGHTS_NAME},
    ),
    "bitfit-two-phase": (
        tiny.roberta,
        tiny.roberta,
        BitFitConfig(noise_multiplier=1.0, full_finetune_epochs=1),
        dict(num_train_epochs=2, per_device_train_batch_size=48),
        "full",
        {"model.safetensors"},
    ),
}


def _batch():
    rows = tiny.sentiment_dataset(6, seed=5)[:6]
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in rows["input_ids"]], batch_first=True)
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def _logits(model) -> torch.Tensor:
    return eval_logits(model, _batch())


@pytest.mark.parametrize("case", list(CASES))
def test_saved_adapter_reloads_onto_a_fresh_base_with_identical_logits(tmp_path, case):
    make_model, make_base, dp, overrides, fmt, files = CASES[case]
    trainer = make_trainer(tmp_path, model=make_model(), dp=dp, **overrides)
    trainer.train()
    trainer.save_model()
    assert trainer.adapter_format == fmt
    written = set(os.listdir(tmp_path))
    assert files | {"dp_config.json", "privacy_ledger.json", "README.md"} <= written
    if fmt != "full":
        assert "model.safetensors" not in written, "an adapter must not carry the frozen base weights"
    assert MethodConfig.from_pretrained(tmp_path) == dp

    trained = _logits(trainer.model)
    base = make_base()
    assert not torch.allclose(_logits(base), trained), "training changed nothing, so the test could not fail"
    loaded = load_private_adapter(base, tmp_path)
    assert isinstance(loaded, PeftModel) == (fmt == "peft")
    assert torch.equal(_logits(loaded), trained)


def test_bitfit_adapter_holds_exactly_the_trained_tensors(tmp_path):
    trainer = make_trainer(tmp_path, model=tiny.roberta(), dp=BitFitConfig(noise_multiplier=1.0), max_steps=1)
    trainer.train()
    trainer.save_model()
    with safe_open(tmp_path / ADAPTER_WEIGHTS_NAME, framework="pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert keys == trainable and all(k.endswith(".bias") or k.startswith("classifier.") for k in keys)
    assert metadata["model_class"] == "RobertaForSequenceClassification" and metadata["base_fingerprint"]

    card = ModelCard.load(tmp_path / "README.md")
    assert "load_private_adapter(base" in card.text and "num_labels=2" in card.text
    assert "private_adapter.safetensors" in card.text and card.data.library_name == "transformers"


def test_a_different_base_is_refused_unless_told(tmp_path):
    trainer = make_trainer(tmp_path, model=tiny.roberta(), dp=BitFitConfig(noise_multiplier=1.0), max_steps=1)
    trainer.train()
    trainer.save_model()
    other = tiny.roberta()
    with torch.no_grad():
        other.roberta.encoder.layer[0].attention.self.query.weight.add_(0.1)
    with pytest.raises(ValueError, match="frozen weights differ"):
        load_private_adapter(other, tmp_path)
    load_private_adapter(other, tmp_path, check_base=False)
    with pytest.raises(ValueError, match="Shape mismatch"):
        load_private_adapter(tiny.roberta(num_labels=3), tmp_path)


def test_missing_adapters_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no adapter"):
        load_private_adapter(tiny.bert(), tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a valid Hub repo id"):
        load_private_adapter(tiny.bert(), "./no/such/adapter")
    with pytest.raises(ValueError, match="plain base model"):
        load_private_adapter(_lora_roberta(), tmp_path)


class _BiasAtStart(TrainerCallback):
    def __init__(self):
        self.value = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.value = model.classifier.out_proj.bias.detach().clone()


def test_adapter_checkpoints_resume_and_load_the_best(tmp_path):
    dp = BitFitConfig(noise_multiplier=1.0)
    args = dict(max_steps=4, save_strategy="steps", save_steps=2)
    run = make_trainer(tmp_path, model=tiny.roberta(), dp=dp, **args)
    run.add_callback(KillAtStep(at_step=3))
    with pytest.raises(KeyboardInterrupt):
        run.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / ADAPTER_WEIGHTS_NAME).is_file() and not (checkpoint / "model.safetensors").exists()

    resumed = make_trainer(tmp_path, model=tiny.roberta(), dp=dp, **args)
    start = _BiasAtStart()
    resumed.add_callback(start)
    resumed.train(resume_from_checkpoint=True)
    with safe_open(checkpoint / ADAPTER_WEIGHTS_NAME, framework="pt") as f:
        assert torch.equal(start.value, f.get_tensor("classifier.out_proj.bias")), "resume must load the adapter"
    assert resumed.ledger.total_steps == 4

    tok = tiny.tokenizer()
    best = PrivateTrainer(
        model=tiny.roberta(),
        train_dataset=tiny.sentiment_dataset(96),
        eval_dataset=tiny.sentiment_dataset(32, seed=3),
        args=training_args(
            tmp_path / "best",
            eval_strategy="steps",
            eval_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="loss",
            **args,
        ),
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=dp,
    )
    best.train()
    chosen = best.state.best_model_checkpoint
    with safe_open(os.path.join(chosen, ADAPTER_WEIGHTS_NAME), framework="pt") as f:
        assert torch.equal(best.model.classifier.out_proj.bias, f.get_tensor("classifier.out_proj.bias"))
