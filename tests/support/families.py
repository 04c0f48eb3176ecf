"""One tiny model (hidden 32, 2 layers, built from its config) per model family the library claims: the conformance
matrix (`tests/models/test_family_conformance.py`) checks each family's per-example gradients, and the README's
table of supported families is generated from that matrix (`python -m tests.support.family_table`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import transformers as hf

VOCAB_SIZE = 64
HIDDEN = 32
#: what every decoder-only family's config takes (ids 0-2 within the tiny vocabulary)
_DECODER = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_ENCODER = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    num_labels=2,
)


@dataclass(frozen=True)
class Family:
    """A model family as the matrix builds it: `task` says which batch and loss it takes and which LoRA task type."""

    name: str  # as the README's table names it
    model_class: type
    config_class: type
    task: str  # "causal", "classifier" or "seq2seq"
    config: dict[str, Any] = field(default_factory=dict)
    experts: bool = False  # a mixture of experts: run its experts eagerly (the fused kernels take no float64)

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        model = self.model_class(self.config_class(**self.config))
        if self.experts:
            model.set_experts_implementation("eager")
        return model


def _decoder(name: str, config_class: type, model_class: type, **extra: Any) -> Family:
    return Family(name, model_class, config_class, "causal", {**_DECODER, **extra})


def _encoder(name: str, config_class: type, model_class: type, **extra: Any) -> Family:
    return Family(name, model_class, config_class, "classifier", {**_ENCODER, **extra})


FAMILIES: list[Family] = [
    # encoders
    _encoder("BERT", hf.BertConfig, hf.BertForSequenceClassification, hidden_dropout_prob=0.0),
    _encoder("RoBERTa", hf.RobertaConfig, hf.RobertaForSequenceClassification, hidden_dropout_prob=0.0),
    _encoder("XLM-R", hf.XLMRobertaConfig, hf.XLMRobertaForSequenceClassification, hidden_dropout_prob=0.0),
    Family(
        "DistilBERT",
        hf.DistilBertForSequenceClassification,
        hf.DistilBertConfig,
        "classifier",
        dict(
            vocab_size=VOCAB_SIZE,
            dim=HIDDEN,
            n_layers=2,
            n_heads=2,
            hidden_dim=64,
            max_position_embeddings=64,
            pad_token_id=0,
            dropout=0.0,
            seq_classif_dropout=0.0,
        ),
    ),
    _encoder("DeBERTa-v2", hf.DebertaV2Config, hf.DebertaV2ForSequenceClassification, hidden_dropout_prob=0.0),
    _encoder(
        "ModernBERT",
        hf.ModernBertConfig,
        hf.ModernBertForSequenceClassification,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        global_attn_every_n_layers=2,
    ),
    _encoder(
        "ELECTRA", hf.ElectraConfig, hf.ElectraForSequenceClassification, embedding_size=16, hidden_dropout_prob=0.0
    ),
    _encoder(
        "ALBERT",
        hf.AlbertConfig,
        hf.AlbertForSequenceClassification,
        embedding_size=16,
        hidden_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    ),
    # decoders
    Family(
        "GPT-2",
        hf.GPT2LMHeadModel,
        hf.GPT2Config,
        "causal",
        dict(
            vocab_size=VOCAB_SIZE,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=2,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    _decoder("Llama", hf.LlamaConfig, hf.LlamaForCausalLM),
    _decoder("Mistral", hf.MistralConfig, hf.MistralForCausalLM),
    _decoder("Qwen2", hf.Qwen2Config, hf.Qwen2ForCausalLM),
    _decoder("Qwen3", hf.Qwen3Config, hf.Qwen3ForCausalLM),
    _decoder("OLMo-2", hf.Olmo2Config, hf.Olmo2ForCausalLM),
    _decoder("Gemma", hf.GemmaConfig, hf.GemmaForCausalLM, head_dim=16),
    _decoder("Gemma 2", hf.Gemma2Config, hf.Gemma2ForCausalLM, head_dim=16),
    _decoder("Gemma 3", hf.Gemma3TextConfig, hf.Gemma3ForCausalLM, head_dim=16),
    _decoder("Phi-3", hf.Phi3Config, hf.Phi3ForCausalLM),
    _decoder("Granite", hf.GraniteConfig, hf.GraniteForCausalLM),
    _decoder("Cohere", hf.CohereConfig, hf.CohereForCausalLM),
    _decoder("GPT-NeoX", hf.GPTNeoXConfig, hf.GPTNeoXForCausalLM, hidden_dropout=0.0, attention_dropout=0.0),
    _decoder("StarCoder2", hf.Starcoder2Config, hf.Starcoder2ForCausalLM, residual_dropout=0.0, embedding_dropout=0.0),
    # mixtures of experts (4 experts, top-2)
    replace(
        _decoder("Mixtral", hf.MixtralConfig, hf.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2),
        experts=True,
    ),
    replace(
        _decoder(
            "Qwen3-MoE",
            hf.Qwen3MoeConfig,
            hf.Qwen3MoeForCausalLM,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            head_dim=16,
        ),
        experts=True,
    ),
    replace(_decoder("OLMoE", hf.OlmoeConfig, hf.OlmoeForCausalLM, num_experts=4, num_experts_per_tok=2), experts=True),
    # encoder-decoders
    Family(
        "T5",
        hf.T5ForConditionalGeneration,
        hf.T5Config,
        "seq2seq",
        dict(
            vocab_size=VOCAB_SIZE,
            d_model=HIDDEN,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
        ),
    ),
    Family(
        "BART",
        hf.BartForConditionalGeneration,
        hf.BartConfig,
        "seq2seq",
        dict(
            vocab_size=VOCAB_SIZE,
            d_model=HIDDEN,
            encoder_layers=1,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        ),
    ),
]

FAMILY = {family.name: family for family in FAMILIES}
