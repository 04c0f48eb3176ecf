"""DP DPO: `privatize(trl.DPOTrainer)` on a tiny Llama and a word-level tokenizer built in memory.

One unit is one preference pair: its chosen and rejected rows are clipped together, and its loss is its own (TRL's
formula for the loss type, never TRL's mean over the batch). The loss conformance tests hold every supported loss
type to TRL's own `_compute_loss`, pair by pair. The sensitivity tests go through the public API as the SFT ones do:
one SGD step at q = 1 under a test seed, so the noise replays and cancels between two runs; the released sum is
(W₀ − W₁)·B/lr. Mutation tests beside them clip chosen and rejected rows apart (the bound then fails) or put TRL's
mean over the batch back (the independence check then fails). The settings DPO refuses are rows of
tests/trainer/test_preflight.py.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel
from trl import DPOConfig, DPOTrainer  # the test extra installs trl: CI must run these, never skip them

import hf_private.trainer.mixin
from hf_private import DPConfig, privatize
from hf_private.demos.sentiment import NEGATIVE, NEUTRAL, POSITIVE
from hf_private.engine import PerExampleGradientEngine
from hf_private.evaluation.held_out import HELD_OUT, OVERLAPS, TrainingRows
from hf_private.integrations import family_of
from hf_private.integrations.trl_dpo import PAIR_LOSSES, PairCollator, reference_logps, sequence_logps
from tests.support import tiny
from tests.support.helpers import TRL_TEST_ARGS, run_doc_block

pytestmark = pytest.mark.usefixtures("single_thread")

SEED = 20261125
PrivateDPOTrainer = privatize(DPOTrainer)
FAMILY = family_of(PrivateDPOTrainer)


def dpo_config(tmp_path, **overrides) -> DPOConfig:
    defaults = dict(
        TRL_TEST_ARGS, per_device_train_batch_size=8, num_train_epochs=1, learning_rate=5e-3, logging_steps=1
    )
    return DPOConfig(str(tmp_path), **{**defaults, **overrides})


def dpo_trainer(tmp_path, dataset, *, model=None, ref_model=None, dp=None, trainer_kwargs=None, **config):
    return PrivateDPOTrainer(
        model if model is not None else tiny.llama(),
        ref_model,
        dpo_config(tmp_path, **config),
        train_dataset=dataset,
        processing_class=tiny.chat_tokenizer(),
        dp_config=dp or DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
        **(trainer_kwargs or {}),
    )


def moved_llama():
    """The tiny Llama, moved off its initial weights: a policy whose log-ratios to the reference are not zero."""
    model = tiny.llama()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model


# ---------------------------------------------------------------------- training, evaluation, what is logged
def test_trains_privately_with_the_pair_as_unit_and_evaluates_as_trl_does(tmp_path):
    reference = tiny.llama()
    frozen = {n: p.detach().clone() for n, p in reference.named_parameters()}
    trainer = dpo_trainer(
        tmp_path,
        tiny.preference_pairs(),
        ref_model=reference,
        trainer_kwargs={"eval_dataset": tiny.preference_pairs(8)},
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    report = trainer.privacy_report()
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] < float("inf")
    assert report["unit"] == "preference pair" and report["trainer"] == "trl.DPOTrainer"
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    # the reference is frozen: never trained, never given a gradient
    assert all(torch.equal(frozen[n], p) and p.grad is None for n, p in reference.named_parameters())
    # DPO's training metrics (rewards, margins, log-probabilities) are un-noised functions of the private batches
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert "epsilon" in logged and not {k for k in logged if k.startswith(("rewards/", "logps/", "logits/"))}
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_rewards/accuracies", "eval_logps/chosen"} <= set(metrics)


def test_the_positional_reference_model_is_bound_by_name(tmp_path):
    """DPOTrainer(model, ref_model, args, ...): its second parameter is the reference, not the arguments."""
    reference = tiny.llama()
    trainer = PrivateDPOTrainer(
        tiny.llama(),
        reference,
        dpo_config(tmp_path),
        None,
        tiny.preference_pairs(16),
        processing_class=tiny.chat_tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0),
    )
    assert trainer.ref_model is not None and trainer.args.max_length == 32 and trainer.dataset_size == 16


def test_each_pair_is_collated_as_its_chosen_row_then_its_rejected_row(tmp_path):
    trainer = dpo_trainer(tmp_path, tiny.preference_pairs(), ref_model=tiny.llama())
    features = [trainer.train_dataset[i] for i in range(3)]
    rows, pairs = trainer.data_collator(features), PairCollator(trainer.data_collator)(features)
    assert pairs["input_ids"].shape == (3, 2, rows["input_ids"].shape[1])
    for b in range(3):
        for key in ("input_ids", "attention_mask", "completion_mask"):
            assert torch.equal(pairs[key][b, 0], rows[key][b]) and torch.equal(pairs[key][b, 1], rows[key][3 + b])
    assert FAMILY.rows_per_unit(trainer.model, pairs) == 2


# ---------------------------------------------------------------------- every loss type: TRL's value, pair by pair
LOSS_SETTINGS = {
    **{name: {"loss_type": [name]} for name in PAIR_LOSSES},
    "exo_pair": {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    "robust": {"loss_type": ["robust"], "label_smoothing": 0.1},
    "sigmoid+sft-weighted": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    "ld_alpha": {"loss_type": ["sigmoid"], "ld_alpha": 0.5},
    "use_weighting": {"loss_type": ["hinge"], "use_weighting": True},
    "forward_kl": {"loss_type": ["sigmoid"], "f_divergence_type": "forward_kl"},
    "js_divergence": {"loss_type": ["ipo"], "f_divergence_type": "js_divergence"},
    "alpha_divergence": {
        "loss_type": ["sigmoid"],
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.5,
    },
}


@pytest.mark.parametrize("setting", list(LOSS_SETTINGS))
def test_each_pair_loss_is_trls_loss_for_that_pair_alone(setting, tmp_path):
    """TRL's `_compute_loss` on a batch of one pair is that pair's loss; ours must equal it for every pair of a
    batch, and their mean TRL's loss on the whole batch (but for 'sft', which TRL averages over the batch's chosen
    tokens and we over each pair's own)."""
    trainer = dpo_trainer(
        tmp_path, tiny.preference_pairs(), model=moved_llama(), ref_model=tiny.llama(), **LOSS_SETTINGS[setting]
    )
    model = trainer.model.eval()
    features = [trainer.train_dataset[i] for i in range(4)]
    with torch.no_grad():
        ours, _ = FAMILY.unit_losses(trainer, model, PairCollator(trainer.data_collator)(features))
        alone = torch.stack([trainer._compute_loss(model, trainer.data_collator([f]), False) for f in features])
        batch = trainer._compute_loss(model, trainer.data_collator(features), False)
    assert ours.shape == (4,) and float(ours.std()) > 0  # the pairs differ: a constant would prove nothing
    torch.testing.assert_close(ours, alone, rtol=1e-4, atol=1e-5)
    if "sft" not in LOSS_SETTINGS[setting]["loss_type"]:
        torch.testing.assert_close(ours.mean(), batch, rtol=1e-4, atol=1e-5)


def test_ld_alpha_weighs_only_the_longer_completions_tail():
    """LD-DPO on a pair of a 2-token and a 4-token completion: the last two tokens of the longer count α times."""
    tokens = torch.tensor([[[-1.0, -2.0, 0.0, 0.0, 0.0], [-1.0, -1.0, -3.0, -5.0, 0.0]]])  # shifted: t predicts t+1
    mask = torch.tensor([[[0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0]]])  # a prompt token, then the completion
    got = sequence_logps(tokens.flatten(0, 1), mask.flatten(0, 1), ld_alpha=0.25)
    torch.testing.assert_close(got, torch.tensor([[-3.0, -2.0 + 0.25 * -8.0]]))


# ---------------------------------------------------------------------- the reference
def test_with_lora_and_no_reference_model_the_base_model_is_the_reference(tmp_path):
    lora = LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", init_lora_weights=False
    )  # a non-zero adapter: the policy differs from its base
    trainer = dpo_trainer(tmp_path, tiny.preference_pairs(), trainer_kwargs={"peft_config": lora})
    assert trainer.ref_model is None and isinstance(trainer.model, PeftModel)
    pairs = PairCollator(trainer.data_collator)([trainer.train_dataset[i] for i in range(4)])
    rows = {k: pairs[k].flatten(0, 1) for k in ("input_ids", "attention_mask")}
    mask = pairs["completion_mask"].flatten(0, 1)

    class WithoutReference:
        ref_model = None

    base = tiny.llama()
    with torch.no_grad():
        expected_reference = reference_logps(type("T", (), {"ref_model": base})(), base, rows, mask, None)
        policy = sequence_logps(*_token_logps(trainer.model, rows, mask), None)
    got = reference_logps(WithoutReference(), trainer.model, rows, mask, None)
    torch.testing.assert_close(got, expected_reference)
    assert not torch.allclose(got, policy)  # the adapter was disabled for the reference, not just left on
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)  # and enabled again


def _token_logps(model, rows, mask):
    from hf_private.integrations.trl_dpo import completion_token_logps

    return completion_token_logps(model(**rows).logits, rows["input_ids"], mask), mask


def test_precomputed_reference_log_probs_give_the_same_pair_losses(tmp_path):
    live = dpo_trainer(tmp_path / "live", tiny.preference_pairs(16), model=moved_llama(), ref_model=tiny.llama())
    stored = dpo_trainer(
        tmp_path / "stored",
        tiny.preference_pairs(16),
        model=moved_llama(),
        ref_model=tiny.llama(),
        precompute_ref_log_probs=True,
    )
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(stored.train_dataset.column_names)
    dataset, collate = stored.training_data()
    batch = collate([dataset[i] for i in range(6)])
    assert "ref_chosen_logps" in batch
    with torch.no_grad():
        from_dataset, _ = FAMILY.unit_losses(stored, stored.model.eval(), batch)
        recomputed, _ = FAMILY.unit_losses(
            live, live.model.eval(), {k: v for k, v in batch.items() if not k.startswith("ref_")}
        )
    torch.testing.assert_close(from_dataset, recomputed, rtol=1e-4, atol=1e-5)
    stored.train()
    assert stored.privacy_report()["steps"] > 0


def test_training_pairs_with_precomputed_reference_log_probs_are_not_held_out(tmp_path):
    """precompute_ref_log_probs adds each pair's reference log-probabilities, computed for each set apart (in other
    batches, so possibly other floats): the held-out check compares the pairs themselves, never those columns."""
    trainer = dpo_trainer(
        tmp_path,
        tiny.preference_pairs(16),
        ref_model=tiny.llama(),
        precompute_ref_log_probs=True,
        trainer_kwargs={"eval_dataset": tiny.preference_pairs(16)},
    )
    rows = trainer._evaluations.training_rows
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(trainer.eval_dataset.column_names)
    assert rows.overlap(trainer.eval_dataset, "eval").verdict == OVERLAPS
    # the same pairs, tokenized only, their reference log-probabilities off in the last places
    nudged = trainer.eval_dataset.remove_columns(["prompt", "chosen", "rejected"]).map(
        lambda row: {"ref_chosen_logps": row["ref_chosen_logps"] * (1 + 1e-6)}
    )
    assert rows.overlap(nudged, "nudged").shared == 16
    # mutation: the derived columns kept in the pairs' keys
    kept = TrainingRows(rows.train_dataset, rows.input_columns, (), rows.pad_token_id)
    assert kept.overlap(nudged, "nudged").verdict == HELD_OUT
    trainer.evaluate()
    assert trainer._evaluations.results["eval"][0] == OVERLAPS
    # a set passed to evaluate() is judged as DPOTrainer.evaluate prepares it: as passed (no EOS on its completions,
    # no token columns) the training pairs repeat no prepared training pair
    assert rows.overlap(tiny.preference_pairs(16), "as passed").verdict == HELD_OUT
    trainer.evaluate(tiny.preference_pairs(16))
    assert trainer._evaluations.results["eval"][0] == OVERLAPS


# ---------------------------------------------------------------------- the adapter, the card
def test_a_lora_adapter_saves_and_reloads_with_stock_peft_and_generates(tmp_path):
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = dpo_trainer(tmp_path, tiny.preference_pairs(), learning_rate=5e-2, trainer_kwargs={"peft_config": lora})
    trainer.train()
    assert trainer.adapter_format == "peft"
    trainer.save_model(str(tmp_path / "adapter"))
    card = ModelCard.load(tmp_path / "adapter" / "README.md")
    privacy = card.data.to_dict()["privacy"]
    assert privacy["unit"] == "preference pair" and privacy["epsilon"] == pytest.approx(
        trainer.privacy_report()["epsilon"]
    )
    assert "one training preference pair" in card.text and "trl.DPOTrainer" in card.text

    reloaded = PeftModel.from_pretrained(tiny.llama(), str(tmp_path / "adapter")).eval()
    prompt = tiny.chat_tokenizer()("the movie was", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**prompt).logits, trainer.model.eval()(**prompt).logits)
        generated = reloaded.generate(**prompt, min_new_tokens=3, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 3


# ---------------------------------------------------------------------- sensitivity through the public API
def _pair(prompt: int, chosen: int, rejected: int, offset: int = 0) -> dict:
    """A pair whose chosen words are positive and rejected words negative: rows with different tokens, so their
    gradients do not cancel."""
    return {
        "prompt": " ".join(NEUTRAL[(offset + i) % len(NEUTRAL)] for i in range(prompt)),
        "chosen": " " + " ".join(POSITIVE[(offset + 2 * i) % len(POSITIVE)] for i in range(chosen)),
        "rejected": " " + " ".join(NEGATIVE[(offset + 3 * i) % len(NEGATIVE)] for i in range(rejected)),
    }


SHORT = [_pair(1, 1, 1, i) for i in range(6)]
LONG = [_pair(6, 8 - i, 3 + i, 5 * i) for i in range(6)]
ADDED = _pair(2, 10, 10, 3)


def released_sum(tmp_path, rows: list[dict], clip: float, **config) -> torch.Tensor:
    """Σ of the clipped per-pair gradients plus the replayed noise, read off one SGD step at q = 1."""
    model = tiny.llama()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    trainer = dpo_trainer(
        tmp_path,
        Dataset.from_list(rows),
        model=model,
        ref_model=tiny.llama(),
        dp=DPConfig(noise_multiplier=0.2, max_grad_norm=clip, noise_seed=SEED),
        per_device_train_batch_size=len(rows),
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        beta=1.0,
        **config,
    )
    assert trainer.sample_rate == 1.0
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double()
    return (before - after) * len(rows)


def sensitivity(tmp_path, rows: list[dict], clip: float, **config) -> float:
    return float(
        (
            released_sum(tmp_path / "with", [*rows, ADDED], clip, **config)
            - released_sum(tmp_path / "without", rows, clip, **config)
        ).norm()
    )


# Below every row's gradient norm (each ≥ 0.1 here): every pair, and with rows clipped apart every row, is clipped.
CLIP = 0.02


def test_adding_one_pair_moves_the_released_sum_by_at_most_C(tmp_path):
    for mates in (SHORT, LONG):
        assert sensitivity(tmp_path, mates, CLIP) <= CLIP * (1 + 1e-4)


def test_the_sensitivity_test_fails_when_chosen_and_rejected_rows_are_clipped_apart(tmp_path, monkeypatch):
    """Hooks that clip rows: the engine told that each row is an example. The pair then moves the sum by ‖g_c‖ and
    ‖g_r‖ clipped apart, ≈ √2·C for its near-orthogonal rows (up to 2C), while the accountant assumes C."""
    recording = PerExampleGradientEngine.recording

    def row_by_row(self, batch_size, rows_per_example=1, probe=False, packed=None):
        return recording(self, batch_size * rows_per_example, 1, probe, packed)

    monkeypatch.setattr(PerExampleGradientEngine, "recording", row_by_row)
    # the probe recomputes whole pairs alone, which the mutated engine no longer groups: it is not what is tested here
    monkeypatch.setattr(hf_private.trainer.mixin, "probe_example_independence", lambda *args, **kwargs: None)
    assert sensitivity(tmp_path, SHORT, CLIP) > 1.3 * CLIP


HUGE = 50.0  # above every pair's gradient norm here: nothing is clipped


def contributions(tmp_path, clip: float) -> list[torch.Tensor]:
    return [
        released_sum(tmp_path / f"{name}+", [*mates, ADDED], clip) - released_sum(tmp_path / name, mates, clip)
        for name, mates in (("short", SHORT), ("long", LONG))
    ]


def test_a_pairs_contribution_does_not_depend_on_its_batch_mates(tmp_path):
    next_to_short, next_to_long = contributions(tmp_path, HUGE)
    assert next_to_short.norm() > 0
    torch.testing.assert_close(next_to_short, next_to_long, rtol=0, atol=1e-3 * float(next_to_short.norm()))


def _batch_mean(unit_losses):
    """TRL's reduction put back: every pair's loss over the number of pairs in its chunk."""

    def losses(self, trainer, model, inputs):
        values, outputs = unit_losses(self, trainer, model, inputs)
        return values / values.shape[0], outputs

    return losses


def test_the_independence_test_fails_when_trls_batch_mean_is_put_back(tmp_path, monkeypatch):
    monkeypatch.setattr(type(FAMILY), "unit_losses", _batch_mean(type(FAMILY).unit_losses))
    with pytest.raises(ValueError, match="its gradient depends on the other examples"):
        released_sum(tmp_path / "probed", [*SHORT, ADDED], HUGE)
    monkeypatch.setattr(hf_private.trainer.mixin, "probe_example_independence", lambda *args, **kwargs: None)
    next_to_short, next_to_long = contributions(tmp_path, HUGE)
    assert float((next_to_short - next_to_long).norm()) > 0.1 * float(next_to_short.norm())


# ---------------------------------------------------------------------- the docs' script
def test_docs_dpo_script_runs_as_written(tmp_path, monkeypatch, capsys):
    """The python block under "DP DPO with TRL", executed unchanged: a LoRA adapter trained privately on preference
    pairs (the adapter-disabled base as reference), saved with a card naming the unit, the trainer and ε."""
    namespace = run_doc_block("guides/dpo.md", tmp_path, monkeypatch)
    assert "preference pair" in capsys.readouterr().out
    report = namespace["trainer"].privacy_report()
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] <= 8.0
    card = ModelCard.load(tmp_path / "out-dpo" / "README.md")
    assert card.data.to_dict()["privacy"]["epsilon"] == pytest.approx(report["epsilon"])
    assert "one training preference pair" in card.text and "trl.DPOTrainer" in card.text
    assert (tmp_path / "out-dpo" / "adapter_model.safetensors").is_file()
