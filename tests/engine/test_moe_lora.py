"""LoRA on a mixture of experts' parameters (PEFT's ParamWrapper: target_modules="all-linear" wraps the router's
weight and both fused expert tensors, nested; target_parameters picks them): per-example norms and clipped sums equal
a float64 per-example autograd loop, the engine's first-chunk check against autograd passes, and it trains privately.

The adapters are initialised at random (init_lora_weights=False): with PEFT's default B = 0 the gradient of every
lora_A is zero, and a misplaced one would go unseen.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_private import DPConfig
from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError
from hf_private.engine.layers import moe_lora
from tests.engine import test_moe
from tests.support.helpers import make_lm_trainer

FAMILIES = {"mixtral": test_moe.mixtral, "qwen3_moe": test_moe.qwen3_moe}
_RULE = "mixture-of-experts LoRA on parameters"


def _lora(model, **config):
    config = {"task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 6, "init_lora_weights": False, **config}
    return get_peft_model(model, LoraConfig(**config))


def _fp64(family: str):
    model = FAMILIES[family]().double()
    model.set_experts_implementation("eager")  # grouped_mm refuses float64 on the CPU
    return model


def _check_against_oracle(model) -> PerExampleGradientEngine:
    """Engine norms and clipped sums ≤ 1e-6 from the fp64 per-example loop on two chunks (the first checked against
    autograd's own gradients by the engine); every example is clipped, so the sums test the clip factors too."""
    model.train()
    batch = test_moe._batch()
    grads = test_moe._per_example_grads(model, batch)
    ref_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in row)) for row in grads])
    clip = 0.5 * ref_norms.min().item()
    factors = [min(1.0, clip / (n.item() + 1e-6)) for n in ref_norms]
    ref_sums = torch.cat([sum(f * row[i] for f, row in zip(factors, grads)).flatten() for i in range(len(grads[0]))])
    engine, results = test_moe._engine_results(model, batch, clip)
    for norms, sums in results:
        assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= 1e-6
        assert ((sums - ref_sums).norm() / ref_sums.norm()).item() <= 1e-6
    assert engine.verified  # the engine's own check: its per-example sums added up to autograd's gradients
    return engine


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_linear_matches_fp64_per_example_loop(family):
    """all-linear: attention Linears, the router's weight and the experts' gate_up_proj inside down_proj's wrapper."""
    engine = _check_against_oracle(_lora(_fp64(family), target_modules="all-linear"))
    rules = "\n".join(engine.rule_lines())
    assert f"{_RULE}: 4 module(s) (ParamWrapper ×4)" in rules  # 2 layers × (router, experts)
    assert "generic" not in rules


@pytest.mark.parametrize("family", list(FAMILIES))
def test_target_parameters_on_experts_only_matches_fp64_per_example_loop(family):
    model = _lora(_fp64(family), target_modules=[], target_parameters=["gate_up_proj", "down_proj"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("experts" in n for n in trainable)
    _check_against_oracle(model)


def test_one_wrapped_expert_tensor_and_the_router_alone():
    """A chain of one wrapper on the experts (down_proj), and the router's weight with no other adapter."""
    _check_against_oracle(_lora(_fp64("mixtral"), target_modules=[], target_parameters=["down_proj", "gate.weight"]))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_lora_on_experts_matches_fp64_per_example_loop(reentrant):
    model = _fp64("mixtral")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    _check_against_oracle(_lora(model, target_modules="all-linear"))


def test_two_active_adapters_on_experts_match_fp64_per_example_loop():
    """Both adapters' B·A enter the weight the experts use; each adapter's factors get their own per-example terms."""
    model = _lora(_fp64("mixtral"), target_modules=[], target_parameters=["gate_up_proj", "down_proj"])
    second = LoraConfig(r=3, lora_alpha=2, init_lora_weights=False, target_parameters=["gate_up_proj", "down_proj"])
    model.add_adapter("second", second)
    model.base_model.set_adapter(["default", "second"])
    model.double()
    trainable = {n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"default", "second"}
    _check_against_oracle(model)


def test_private_trainer_trains_lora_on_experts(tmp_path):
    """PrivateTrainer, transformers' default experts kernel: 2 steps within the target ε, the adapters move."""
    model = _lora(test_moe.mixtral(), target_modules="all-linear")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = make_lm_trainer(tmp_path, model, DPConfig(target_epsilon=8.0, max_grad_norm=1.0), max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.ledger.epsilon() <= 8.0
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("experts.base_layer.lora_A" in n for n in moved) and any("gate.lora_B" in n for n in moved)


def test_parameter_lora_outside_a_mixture_of_experts_is_refused():
    model = _lora(test_moe.mixtral(), target_modules=[], target_parameters=["self_attn.q_proj.weight"])
    with pytest.raises(UnsupportedLayerError, match=r"q_proj: .*Linear\.weight.*router weight and fused expert"):
        PerExampleGradientEngine(model, 1.0)


def test_lora_dropout_on_parameters_is_refused():
    """PEFT refuses lora_dropout on a ParamWrapper when it builds one; a dropout put there afterwards is refused too
    (dropout on the input cannot be factored out of W + B·A)."""
    with pytest.raises(ValueError, match="lora_dropout"):
        _lora(test_moe.mixtral(), target_modules="all-linear", lora_dropout=0.1)
    model = _lora(test_moe.mixtral(), target_modules=[], target_parameters=["down_proj"])
    model.base_model.model.model.layers[1].mlp.experts.lora_dropout["default"] = torch.nn.Dropout(0.1)
    with pytest.raises(UnsupportedLayerError, match=r"layers\.1\.mlp\.experts: .*lora_dropout=0"):
        PerExampleGradientEngine(model, 1.0)


def test_trainable_base_weights_under_the_adapter_are_refused():
    model = _lora(test_moe.mixtral(), target_modules=[], target_parameters=["down_proj"])
    model.base_model.model.model.layers[0].mlp.experts.base_layer.gate_up_proj.requires_grad_(True)
    with pytest.raises(UnsupportedLayerError, match=r"layers\.0\.mlp\.experts: .*gate_up_proj.*Freeze"):
        PerExampleGradientEngine(model, 1.0)


def test_a_misread_peft_layout_is_refused(monkeypatch):
    """Read lora_B's experts as blocks instead of PEFT's interleaved columns: the probe against PEFT's own ΔW refuses
    it when the engine is built, though with B = 0 no gradient could yet show it."""

    def experts_blocked(lora_a, lora_b, experts):
        blocked = lora_b.reshape(lora_b.shape[0], experts, -1).permute(1, 0, 2)
        return blocked, lora_a.reshape(experts, -1, lora_a.shape[1])

    monkeypatch.setattr(moe_lora, "adapter_factors", experts_blocked)
    model = get_peft_model(test_moe.mixtral(), LoraConfig(task_type="CAUSAL_LM", r=2, target_parameters=["down_proj"]))
    with pytest.raises(UnsupportedLayerError, match="lays out"):
        PerExampleGradientEngine(model, 1.0)


@pytest.mark.parametrize("kernel", ["eager", "grouped_mm", "batched_mm"])
def test_bf16_autocast_passes_the_engines_check_against_autograd(kernel):
    """PEFT folds ΔW into the weight outside autocast, in the weights' dtype; the replay then runs in the dtype each
    experts kernel multiplied in, as the experts rule's does (the first chunk's sums must match autograd's)."""
    model = test_moe.mixtral()
    model.set_experts_implementation(kernel)
    model = _lora(model, target_modules="all-linear").train()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with engine.recording(test_moe.BATCH):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = test_moe._loss(model, test_moe._batch())
        loss.backward()
    assert torch.isfinite(engine.finish_backward()).all()
    assert engine.verified
