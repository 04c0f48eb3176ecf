"""Sequence classifiers on the attention-masked mean of an encoder's token states: the feature that
sentence-transformers checkpoints (all-MiniLM-L6-v2, all-distilroberta-v1, ...) were trained to give.

`BertForSequenceClassification` classifies the pooler's tanh(W·h_CLS). A mean-pooling sentence encoder's CLS state
is a poor feature: on all-MiniLM-L6-v2 a logistic regression on SST-2 dev sentences reaches 63% on the CLS state, 64%
on the pooler output and 77% on the mean of the token states. A private run, whose few noisy steps cannot reshape the
CLS state, drifts to the majority class there; on the mean it learns (README, "Usage"; docs/guides/models.md).

Each head has a config class of its own `model_type`, registered with `AutoConfig` and
`AutoModelForSequenceClassification` when hf_private is imported. A saved model then reloads with its class, or
through the Auto class once hf_private is imported; without hf_private, transformers refuses the unknown model type
instead of silently loading `BertForSequenceClassification` (a random pooler under the trained classifier).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BertConfig,
    BertModel,
    BertPreTrainedModel,
    RobertaConfig,
    RobertaModel,
    RobertaPreTrainedModel,
)
from transformers.modeling_outputs import SequenceClassifierOutput

if TYPE_CHECKING:  # what the mixins below are mixed into, for their super() calls and inherited attributes
    from transformers import PreTrainedConfig as _ConfigMixinBase
    from transformers import PreTrainedModel as _ModelMixinBase
else:  # at run time they stay plain mixins: the concrete class lists the transformers base itself
    _ConfigMixinBase = _ModelMixinBase = object

__all__ = [
    "MEAN_POOLED_HEADS",
    "MeanPooledBertForSequenceClassification",
    "MeanPooledRobertaForSequenceClassification",
    "mean_pooled_head_for",
]

# encoder model_type (what a checkpoint's config.json says) → the mean-pooled head that loads it
_HEADS_BY_ENCODER: dict[str, str] = {
    "bert": "MeanPooledBertForSequenceClassification",
    "roberta": "MeanPooledRobertaForSequenceClassification",
}


def mean_pooled_head_for(model_type: str | None) -> str | None:
    """The name of the hf_private head that loads checkpoints of `model_type` (None: there is none)."""
    return _HEADS_BY_ENCODER.get(model_type or "")


def _unsupported_encoder(model_type: str | None, wanted: str, loads: str) -> str:
    """The error for a `model_type` checkpoint given to the head `wanted`, which loads `loads` checkpoints."""
    right = mean_pooled_head_for(model_type)
    if right is not None:
        return (
            f"{wanted} loads {loads!r} checkpoints; this one is a {model_type!r} checkpoint: use "
            f"hf_private.{right} (hf_private.sentence_classifier picks it)."
        )
    return (
        f"{wanted} cannot load a {model_type!r} checkpoint: hf_private has mean-pooled heads for "
        f"{', '.join(repr(t) for t in _HEADS_BY_ENCODER)} checkpoints. For another encoder, write the head on "
        "AutoModel (a Linear on last_hidden_state averaged over attention_mask)."
    )


def _num_labels(config: _ConfigMixinBase) -> int:
    """The classifier's width: transformers leaves `num_labels` None for a config without labels."""
    if config.num_labels is None:
        raise ValueError("A mean-pooled classifier needs the number of labels: pass num_labels to from_pretrained.")
    return config.num_labels


class _FromEncoderCheckpoint(_ConfigMixinBase):
    """Config mixin: a plain encoder checkpoint (model_type `encoder_type`) loads as this head's config; a checkpoint
    of another family is refused by name instead of loading its weights into the wrong layers."""

    encoder_type: str
    head_name: str

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        found = config_dict.get("model_type")
        if found in (None, cls.encoder_type):  # very old configs name no model_type: taken as the encoder's
            config_dict = {**config_dict, "model_type": cls.model_type}
        elif found != cls.model_type:
            raise ValueError(_unsupported_encoder(found, cls.head_name, cls.encoder_type))
        return config_dict, kwargs


class MeanPooledBertConfig(_FromEncoderCheckpoint, BertConfig):
    """`BertConfig` under its own model type, so a saved head reloads as this head (see the module docstring)."""

    model_type = "hf_private_mean_pooled_bert"
    encoder_type = "bert"
    head_name = "MeanPooledBertForSequenceClassification"


class MeanPooledRobertaConfig(_FromEncoderCheckpoint, RobertaConfig):
    """`RobertaConfig` under its own model type (see `MeanPooledBertConfig`)."""

    model_type = "hf_private_mean_pooled_roberta"
    encoder_type = "roberta"
    head_name = "MeanPooledRobertaForSequenceClassification"


class _MeanPooledClassifier(_ModelMixinBase):
    """Model mixin: `self.base_model` (the encoder, no pooler) → masked mean → `self.classifier`."""

    # forward takes **kwargs for the encoder only; its loss is a plain mean, so Trainer must divide it by the
    # accumulation steps itself (with True it would not, and the loss and gradient would be a sum over chunks)
    accepts_loss_kwargs = False
    # the checkpoint's pooler is not used: not worth a load-report line
    _keys_to_ignore_on_load_unexpected = [r"pooler\."]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutput | tuple:
        owner = packed_owner(position_ids, attention_mask)
        if owner is not None:  # sentences packed end to end in rows (hf_private.data.packing)
            return self._packed_forward(input_ids, inputs_embeds, position_ids, owner, labels, return_dict, **kwargs)
        outputs = self.base_model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        states = outputs.last_hidden_state
        mask = (
            (torch.ones(states.shape[:2], device=states.device) if attention_mask is None else attention_mask)
            .unsqueeze(-1)
            .to(states.dtype)
        )
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self._classified(pooled, labels, outputs, return_dict)

    def _packed_forward(self, input_ids, inputs_embeds, position_ids, owner, labels, return_dict, **kwargs):
        """Rows of whole sentences: each attends to itself only (a block-diagonal mask; a row's padding to its own
        padding), at its own positions (RoBERTa's count from padding_idx + 1, as its embeddings number an unpacked
        sentence), and is pooled alone."""
        reference = inputs_embeds if inputs_embeds is not None else self.base_model.get_input_embeddings().weight
        padding = owner < 0
        rows = torch.arange(owner.shape[0], device=owner.device)[:, None].expand_as(owner)
        group = owner.masked_fill(padding, 0) - padding.long() * (rows + 1)  # padding: -1 - its row
        attend = (group[:, :, None] == group[:, None, :])[:, None]
        mask = torch.zeros(attend.shape, dtype=reference.dtype, device=owner.device).masked_fill(
            ~attend, torch.finfo(reference.dtype).min
        )
        positions = position_ids + (self.config.pad_token_id + 1 if self.config.model_type.endswith("roberta") else 0)
        outputs = self.base_model(
            input_ids,
            attention_mask=mask,
            token_type_ids=torch.zeros_like(position_ids),
            position_ids=positions,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        real = ~padding.flatten()
        states, sentence = outputs.last_hidden_state.flatten(0, 1)[real], owner.flatten()[real]
        sentences = int(sentence.max()) + 1
        sums = states.new_zeros(sentences, states.shape[-1]).index_add(0, sentence, states)
        counts = torch.bincount(sentence, minlength=sentences).to(states.dtype)
        return self._classified(sums / counts[:, None], labels, outputs, return_dict)

    def _classified(self, pooled, labels, outputs, return_dict):
        logits = self.classifier(pooled)
        loss = None if labels is None else self.loss_function(labels, logits, self.config)  # the stock heads' loss
        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output.to_tuple() if return_dict is False else output


class MeanPooledBertForSequenceClassification(_MeanPooledClassifier, BertPreTrainedModel):
    """A linear classifier on the attention-masked mean of BERT's last hidden states (no pooler, no dropout on the
    mean, as sentence-transformers pools). Loads any BERT checkpoint with `from_pretrained`: encoder weights as saved,
    a new `classifier` (a fine-tuned `BertForSequenceClassification` checkpoint would lend its own, trained on the
    pooler: start from the encoder checkpoint)."""

    config_class = MeanPooledBertConfig

    def __init__(self, config: MeanPooledBertConfig) -> None:
        super().__init__(config)
        self.num_labels = _num_labels(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.post_init()


class MeanPooledRobertaForSequenceClassification(_MeanPooledClassifier, RobertaPreTrainedModel):
    """`MeanPooledBertForSequenceClassification` for RoBERTa checkpoints (all-distilroberta-v1, ...)."""

    config_class = MeanPooledRobertaConfig

    def __init__(self, config: MeanPooledRobertaConfig) -> None:
        super().__init__(config)
        self.num_labels = _num_labels(config)
        self.roberta = RobertaModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.post_init()


def packed_owner(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Each token's sentence, counted over the rows in order, where sentences are packed end to end (position_ids
    restarting at 0 among a row's attended tokens), -1 for padding; None if no row holds two sentences."""
    if position_ids is None or position_ids.dim() != 2:
        return None
    real = torch.ones_like(position_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if real.shape != position_ids.shape:
        return None
    starts = real & (position_ids == 0)
    if not bool((starts.sum(1) > 1).any()):
        return None
    first = real.long().argmax(1)  # each row's first attended token must start a sentence of that row
    rows = torch.arange(real.shape[0], device=real.device)
    if not bool((starts[rows, first] | ~real.any(1)).all()):
        raise ValueError(
            "Packed sentences need position_ids starting at 0 at each row's first attended token: a "
            "row that begins inside a sentence would be pooled with another row's sentence."
        )
    owner = starts.flatten().long().cumsum(0).view_as(position_ids) - 1
    return owner.masked_fill(~real, -1)


MEAN_POOLED_HEADS = (MeanPooledBertForSequenceClassification, MeanPooledRobertaForSequenceClassification)

for _config, _model in (
    (MeanPooledBertConfig, MeanPooledBertForSequenceClassification),
    (MeanPooledRobertaConfig, MeanPooledRobertaForSequenceClassification),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForSequenceClassification.register(_config, _model, exist_ok=True)
