"""Sparse + low-rank DP-SGD through the trainer: config, weight-only unit masks (and their purity), masking before the
norm, masked coordinates that never change, the PEFT adapter loading without hf_private, RGP's weight updates from
the released carrier gradients, §4.9's σ, and the card.

RGP's carriers and reconstruction formula: test_rgp.py; the shared privacy contracts (one extra example moves the
joint clipped vector by at most C, noise, frozen tensors, card ε, adapter reload, one-step audit):
test_method_conformance.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard

from hf_private import SparseLowRankConfig
from hf_private.methods.sparse_lowrank.masks import smallest_units, unit_masks
from hf_private.privacy import PrivacyPlan
from hf_private.privacy.calibration import calibrate_noise_multiplier
from tests.support import tiny
from tests.support.helpers import eval_logits, make_trainer, snapshot

N = 96
LORA = SparseLowRankConfig(noise_multiplier=0.8, max_grad_norm=1.0, rank=4, sparsity=0.25, noise_seed=3)
RGP = dataclasses.replace(LORA, variant="rgp", rank=2)


def _trainer(tmp_path, dp=LORA, dataset=None, **overrides):
    return make_trainer(tmp_path, model=tiny.bert(), dp=dp, dataset=dataset, **overrides)


# ---------------------------------------------------------------------- config and masks
def test_defaults_are_table_1_per_variant_and_bad_knobs_are_refused():
    lora, rgp = SparseLowRankConfig(target_epsilon=2.0), SparseLowRankConfig(target_epsilon=2.0, variant="rgp")
    assert (lora.resolved_rank, lora.resolved_sparsity, lora.resolved_mask_source) == (32, 0.1, "pretrained")
    assert (rgp.resolved_rank, rgp.resolved_sparsity, rgp.resolved_mask_source) == (8, 0.5, "current")
    for bad, match in [
        ({"variant": "svd"}, "variant"),
        ({"rank": 0}, "rank"),
        ({"sparsity": 1.0}, "sparsity"),
        ({"mask_source": "data"}, "mask_source"),
        ({"variant": "rgp", "lora_alpha": 8}, "lora_alpha"),
    ]:
        with pytest.raises(ValueError, match=match):
            SparseLowRankConfig(target_epsilon=2.0, **bad)


def test_unit_masks_take_the_smallest_row_and_column_l1_norms():
    weight = torch.tensor(
        [[1.0, -5.0, 0.0, 2.0], [0.5, 0.5, -0.5, 0.0], [3.0, 1.0, 1.0, -1.0]]
    )  # row sums 8, 1.5, 6; column sums 4.5, 6.5, 1.5, 3
    rows, cols = unit_masks(weight, 0.5)
    assert rows.tolist() == [False, True, False]  # ⌊0.5·3⌋ = 1 row
    assert cols.tolist() == [False, False, True, True]  # ⌊0.5·4⌋ = 2 columns
    assert smallest_units(torch.tensor([2.0, 1.0, 1.0, 3.0]), 0.25).tolist() == [False, True, False, False]  # tie
    assert not unit_masks(weight, 0.0)[0].any()


def test_masks_depend_on_the_weights_only(tmp_path):
    """Mask purity: permuting or replacing the training data leaves every mask identical."""
    for dp in (LORA, RGP):
        data = tiny.sentiment_dataset(N, seed=1)
        masks = []
        for dataset in (data, data.shuffle(seed=5), tiny.sentiment_dataset(N, seed=9)):
            trainer = _trainer(tmp_path, dp=dp, dataset=dataset)
            masks.append([f.mask.clone() for f in trainer.dp_method.factors])
        assert all(torch.equal(a, b) for other in masks[1:] for a, b in zip(masks[0], other))
        assert any(m.any() for m in masks[0])


# ---------------------------------------------------------------------- LoRA variant
def test_masked_rows_and_columns_never_change_and_the_rest_trains(tmp_path):
    trainer = _trainer(tmp_path, max_steps=3, weight_decay=0.1)  # decay would move masked lora_A columns
    factors = trainer.dp_method.factors
    before = [f.param.detach().clone() for f in factors]
    trainer.train()
    for factor, old in zip(factors, before):
        where = factor.coordinate_mask().expand_as(factor.param)
        assert torch.equal(factor.param.detach()[where], old[where])
        assert bool((factor.param.detach()[~where] != old[~where]).all())  # noise reaches every other coordinate


def test_terms_are_masked_before_the_norm(tmp_path):
    """The engine's clipped sums equal an fp64 per-example loop that masks each example's factor gradients first."""
    trainer = _trainer(tmp_path, dp=dataclasses.replace(LORA, max_grad_norm=0.05))
    model, engine = trainer.model.double().train(), trainer.engine
    rows = [{**r, "labels": r["label"]} for r in tiny.sentiment_dataset(6, seed=2)]
    batch = trainer.data_collator([{k: v for k, v in r.items() if k != "label"} for r in rows])
    with engine.recording(len(rows)):
        trainer.summed_loss(model, batch)[0].backward()
    engine.finish_backward()
    sums = engine.pop_clipped_sums()
    params = [p for _, p in engine.parameters]
    masks = {id(f.param): f.coordinate_mask() for f in trainer.dp_method.factors}
    expected = [torch.zeros_like(p) for p in params]
    for b in range(len(rows)):
        one = {k: v[b : b + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(trainer.summed_loss(model, one)[0], params)
        grads = [g.masked_fill(masks[id(p)].expand_as(g), 0.0) if id(p) in masks else g for p, g in zip(params, grads)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for e, g in zip(expected, grads):
            e += g * min(1.0, 0.05 / (float(norm) + 1e-6))
    for p, e in zip(params, expected):
        torch.testing.assert_close(sums.get(p, torch.zeros_like(p)), e, rtol=1e-9, atol=1e-12)


def test_the_adapter_is_a_peft_lora_adapter_stock_peft_loads_without_hf_private(tmp_path):
    trainer = _trainer(tmp_path / "run", max_steps=2)
    trainer.train()
    trainer.save_model()
    base_dir = tmp_path / "base"
    tiny.bert().save_pretrained(base_dir)
    batch = {
        k: v
        for k, v in trainer.data_collator(
            [{k: v for k, v in r.items() if k != "label"} for r in tiny.sentiment_dataset(4, seed=7)]
        ).items()
    }
    expected = eval_logits(trainer.model, batch)
    torch.save(batch, tmp_path / "batch.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from peft import PeftModel
        from transformers import BertForSequenceClassification
        model = PeftModel.from_pretrained(BertForSequenceClassification.from_pretrained({str(base_dir)!r}),
                                          {str(tmp_path / "run")!r}).eval()
        with torch.no_grad():
            torch.save(model(**torch.load({str(tmp_path / "batch.pt")!r})).logits, {str(tmp_path / "out.pt")!r})
        assert not any(name.startswith("hf_private") for name in sys.modules), "hf_private was imported"
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=0, atol=0)


# ---------------------------------------------------------------------- RGP variant
def test_rgp_updates_the_weights_by_the_reconstructed_gradient_and_keeps_them_plain(tmp_path):
    trainer = _trainer(tmp_path, dp=RGP, max_steps=2, optim="sgd", learning_rate=0.1, weight_decay=0.0)
    method = trainer.dp_method
    before = snapshot(trainer.model)
    trainer.train()
    changed = {
        k.removeprefix("param:")
        for k, v in snapshot(trainer.model).items()
        if k.startswith("param:") and not torch.equal(v, before[k])
    }
    weights = {f"{name}.weight" for name in method.rgp_layers}
    carriers = {n for n in changed if n.endswith((".left.weight", ".right.weight"))}
    assert changed - carriers == weights | method.head  # W and the head train; biases, norms, embeddings do not
    assert trainer.trained_parameter_names == weights | method.head


def test_rgp_step_applies_the_papers_projection_of_the_released_carrier_gradients(tmp_path):
    from hf_private.methods.sparse_lowrank import rgp

    trainer = _trainer(tmp_path, dp=RGP, optim="sgd", learning_rate=1.0, weight_decay=0.0)
    trainer.create_optimizer()
    layer = next(iter(trainer.dp_method.rgp_layers.values()))
    left, right = layer.left.weight.detach().clone(), layer.right.weight.detach().clone()
    released = {}
    trainer.optimizer.add_gradient_transform(layer.left.weight, lambda g: released.__setitem__("left", g.clone()))
    trainer.optimizer.add_gradient_transform(layer.right.weight, lambda g: released.__setitem__("right", g.clone()))
    weight = layer.weight.detach().clone()
    trainer.optimizer.step()  # an empty batch: the released gradients are masked noise
    expected = rgp.full_weight_gradient(released["left"], released["right"], left, right)
    torch.testing.assert_close(weight - layer.weight.detach(), layer.to_weight_layout(expected), rtol=1e-5, atol=1e-7)
    assert not torch.equal(layer.left.weight.detach(), left)  # new carriers from the new weight


# ---------------------------------------------------------------------- accounting, card, recipe
SECTION_4_9 = [(67_349, 660, eps, sigma) for eps, sigma in zip((1, 2, 4, 8), (3.242, 1.855, 1.173, 0.837))] + [
    (104_743, 1040, eps, sigma) for eps, sigma in zip((1, 2, 4, 8), (2.656, 1.553, 1.024, 0.760))
]


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.parametrize(("size", "steps", "target", "sigma"), SECTION_4_9)
def test_section_4_9_noise_multipliers_under_rdp(size, steps, target, sigma):
    """B = 2000, E = 20, δ = 1e-5, q = B/N, T = E·⌊N/B⌋ (the RGP code's convention). QNLI's δ = 1e-5 is not below
    1/N (N = 104,743), so a plan refuses it; the calibration itself reproduces the table."""
    assert calibrate_noise_multiplier(target, 1e-5, 2000 / size, steps, accountant="rdp") == pytest.approx(
        sigma, abs=1e-3
    )
    if 1e-5 < 1 / size:
        plan = PrivacyPlan(
            size, 2000, steps=steps, delta=1e-5, accountant="rdp", target_epsilon=target, name="sparse-lowrank"
        )
        assert plan["sparse-lowrank"].noise_multiplier == pytest.approx(sigma, abs=1e-3)
    else:
        with pytest.raises(ValueError, match="not below 1/N"):
            PrivacyPlan(size, 2000, steps=steps, delta=1e-5, accountant="rdp", target_epsilon=target)


@pytest.mark.parametrize("dp", [LORA, RGP], ids=["lora", "rgp"])
def test_card_names_the_method_variant_rank_sparsity_and_noised_coordinates(tmp_path, dp):
    trainer = _trainer(tmp_path, dp=dp, max_steps=1)
    trainer.train()
    trainer.save_model()
    card = ModelCard.load(tmp_path / "README.md")
    privacy = card.data.to_dict()["privacy"]
    details = privacy["method_details"]
    assert privacy["method"] == "sparse-lowrank"
    assert (details["variant"], details["rank"], details["sparsity"]) == (dp.variant, dp.rank, 0.25)
    factors = trainer.dp_method.factors
    masked = sum(f.masked_coordinates for f in factors)
    trainable = sum(p.numel() for _, p in trainer.engine.parameters)
    assert details["noised_coordinates"] == trainable - masked > 0 and masked > 0
    assert details["noised_coordinates_without_masks"] == trainable
    assert f"noised coordinates: {trainable - masked}" in card.text
    json.dumps(details)  # the YAML block holds plain values
