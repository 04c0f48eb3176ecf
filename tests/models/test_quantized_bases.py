"""Quantized bases (QLoRA): a bitsandbytes 4-bit (NF4, FP4) or 8-bit Llama base with LoRA adapters, on the CPU.

The base is built from a config (widths 64 and 128: bitsandbytes' CPU kernels need at least 64), saved and reloaded
with a `BitsAndBytesConfig` as a user loads a Hub model, frozen by peft's `prepare_model_for_kbit_training` and given
LoRA adapters on every linear layer. The base never trains; the adapters are plain `nn.Linear` modules, so their
per-example gradients are the linear rule's, read through the quantized layers' backward. Checked here: the engine's
per-example norms and clipped sums against one backward per example, training through `PrivateTrainer` and
`privatize(SFTTrainer)` (the quantized weights stay bit-identical), and the refusals a QLoRA user can meet.
"""

from __future__ import annotations

import math

import bitsandbytes  # noqa: F401  # the test extra installs it (CPU build included): CI must run these, never skip
import pytest
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from trl import SFTConfig, SFTTrainer

from hf_private import DPConfig, PrivateTrainer, privatize
from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny
from tests.support.helpers import TRL_TEST_ARGS, make_lm_trainer, run_doc_block

pytestmark = pytest.mark.usefixtures("single_thread")

QUANTIZATIONS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
}
BATCH, SEQ = 5, 12
# float32 throughout: bitsandbytes quantizes only 16/32-bit floats, and its 4-bit CPU path in float64 returns NaNs,
# so no float64 oracle exists for a quantized base. Both sides run the same quantized forward and backward, so the
# difference is float32 summation order alone (measured: norms equal, clipped sums ≤ 8.3e-8 relative); a wrong clip
# factor, a missing token or a per-row clip differs by 1e-2 or more.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama saved in float32, for `from_pretrained` to quantize on load as it quantizes a Hub model."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tiny.VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=tiny.SEQ_LEN + 4,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("llama-base")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def quantized(base_dir, kind: str, **overrides):
    config = BitsAndBytesConfig(**{**QUANTIZATIONS[kind], **overrides})
    return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config, device_map="cpu")


def lora_config() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def qlora(base_dir, kind: str):
    """As users do: quantized on load, frozen by peft, LoRA on every linear layer (the head excepted)."""
    model = prepare_model_for_kbit_training(quantized(base_dir, kind), use_gradient_checkpointing=False)
    torch.manual_seed(1)
    return get_peft_model(model, lora_config())


def quantized_weights(model) -> dict[str, torch.Tensor]:
    """The base's quantized weights (bitsandbytes' Params4bit / Int8Params), copied."""
    return {
        name: p.detach().clone()
        for name, p in model.named_parameters()
        if type(p).__module__.startswith("bitsandbytes")
    }


# ---------------------------------------------------------------------- the engine against one backward per example
def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(tiny.VOCAB), (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 8:] = 0
    ids[1, 8:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss(model, batch) -> torch.Tensor:
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return default_per_example_loss(model, outputs, batch["labels"]).sum()


def _per_example_loop(model, batch, params):
    """Each example's gradient from a backward of its own loss alone: the norms and the clipped sum at a clip below
    every norm (so every clip factor is tested)."""
    grads = []
    for b in range(BATCH):
        model.zero_grad()
        _loss(model, {k: v[b : b + 1] for k, v in batch.items()}).backward()
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    model.zero_grad()
    grads = torch.stack(grads)
    norms = grads.norm(dim=1)
    clip = 0.5 * norms.min().item()
    return norms, (grads * (clip / norms).clamp(max=1.0)[:, None]).sum(0), clip


@pytest.mark.parametrize("kind", list(QUANTIZATIONS))
def test_engine_matches_the_per_example_loop(kind, base_dir):
    model = qlora(base_dir, kind)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would leave every A gradient zero
            torch.nn.init.normal_(p, std=0.05)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float32 for p in params)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n
    }, "only the adapters train"
    assert quantized_weights(model), "the base must be quantized"
    batch = _batch()
    ref_norms, ref_sum, clip = _per_example_loop(model, batch, params)

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    for verified in (False, True):  # autograd's sum checked by the engine, then ghost differentiation
        assert engine.verified is verified
        with engine.recording(BATCH):
            _loss(model, batch).backward()
        norms = engine.finish_backward()
        sums = engine.pop_clipped_sums()
        ours = torch.cat([sums[p].flatten() for p in params])
        assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= TOLERANCE
        assert ((ours - ref_sum).norm() / ref_sum.norm()).item() <= TOLERANCE
    engine.detach()


# ---------------------------------------------------------------------- training: PrivateTrainer and SFTTrainer
def _lm_trainer(model, output_dir, dp) -> PrivateTrainer:
    return make_lm_trainer(output_dir, model, dp, examples=64, max_steps=3, per_device_train_batch_size=16)


def _assert_trained_privately(trainer, frozen: dict[str, torch.Tensor], epsilon_at_most: float) -> None:
    report = trainer.privacy_report()
    assert report["steps"] == 3 and 0 < report["epsilon"] <= epsilon_at_most
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    after = list(quantized_weights(trainer.model).values())  # in order: a wrapper (TRL's peft_config) renames them
    assert len(after) == len(frozen) and all(torch.equal(a, w) for a, w in zip(after, frozen.values()))


@pytest.mark.parametrize("kind", ["fp4", "int8"])  # NF4: the guide's block, below
def test_private_trainer_trains_the_adapter_on_a_quantized_base(kind, base_dir, tmp_path):
    model = qlora(base_dir, kind)
    frozen = quantized_weights(model)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = _lm_trainer(model, tmp_path, DPConfig(noise_multiplier=1.0))
    trainer.train()
    _assert_trained_privately(trainer, frozen, epsilon_at_most=math.inf)
    assert all(not torch.equal(adapters[n], p) for n, p in model.named_parameters() if p.requires_grad)
    trainer.save_model(str(tmp_path / "adapter"))
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as saved:
        keys = list(saved.keys())
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), "only the adapter is released"


def test_docs_quantized_bases_recipe_runs_as_written(tmp_path, monkeypatch):
    """The CPU block of docs/guides/quantized-bases.md, unchanged: an NF4 base with LoRA trained to a target ε."""
    namespace = run_doc_block("guides/quantized-bases.md", tmp_path, monkeypatch, index=1)
    trainer = namespace["trainer"]
    assert trainer.model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight.quant_state.quant_type == (
        "nf4"
    )
    report = trainer.privacy_report()
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] <= 8.0
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert (tmp_path / "out-qlora" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "out-qlora" / "README.md").is_file()


def test_sft_trainer_with_peft_config_trains_on_a_4bit_base(base_dir, tmp_path):
    """TRL wraps the quantized base with the adapter itself, and casts a quantized model's adapter to bf16."""
    model = quantized(base_dir, "nf4")
    frozen = quantized_weights(model)
    config = dict(TRL_TEST_ARGS, per_device_train_batch_size=16, max_steps=3, learning_rate=5e-3, logging_steps=1)
    trainer = privatize(SFTTrainer)(
        model,
        SFTConfig(str(tmp_path), **config),
        train_dataset=tiny.texts(64),
        processing_class=tiny.chat_tokenizer(),
        peft_config=lora_config(),
        dp_config=DPConfig(noise_multiplier=1.0),
    )
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all(p.dtype == torch.bfloat16 for p in adapters.values())
    trainer.train()
    _assert_trained_privately(trainer, frozen, epsilon_at_most=math.inf)
    assert trainer.privacy_report()["trainer"] == "trl.SFTTrainer"
    assert any(not torch.equal(adapters[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad)


# ---------------------------------------------------------------------- refusals
def test_qlora_as_peft_prepares_it_trains_with_its_activation_checkpointing(base_dir, tmp_path):
    """prepare_model_for_kbit_training turns the model's own checkpointing on by default (the training arguments
    never see it): the released adapters equal those of the same run without checkpointing."""
    released = {}
    for checkpointing in (True, False):
        model = prepare_model_for_kbit_training(quantized(base_dir, "nf4"), use_gradient_checkpointing=checkpointing)
        assert model.is_activation_checkpointing is checkpointing
        torch.manual_seed(1)
        trainer = _lm_trainer(
            get_peft_model(model, lora_config()),
            tmp_path / str(checkpointing),
            DPConfig(noise_multiplier=1.0, noise_seed=3),
        )
        trainer.train()
        released[checkpointing] = torch.cat(
            [p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad]
        )
    assert (released[True] - released[False]).norm() <= 1e-5 * released[False].norm()


def test_a_trainable_quantized_weight_is_refused_by_name(base_dir, tmp_path):
    """8-bit layers kept with float weights are the one quantized weight that can be left trainable."""
    model = get_peft_model(quantized(base_dir, "int8", llm_int8_has_fp16_weight=True), lora_config())
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    with pytest.raises(UnsupportedLayerError, match=r"layers\.0\.self_attn\.q_proj\.base_layer .*quantized"):
        _lm_trainer(model, tmp_path, DPConfig(noise_multiplier=1.0)).train()


def test_4bit_and_8bit_weights_cannot_be_made_trainable(base_dir):
    """Why the refusal above needs no 4-bit case: integer storage cannot require gradients at all."""
    for kind in ("nf4", "int8"):
        weight = quantized(base_dir, kind).model.layers[0].mlp.up_proj.weight
        with pytest.raises(RuntimeError, match="floating point"):
            weight.requires_grad_(True)
