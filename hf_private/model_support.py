"""Model-level checks run when a `PrivateTrainer` is built, before anything is prepared or trained.

Layer-level support (which trainable parameters have an exact per-example gradient) is the engine's business
(`engine/layers/`); this module refuses whole model families whose per-example clipping has never been verified,
whatever parameters are frozen, with one message that says what to use instead.
"""

from __future__ import annotations

from torch import nn


class UnsupportedModelError(ValueError):
    """The model family is not supported by private training."""


def check_supported_model(model: nn.Module) -> None:
    """Raise `UnsupportedModelError` for encoder-decoder models (T5, mT5, BART, Pegasus, Marian, ...).

    Looks at every submodule's `config`, so a PEFT-wrapped or user-wrapped encoder-decoder model is refused too.
    Encoder-only heads built from such a family (T5EncoderModel, T5ForTokenClassification) set
    `config.is_encoder_decoder=False` and pass; their layers are then checked one by one by the engine.
    """
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "is_encoder_decoder", False) is not True:
            continue
        where = f" (its submodule {name!r})" if name else ""
        raise UnsupportedModelError(
            f"{type(model).__name__}{where} is an encoder-decoder model (config.is_encoder_decoder=True, as in T5, "
            "mT5, BART, Pegasus, Marian), which hf_private does not support, whatever parameters are frozen. "
            "Per-example clipping has not been verified for this architecture: the decoder reads inputs derived "
            "from the labels through cross-attention, and some of its layers cannot be clipped per example (T5's "
            "relative_attention_bias is looked up once for the whole batch, without a per-example batch dimension; "
            "T5LayerNorm and BartScaledWordEmbedding have no per-example gradient rule), so the privacy guarantee "
            "could not be stated. Use an encoder-only model (BERT, RoBERTa, or an encoder-only T5 head such as "
            "T5ForTokenClassification / T5EncoderModel) or a decoder-only model (GPT-2, Llama) instead."
        )
