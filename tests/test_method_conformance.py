"""One table, one row per registered method: every method must pass the shared privacy contracts.

Like PEFT's TEST_CASES: a new method adds one row (its config and a tiny model it applies to). A registered method
without a row fails `test_every_registered_method_has_a_row`.
"""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import DataCollatorWithPadding

from hf_private import BitFitConfig, DPConfig, DPLoRAConfig, load_private_adapter, registered_methods
from hf_private.privacy import MechanismGroup
from hf_private.privacy.accountants import compute_epsilon
from tests import tiny
from tests.helpers import eval_logits, make_trainer, snapshot

CLIP = 0.5
SIGMA = 0.8
# method name → (config with σ and C, tiny model factory); the model factory must be deterministic (seeded).
ROWS = {
    "dp-sgd": (DPConfig(noise_multiplier=SIGMA, max_grad_norm=CLIP), tiny.bert),
    "dp-lora": (DPLoRAConfig(noise_multiplier=SIGMA, max_grad_norm=CLIP, lora_r=2,
                             lora_target_modules="query,value"), tiny.bert),
    "dp-bitfit": (BitFitConfig(noise_multiplier=SIGMA, max_grad_norm=CLIP), tiny.roberta),
}


def test_every_registered_method_has_a_row():
    assert set(registered_methods()) == set(ROWS)


def _trainer(tmp_path, name, **overrides):
    config, factory = ROWS[name]
    return make_trainer(tmp_path, model=factory(), dp=config, **overrides)


def _batch(rows):
    batch = DataCollatorWithPadding(tiny.tokenizer())(rows)
    batch.pop("label", None)
    return batch


@pytest.mark.parametrize("name", sorted(ROWS))
def test_one_extra_example_moves_the_clipped_sum_by_at_most_C(tmp_path, name):
    trainer = _trainer(tmp_path, name)
    model, engine = trainer.model.double().train(), trainer.engine
    data = tiny.sentiment_dataset(10, seed=3)
    base_rows = [{**data[i], "labels": data[i]["label"]} for i in range(8)]

    def clipped(rows):
        batch = _batch(rows)
        engine.reset()
        with engine.recording(len(rows)):
            trainer._summed_loss(model, batch)[0].backward()
        engine.finish_backward()
        sums = engine.pop_clipped_sums()  # a parameter no example reached (RoBERTa's unused pooler) has no sum
        return torch.cat([sums.get(p, torch.zeros_like(p)).flatten() for _, p in engine.parameters])

    base = clipped(base_rows)
    moves = [(clipped([*base_rows, {**data[i], "labels": 1 - data[i]["label"]}]) - base).norm().item()
             for i in (8, 9)]
    assert max(moves) <= CLIP * (1 + 1e-9) and max(moves) >= 0.5 * CLIP


@pytest.mark.parametrize("name", sorted(ROWS))
def test_noise_on_every_trainable_coordinate_and_nothing_else_changes(tmp_path, name):
    trainer = _trainer(tmp_path, name, learning_rate=1.0, optim="sgd", weight_decay=0.0)
    trainer.create_optimizer()
    before = snapshot(trainer.model)
    trainer.optimizer.step()  # an empty logical batch: the update is the noise alone
    after = snapshot(trainer.model)
    trainable = {f"param:{n}" for n, p in trainer.model.named_parameters() if p.requires_grad}
    noise = torch.cat([((before[k] - after[k]) * trainer.expected_batch_size).flatten() for k in sorted(trainable)])
    assert bool((noise != 0).all()), "a trainable coordinate got no noise"
    assert abs(noise.double().std().item() / (SIGMA * CLIP) - 1) < 5 / noise.numel() ** 0.5 + 0.02
    assert all(torch.equal(v, after[k]) for k, v in before.items() if k not in trainable)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_frozen_tensors_stay_bit_identical_and_the_card_recomputes_epsilon(tmp_path, name):
    trainer = _trainer(tmp_path, name, max_steps=3)
    before = snapshot(trainer.model)
    trainer.train()
    after = snapshot(trainer.model)
    trainable = {f"param:{n}" for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(torch.equal(v, after[k]) for k, v in before.items() if k not in trainable)
    assert trainer.ledger.total_steps == 3 == trainer.state.global_step
    trainer.save_model()
    privacy = ModelCard.load(tmp_path / "README.md").data.to_dict()["privacy"]
    assert privacy["method"] == name and sum(m["steps"] for m in privacy["mechanisms"]) == 3
    groups = [MechanismGroup.from_dict(m) for m in privacy["mechanisms"]]
    assert compute_epsilon(groups, privacy["delta"], privacy["accountant"]) == pytest.approx(privacy["epsilon"],
                                                                                             rel=1e-9)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_saved_adapter_reloads_onto_a_fresh_base_with_identical_logits(tmp_path, name):
    trainer = _trainer(tmp_path, name, max_steps=2)
    trainer.train()
    trainer.save_model()
    batch = {k: v for k, v in _batch([{**r, "labels": r["label"]} for r in tiny.sentiment_dataset(4, seed=7)]).items()
             if k != "labels"}
    expected = eval_logits(trainer.model, batch)
    _, factory = ROWS[name]
    reloaded = load_private_adapter(factory(), tmp_path)
    torch.testing.assert_close(eval_logits(reloaded, batch), expected, rtol=0, atol=0)
