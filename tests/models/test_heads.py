"""The mean-pooled heads: they load BERT/RoBERTa checkpoints with the encoder's own weights, ignore padding, save and
reload (with their class or the Auto class), train under every DP method, and the checkpoint's sentence-transformers
pooling config picks them (`sentence_classifier`) or makes PrivateTrainer recommend them."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2Model,
    RobertaConfig,
    RobertaModel,
)

from hf_private import (
    BitFitConfig,
    DPConfig,
    DPLoRAConfig,
    MeanPooledBertForSequenceClassification,
    MeanPooledRobertaForSequenceClassification,
    sentence_classifier,
)
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny
from tests.support.helpers import make_trainer

SMALL = dict(
    vocab_size=tiny.VOCAB_SIZE,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=40,
)
ADVICE = "sentence-transformers checkpoint trained with mean pooling"


def _bert_checkpoint(path, pooling: str | None = None, with_head: bool = False):
    """A BERT checkpoint folder (the encoder alone, or a stock classifier), optionally with a sentence-transformers
    pooling config that pools by `pooling` ("mean_tokens", "cls_token")."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**SMALL)) if with_head else BertModel(BertConfig(**SMALL))
    model.save_pretrained(path)
    if pooling:
        (path / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                ]
            )
        )
        (path / "1_Pooling").mkdir()
        modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 16, **{f"pooling_mode_{m}": m == pooling for m in modes}})
        )
    return model


@pytest.mark.parametrize("with_head", [False, True], ids=["encoder checkpoint", "classifier checkpoint"])
def test_loads_the_encoder_weights_without_the_pooler(tmp_path, with_head):
    saved = _bert_checkpoint(tmp_path, with_head=with_head)
    model = MeanPooledBertForSequenceClassification.from_pretrained(tmp_path)
    encoder = saved.bert if with_head else saved
    assert model.bert.pooler is None
    for name, tensor in encoder.state_dict().items():
        if not name.startswith("pooler."):
            assert torch.equal(model.bert.state_dict()[name], tensor), name


def test_averages_the_unpadded_token_states_only():
    model = tiny.mean_pooled_bert().eval()
    ids, padded = torch.tensor([[2, 4, 9, 3]]), torch.tensor([[2, 4, 9, 3, 0, 0]])
    with torch.no_grad():
        alone = model(ids, attention_mask=torch.ones_like(ids)).logits
        with_padding = model(padded, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]])).logits
        states = model.bert(ids).last_hidden_state
    torch.testing.assert_close(with_padding, alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone, model.classifier(states.mean(1)))


def test_saved_head_reloads_with_its_class_and_the_auto_class(tmp_path):
    _bert_checkpoint(tmp_path / "base")
    model = MeanPooledBertForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=2).eval()
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["MeanPooledBertForSequenceClassification"]
    assert config["model_type"] != "bert"  # else transformers alone would load BertForSequenceClassification
    batch = {"input_ids": torch.tensor([[2, 5, 7, 3, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0]])}
    expected = model(**batch).logits
    for loader in (MeanPooledBertForSequenceClassification, AutoModelForSequenceClassification):
        reloaded = loader.from_pretrained(tmp_path / "saved").eval()
        assert type(reloaded) is MeanPooledBertForSequenceClassification
        torch.testing.assert_close(reloaded(**batch).logits, expected)


def test_roberta_checkpoints_load_into_the_roberta_head_and_other_families_are_refused(tmp_path):
    RobertaModel(RobertaConfig(**SMALL, pad_token_id=1)).save_pretrained(tmp_path / "roberta")
    GPT2Model(
        GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    ).save_pretrained(tmp_path / "gpt2")
    model = MeanPooledRobertaForSequenceClassification.from_pretrained(tmp_path / "roberta", num_labels=2)
    assert model.roberta.pooler is None
    with pytest.raises(ValueError, match="use hf_private.MeanPooledRobertaForSequenceClassification"):
        MeanPooledBertForSequenceClassification.from_pretrained(tmp_path / "roberta")
    with pytest.raises(ValueError, match="cannot load a 'gpt2' checkpoint.*'bert', 'roberta'"):
        MeanPooledBertForSequenceClassification.from_pretrained(tmp_path / "gpt2")


def test_per_example_loss_is_each_examples_own_loss():
    model = tiny.mean_pooled_bert().eval()
    batch = tiny.tokenizer()(["good film", "a dull and bad plot"], padding=True, return_tensors="pt")
    labels = torch.tensor([1, 0])
    losses = default_per_example_loss(model, model(**batch), labels)
    for i in range(2):
        alone = {k: v[i : i + 1, : int(batch["attention_mask"][i].sum())] for k, v in batch.items()}
        torch.testing.assert_close(losses[i], model(**alone, labels=labels[i : i + 1]).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "dp, weights_train",
    [
        (DPConfig(noise_multiplier=1.0), True),
        (BitFitConfig(noise_multiplier=1.0), False),
        (DPLoRAConfig(noise_multiplier=1.0, lora_r=4), False),
    ],
    ids=["DPConfig", "BitFitConfig", "DPLoRAConfig"],
)
def test_trains_under_every_method(tmp_path, dp, weights_train):
    model = tiny.mean_pooled_bert()
    head_before = model.classifier.weight.detach().clone()
    query_before = model.bert.encoder.layer[0].attention.self.query.weight.detach().clone()
    trainer = make_trainer(tmp_path, model=model, dp=dp, max_steps=2)
    trainer.train()
    assert trainer.privacy_report()["steps"] == 2
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    head = getattr(base.classifier, "modules_to_save", {"default": base.classifier})["default"]  # PEFT's copy
    query = base.bert.encoder.layer[0].attention.self.query
    assert not torch.equal(head.weight, head_before), "the new head must train under every method"
    assert torch.equal(getattr(query, "base_layer", query).weight, query_before) != weights_train


def test_card_load_snippet_imports_the_head_from_hf_private(tmp_path):
    trainer = make_trainer(tmp_path, model=tiny.mean_pooled_bert(), max_steps=1)
    trainer.train()
    trainer.save_model()
    card = (tmp_path / "README.md").read_text()
    assert "from hf_private import MeanPooledBertForSequenceClassification" in card
    assert "from transformers import MeanPooledBertForSequenceClassification" not in card


def test_sentence_classifier_picks_the_head_from_the_pooling_config(tmp_path):
    for pooling in ("mean_tokens", "cls_token", None):
        _bert_checkpoint(tmp_path / str(pooling), pooling)
    assert type(sentence_classifier(tmp_path / "mean_tokens")) is MeanPooledBertForSequenceClassification
    assert type(sentence_classifier(tmp_path / "cls_token")) is BertForSequenceClassification
    assert type(sentence_classifier(tmp_path / "None", num_labels=3)) is BertForSequenceClassification
    # `head` chooses against the pooling config: the CLS head on a mean-pooling checkpoint, the mean on any BERT
    assert type(sentence_classifier(tmp_path / "mean_tokens", head="cls")) is BertForSequenceClassification
    assert type(sentence_classifier(tmp_path / "None", head="mean")) is MeanPooledBertForSequenceClassification
    with pytest.raises(ValueError, match="head must be one of auto, cls, mean, got 'max'"):
        sentence_classifier(tmp_path / "None", head="max")


def test_trainer_recommends_the_mean_head_for_a_mean_pooling_checkpoint(tmp_path, caplog):
    _bert_checkpoint(tmp_path / "mean", "mean_tokens", with_head=True)
    _bert_checkpoint(tmp_path / "cls", "cls_token", with_head=True)
    cases = {
        "CLS head on a mean-pooling checkpoint": (BertForSequenceClassification, tmp_path / "mean", True),
        "mean head on it": (MeanPooledBertForSequenceClassification, tmp_path / "mean", False),
        "CLS head on a CLS-pooling checkpoint": (BertForSequenceClassification, tmp_path / "cls", False),
    }
    for case, (model_class, path, warned) in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            make_trainer(tmp_path / "out", model=model_class.from_pretrained(path))
        advice = [r.getMessage() for r in caplog.records if ADVICE in r.getMessage()]
        assert len(advice) == int(warned), case
        if warned:
            assert f"MeanPooledBertForSequenceClassification.from_pretrained({str(path)!r}" in advice[0]


def test_a_hub_id_is_not_looked_up(tmp_path, caplog, monkeypatch):
    """Only a local folder is read: a model loaded by Hub id gets no network call for its pooling config."""
    model = tiny.bert()
    model.config._name_or_path = "sentence-transformers/all-MiniLM-L6-v2"
    monkeypatch.setattr("hf_private.models.head_choice.cached_file", _no_network)
    with caplog.at_level(logging.WARNING):
        make_trainer(tmp_path, model=model)
    assert not any(ADVICE in r.getMessage() for r in caplog.records)


def _no_network(*args, **kwargs):
    raise AssertionError("the Hub must not be asked")
