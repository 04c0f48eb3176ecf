"""Mixture-of-experts models (Mixtral, Qwen3-MoE, OLMoE) train with full DP: the router's and the fused experts'
per-example norms and clipped sums equal a float64 per-example autograd loop, whatever kernel ran the experts' forward.

The oracle runs in float64 with the "eager" experts kernel: transformers' default "grouped_mm" refuses float64 on the
CPU. The kernel's own float32 comparison (eager vs grouped_mm) checks that the rule does not depend on it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from hf_private import DPConfig
from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError, terms
from hf_private.integrations.losses import default_per_example_loss, head_losses, router_aux_losses
from tests.support import tiny
from tests.support.helpers import make_lm_trainer

BATCH, SEQ = 5, 12
_SHAPE = dict(
    vocab_size=tiny.VOCAB_SIZE,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=tiny.SEQ_LEN + 4,
    num_experts_per_tok=2,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=3,
)


def mixtral(**kw) -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**_SHAPE, intermediate_size=48, num_local_experts=4, **kw))


def qwen3_moe(**kw) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**_SHAPE, head_dim=16, moe_intermediate_size=48, intermediate_size=64, num_experts=4, **kw)
    return Qwen3MoeForCausalLM(config)


def olmoe(**kw) -> OlmoeForCausalLM:
    torch.manual_seed(0)
    return OlmoeForCausalLM(OlmoeConfig(**_SHAPE, intermediate_size=48, num_experts=4, **kw))


FAMILIES = {
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "olmoe": olmoe,
    # the per-example load-balancing loss reaches the router through its logits (the watched output) too
    "mixtral-aux-loss": lambda: mixtral(output_router_logits=True, router_aux_loss_coef=0.5),
}


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(tiny.VOCAB), (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 8:] = 0
    ids[1, 8:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return default_per_example_loss(model, model(**inputs), batch["labels"]).sum()


def _per_example_grads(model, batch) -> list[list[torch.Tensor]]:
    """One backward per example (the oracle)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for b in range(BATCH):
        model.zero_grad()
        _loss(model, {k: v[b : b + 1] for k, v in batch.items()}).backward()
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    model.zero_grad()
    return grads


def _engine_results(model, batch, clip: float, chunks: int = 2):
    """Norms and clipped sums of `chunks` engine chunks (the first with autograd's self-check, then ghost)."""
    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for _ in range(chunks):
        with engine.recording(BATCH):
            _loss(model, batch).backward()
        norms = engine.finish_backward()
        sums = engine.pop_clipped_sums()
        results.append((norms, torch.cat([sums[p].flatten() for p in params])))
    engine.detach()
    return engine, results


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_dp_matches_fp64_per_example_loop(family):
    model = FAMILIES[family]().double()
    model.set_experts_implementation("eager")
    rules = _check_against_oracle(model)
    assert "mixture-of-experts router" in rules and "mixture-of-experts experts" in rules
    assert "generic" not in rules  # no MoE part fell to the per-example VJP


def test_routers_alone_match_fp64_per_example_loop():
    """Only the routers train: nothing upstream of the first router needs a gradient, and its logits are one element
    of a tuple output; the rule makes its tokens a leaf that does, so the logits carry one."""
    model = mixtral().double()
    model.set_experts_implementation("eager")
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("mlp.gate.weight"))
    assert sum(p.requires_grad for p in model.parameters()) == model.config.num_hidden_layers
    assert "mixture-of-experts router" in _check_against_oracle(model)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_mixture_of_experts_matches_fp64_per_example_loop(reentrant):
    """Activation checkpointing re-runs the router and the experts in backward: their rules read what the recompute
    brings back (non-reentrant) or record in it (reentrant), and still match the oracle."""
    model = mixtral().double()
    model.set_experts_implementation("eager")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert "mixture-of-experts experts" in _check_against_oracle(model)


def test_instantiated_experts_match_fp64_per_example_loop(monkeypatch):
    """At T = 512 the experts' per-example gradients are formed ([B, E, P, D], `terms.routed_outer_term`) rather than
    kept as pairs; the tiny model keeps pairs, so the choice is forced here to test that path against the oracle."""
    monkeypatch.setattr(terms, "ghost_norm_is_cheaper", lambda *shape: False)
    model = mixtral().double()
    model.set_experts_implementation("eager")
    _check_against_oracle(model)


def test_lora_on_attention_matches_fp64_per_example_loop():
    model = mixtral().double()
    model.set_experts_implementation("eager")
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    _check_against_oracle(get_peft_model(model, lora))


def test_lora_on_experts_takes_the_parameter_lora_rule():
    """PEFT's all-linear wraps the router and the fused experts in ParamWrapper, whose B·A is added inside the base
    module: the outermost wrapper's rule claims every adapter (checked against the fp64 loop in test_moe_lora.py)."""
    model = get_peft_model(mixtral(), LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"))
    rules = PerExampleGradientEngine(model, 1.0).rule_lines()
    assert "Per-example gradient rule mixture-of-experts LoRA on parameters: 4 module(s) (ParamWrapper ×4)" in rules


def _check_against_oracle(model) -> str:
    """Engine norms and clipped sums ≤ 1e-6 from the fp64 per-example loop, on two chunks; returns the rule lines."""
    model.train()
    batch = _batch()
    grads = _per_example_grads(model, batch)
    ref_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in row)) for row in grads])
    clip = 0.5 * ref_norms.min().item()  # every example clipped: the sums test the clip factors too
    factors = [min(1.0, clip / (n.item() + 1e-6)) for n in ref_norms]
    ref_sums = torch.cat([sum(f * row[i] for f, row in zip(factors, grads)).flatten() for i in range(len(grads[0]))])

    engine, results = _engine_results(model, batch, clip)
    for norms, sums in results:
        assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= 1e-6
        assert ((sums - ref_sums).norm() / ref_sums.norm()).item() <= 1e-6
    return "\n".join(engine.rule_lines())


def test_experts_kernel_does_not_change_per_example_gradients():
    """grouped_mm (transformers' default) and eager forwards give the same norms and sums (float32)."""
    batch = _batch()
    outcomes = {}
    for kernel in ("eager", "grouped_mm", "batched_mm"):
        model = mixtral()
        model.set_experts_implementation(kernel)
        model.train()
        _, results = _engine_results(model, batch, clip=1e-3, chunks=1)
        outcomes[kernel] = results[0]
    for kernel in ("grouped_mm", "batched_mm"):
        norms, sums = outcomes[kernel]
        assert torch.allclose(norms, outcomes["eager"][0], rtol=1e-4)
        assert ((sums - outcomes["eager"][1]).norm() / sums.norm()).item() <= 1e-4


def test_the_experts_rule_owns_the_forward_only_while_attached():
    """While attached, the experts rule computes the experts' forward itself (the same logits as the model's own
    kernel); detached, the module's own forward is back. A forward already set on the instance (an accelerate
    dispatch hook) is refused by name, never silently replaced."""
    model, batch = mixtral().train(), _batch()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        own = model(**inputs).logits
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    assert "forward" in vars(experts)
    with engine.recording(BATCH):
        logits = model(**inputs).logits
        default_per_example_loss(model, SimpleNamespace(logits=logits), batch["labels"]).sum().backward()
    engine.finish_backward()
    assert ((logits.detach() - own).abs().max() / own.abs().max()).item() <= 1e-5
    engine.detach()
    assert "forward" not in vars(experts)
    experts.forward = lambda *args: type(experts).forward(experts, *args)
    with pytest.raises(UnsupportedLayerError, match="already replaced on the instance"):
        PerExampleGradientEngine(model, 1.0).attach()


def test_routed_term_algebra_matches_instantiated_gradients():
    """Every term function on a RoutedOuterTerm equals the same function on its instantiated [B, E, P, D] form."""
    gen = torch.Generator().manual_seed(0)
    pairs, examples, experts = 23, 4, 3
    routed = terms.RoutedOuterTerm(
        left=torch.randn(pairs, 5, generator=gen, dtype=torch.float64),
        right=torch.randn(pairs, 7, generator=gen, dtype=torch.float64),
        example=torch.randint(0, examples, (pairs,), generator=gen),
        expert=torch.randint(0, experts, (pairs,), generator=gen),
        examples=examples,
        experts=experts,
    )
    dense = terms.SampleTerm(terms.instantiate(routed))
    assert dense.grad.shape == (examples, experts, 5, 7)

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-10, atol=1e-10)

    assert close(terms.squared_norm(routed), dense.grad.flatten(1).pow(2).sum(1))
    assert close(terms.inner(routed, routed), terms.squared_norm(routed))
    assert close(terms.inner(routed, dense), terms.squared_norm(routed))
    assert close(terms.combined_squared_norm([routed, dense], torch.float64), 4 * terms.squared_norm(routed))
    factors = torch.rand(examples, generator=gen, dtype=torch.float64)
    shape = dense.grad.shape[1:]
    assert close(terms.clipped_sum(routed, factors, shape), terms.clipped_sum(dense, factors, shape))
    assert close(terms.combined_l1_norm([routed], torch.float64), dense.grad.flatten(1).abs().sum(1))
    assert close(
        terms.clipped_abs_sum([routed], factors, shape, torch.float64, block_elements=300),
        terms.clipped_abs_sum([dense], factors, shape, torch.float64),
    )
    keep = torch.tensor([True, False, True, True])
    assert close(terms.instantiate(terms.zero_examples(routed, keep)), terms.zero_examples(dense, keep).grad)
    assert close(terms.instantiate(terms.zero_rows(routed, [1])), terms.zero_rows(dense, [1]).grad)
    assert close(terms.instantiate(terms.zero_columns(routed, [0, 3])), terms.zero_columns(dense, [0, 3]).grad)
    assert close(terms.instantiate(terms.select_examples(routed, 1, 3)), dense.grad[1:3])
    assert close(terms.instantiate(terms.group_rows(routed, 2)), terms.group_rows(dense, 2).grad)
    assert close(terms.instantiate(terms.group_rows(routed, [1, 3])), terms.group_rows(dense, [1, 3]).grad)
    assert terms.cast_term(routed, torch.float32).left.dtype == torch.float32

    # the experts' rule hands its pairs over through `routed_outer_term`: factored where the pairs are the smaller
    # (here ~2 pairs per example and expert), else instantiated (Mixtral-shaped at T = 512: 256 pairs, 2048×512)
    fields = {k: getattr(routed, k) for k in ("left", "right", "example", "expert", "examples", "experts")}
    assert isinstance(terms.routed_outer_term(**fields), terms.RoutedOuterTerm)
    assert not terms.ghost_norm_is_cheaper(256, 2048, 512)


def test_experts_whose_forward_differs_are_refused():
    """A module registered as fused experts but computing something else is never given the rule."""
    model = mixtral()
    experts = model.model.layers[0].mlp.experts
    experts.act_fn = torch.nn.Identity()  # fine: the rule computes with the module's own act_fn
    PerExampleGradientEngine(model, 1.0)
    experts.has_bias = True
    with pytest.raises(UnsupportedLayerError, match="expert layout"):
        PerExampleGradientEngine(model, 1.0)
    experts.has_bias = False
    router = model.model.layers[0].mlp.gate
    router.forward = lambda hidden: type(router).forward(router, hidden * 2)  # logits no longer x Wᵀ
    with pytest.raises(UnsupportedLayerError, match="MixtralTopKRouter's first output is not F.linear"):
        PerExampleGradientEngine(model, 1.0)
    del router.forward
    original = type(experts)._apply_gate
    try:
        type(experts)._apply_gate = lambda self, gate_up: gate_up.chunk(2, -1)[1]  # a gate the rule does not replay
        model.set_experts_implementation("grouped_mm")
        with pytest.raises(UnsupportedLayerError, match="does not compute"):
            PerExampleGradientEngine(model, 1.0)
    finally:
        type(experts)._apply_gate = original


def test_load_balancing_loss_is_each_examples_own():
    """With output_router_logits=True the default loss adds, per example, transformers' load_balancing_loss_func of
    that example alone × router_aux_loss_coef (a padded example's equals its unpadded one: padding never counts)."""
    model = mixtral(output_router_logits=True).double()
    model.set_experts_implementation("eager")
    batch = _batch()
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    aux = router_aux_losses(model, outputs, batch["labels"])
    for b in range(BATCH):
        alone = model(input_ids=batch["input_ids"][b : b + 1, : int(batch["attention_mask"][b].sum())])
        expected = model.config.router_aux_loss_coef * load_balancing_loss_func(alone.router_logits, 4, 2)
        assert torch.allclose(aux[b].double(), expected.double(), rtol=1e-5)
    total = default_per_example_loss(model, outputs, batch["labels"])
    assert torch.allclose(total, head_losses(model, outputs, batch["labels"]) + aux)
    assert router_aux_losses(mixtral(), mixtral()(input_ids=batch["input_ids"]), batch["labels"]) is None


def test_load_balancing_loss_without_token_labels_is_refused():
    outputs = SimpleNamespace(logits=torch.zeros(2, 3), router_logits=(torch.zeros(8, 4),))
    with pytest.raises(ValueError, match="output_router_logits = False"):
        default_per_example_loss(mixtral(output_router_logits=True), outputs, torch.tensor([0, 1]))


def test_private_trainer_trains_a_mixture_of_experts(tmp_path):
    """Full DP through PrivateTrainer (transformers' default experts kernel), the load-balancing loss on."""
    model = mixtral(output_router_logits=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_lm_trainer(tmp_path, model, DPConfig(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any("experts.gate_up_proj" in n for n in moved) and any("gate.weight" in n for n in moved)


def test_packed_chunks_are_refused_with_what_to_do():
    """Examples packed end to end in one row cannot be told apart in the block's flattened tokens."""
    model = mixtral()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    ids, positions = torch.randint(4, 30, (1, 12)), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with pytest.raises(UnsupportedLayerError, match=r"mlp\.gate \(MixtralTopKRouter\).*Pad each example"):
        with engine.recording(2, packed=[5, 7]):
            model(input_ids=ids, position_ids=positions, use_cache=False)


@pytest.mark.parametrize(
    "kernel, instantiated", [("eager", False), ("grouped_mm", False), ("batched_mm", False), ("eager", True)]
)
def test_bf16_autocast_replays_in_the_forwards_dtype(kernel, instantiated, monkeypatch):
    """Under bf16 autocast eager and batched_mm multiply in bf16 but grouped_mm in the weights' float32: the replay
    follows the forward (else the engine's first-chunk check against autograd fails, 1.7e-3 against 1e-3), whether
    the experts' pairs are kept or their per-example gradients formed (T = 512)."""
    if instantiated:
        monkeypatch.setattr(terms, "ghost_norm_is_cheaper", lambda *shape: False)
    model = mixtral()
    model.set_experts_implementation(kernel)
    model.train()
    batch = _batch()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with engine.recording(BATCH):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, batch)
        loss.backward()
    assert torch.isfinite(engine.finish_backward()).all()
    assert engine.verified
