"""Invariant 8: one example, one term, independent of the other examples of its chunk.

Multiple-choice rows are grouped per example (fp64 oracle, sensitivity ≤ C, training without a false self-check
alarm); packing several examples into one row is refused; the first-chunk probe refuses left padding with absolute
positions and layers that mix examples, and accepts left padding with positions taken from the attention mask.
"""

from __future__ import annotations

import random

import pytest
import torch
from datasets import Dataset
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorForMultipleChoice,
    DataCollatorWithPadding,
)

from hf_private import BitFitConfig, DPConfig, PrivateTrainer
from hf_private.data.rows import check_one_row_per_example
from hf_private.engine import PerExampleGradientEngine
from hf_private.engine.independence import check_example_independence
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny
from tests.support.helpers import make_trainer, snapshot, training_args

CHOICES = 4  # with 4 choices, per-row clipping lets one example move the sum by 2·C (measured 2.000·C)


def _summed_loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return default_per_example_loss(model, model(**inputs), batch["labels"]).sum()


def _mc_batch(indices, seed=1, mislabel=()) -> dict[str, torch.Tensor]:
    data = tiny.multiple_choice_dataset(max(indices) + 1, choices=CHOICES, seed=seed)
    features = [dict(data[i], label=(data[i]["label"] + (i in mislabel)) % CHOICES) for i in indices]
    return dict(DataCollatorForMultipleChoice(tiny.tokenizer())(features))


def _trainer(tmp_path, model, dataset, collator, **overrides) -> PrivateTrainer:
    args = training_args(tmp_path, **{"max_steps": 2, **overrides})
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=0)
    return PrivateTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, dp_config=dp)


# ---------------------------------------------------------------- multiple choice
def test_multiple_choice_matches_fp64_per_example_loop():
    """Example b's gradient is the gradient of its own loss over all of its choice rows."""
    model = tiny.roberta_multiple_choice().double().train()
    batch = _mc_batch(range(5))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for b in range(5):
        model.zero_grad()
        _summed_loss(model, {k: v[b : b + 1] for k, v in batch.items()}).backward()
        grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    model.zero_grad()
    ref_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in grads])
    clip = 0.5 * ref_norms.min().item()
    ref = torch.cat(
        [
            sum(min(1.0, clip / (n.item() + 1e-6)) * gs[i] for n, gs in zip(ref_norms, grads)).flatten()
            for i in range(len(params))
        ]
    )

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    for _ in range(2):  # the self-checked first chunk, then a ghost-differentiated one
        with engine.recording(5, CHOICES):
            _summed_loss(model, batch).backward()
        norms = engine.finish_backward()
        sums = engine.pop_clipped_sums()
        ours = torch.cat([sums[p].flatten() for p in params])
        norm_error = ((norms - ref_norms).abs().max() / ref_norms.max()).item()
        sum_error = ((ours - ref).norm() / ref.norm()).item()
        print(f"multiple choice vs fp64 loop: norms {norm_error:.1e}, clipped sums {sum_error:.1e}")
        assert norm_error <= 1e-6 and sum_error <= 1e-6
    assert engine.verified


def test_multiple_choice_one_extra_example_moves_the_sum_by_at_most_C():
    clip = 1e-3  # below every example's norm: each one is clipped
    model = tiny.roberta_multiple_choice().double().train()
    engine = PerExampleGradientEngine(model, clip)
    engine.attach()

    def clipped_sum(batch):
        engine.reset()
        with engine.recording(batch["labels"].shape[0], CHOICES):
            _summed_loss(model, batch).backward()
        engine.finish_backward()
        return torch.cat([engine.clipped_sums[p].flatten() for _, p in engine.parameters])

    base = clipped_sum(_mc_batch(range(8), seed=3))
    worst = max(
        (clipped_sum(_mc_batch([*range(8), extra], seed=3, mislabel={extra})) - base).norm().item()
        for extra in range(8, 12)
    )
    print(f"multiple-choice sensitivity: {worst / clip:.4f}·C")
    assert 0.9 * clip <= worst <= clip * (1 + 1e-9)


def test_self_check_accepts_a_bias_whose_gradient_cancels_to_zero():
    """The multiple-choice head's bias gets Σ_c (p_c - y_c) = 0 per example: rounding noise is no alarm (fp32)."""
    model = tiny.roberta_multiple_choice().train()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    batch = _mc_batch(range(64))
    with engine.recording(64, CHOICES):
        _summed_loss(model, batch).backward()
    engine.finish_backward()
    assert engine.verified


def test_multiple_choice_trains(tmp_path):
    """fp32, chunks of ~64 examples × 4 choices: the self-check sees the head bias's rounding noise."""
    model = tiny.roberta_multiple_choice()
    before = snapshot(model)
    trainer = _trainer(
        tmp_path,
        model,
        tiny.multiple_choice_dataset(256, choices=CHOICES),
        DataCollatorForMultipleChoice(tiny.tokenizer()),
        per_device_train_batch_size=64,
    )
    trainer.train()
    assert trainer.ledger.total_steps == 2 and not trainer.privacy_run.needs_independence_probe
    assert not torch.equal(before["param:classifier.weight"], model.classifier.weight.detach())


# ---------------------------------------------------------------- packing
@pytest.mark.parametrize(
    "extra, refused",
    [
        ({"cu_seq_lens_q": torch.tensor([0, 3, 5])}, True),
        ({"position_ids": torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])}, True),  # two examples in row 0
        ({"position_ids": torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]])}, False),  # padding carries position 1
        ({"position_ids": torch.arange(5).unsqueeze(0)}, False),  # broadcast over the batch
    ],
)
def test_collated_rows_must_not_hold_several_examples(extra, refused):
    batch = {
        "input_ids": torch.ones(2, 5, dtype=torch.long),
        "labels": torch.ones(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
        **extra,
    }
    if refused:
        with pytest.raises(ValueError, match="DataCollatorWithPadding"):
            check_one_row_per_example(batch, 2)
    else:
        check_one_row_per_example(batch, 2)


@pytest.mark.parametrize("examples, rows_per_example, rows", [(3, 1, 1), (2, 3, 5)])
def test_engine_refuses_terms_whose_rows_are_not_the_chunk_examples(examples, rows_per_example, rows):
    model = torch.nn.Linear(4, 2)
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with engine.recording(examples, rows_per_example):
        model(torch.randn(rows, 6, 4)).pow(2).sum().backward()  # e.g. a packed chunk: 3 examples in one row
    with pytest.raises(ValueError, match=r"<root> \(Linear\) computed gradients for .* per-row clipping"):
        engine.finish_backward()
    assert not engine._calls and all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- the first-chunk independence probe
class _LeftPadded:
    """Causal-LM collation with padding on the left and position_ids: none, counted from the row's start (what
    GPT-2 does without them: wrong for left padding), or counted from the attention mask (right)."""

    def __init__(self, positions: str | None) -> None:
        tok = tiny.tokenizer()
        tok.padding_side = "left"
        self.collate = DataCollatorForLanguageModeling(tok, mlm=False)
        self.positions = positions

    def __call__(self, features):
        batch = self.collate(features)
        mask = batch["attention_mask"]
        if self.positions == "row":
            batch["position_ids"] = torch.arange(mask.shape[-1]).expand_as(mask).clone()
        elif self.positions == "mask":
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
            # Token 0 is predicted from a padding position only when padded: alone it is never predicted.
            batch["labels"][torch.arange(mask.shape[0]), mask.argmax(-1)] = -100
        return batch


def _mostly_one_length(n: int, seed: int) -> Dataset:
    """The review's data: 75% of the sequences have one length (6 tokens), the rest 8 to 16."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = 6 if i % 4 else rng.randint(8, 16)
        rows.append([2] + [rng.randrange(4, tiny.VOCAB_SIZE) for _ in range(length - 1)])
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})


def _clipped_sum(engine: PerExampleGradientEngine, model, batch) -> torch.Tensor:
    engine.reset()
    with engine.recording(batch["input_ids"].shape[0]):
        _summed_loss(model, batch).backward()
    engine.finish_backward()
    return torch.cat([engine.clipped_sums[p].flatten() for _, p in engine.parameters])


@pytest.mark.parametrize("strategy", ["group_by_length", "random"])
@pytest.mark.parametrize("positions", [None, "row", "mask"])
def test_review_item_1_every_run_is_refused_or_moves_the_sum_by_at_most_C(tmp_path, strategy, positions):
    """Tiny GPT-2 (absolute positions), left padding, 75% of one length, C = 0.01, sorted and random chunks, three
    seeds. On main before the fix, group_by_length trained in 5 of 5 runs and one example moved the sum by 2.5·C."""
    clip = 0.01
    for seed in range(3):
        model = tiny.gpt2()
        args = training_args(
            tmp_path / f"{seed}",
            max_steps=2,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            train_sampling_strategy=strategy,
        )
        trainer = PrivateTrainer(
            model=model,
            args=args,
            train_dataset=_mostly_one_length(64, seed),
            data_collator=_LeftPadded(positions),
            dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=clip, noise_seed=seed),
        )
        if positions != "mask":
            before = snapshot(model)
            with pytest.raises(ValueError, match="left-padded" if positions is None else "depends on the other"):
                trainer.train()
            assert trainer.ledger.total_steps == 0
            assert all(torch.equal(v, snapshot(model)[k]) for k, v in before.items())
            continue
        trainer.train()
        assert trainer.ledger.total_steps == 2 and not trainer.privacy_run.needs_independence_probe
        engine = PerExampleGradientEngine(model.train(), clip)
        engine.attach()
        data = _mostly_one_length(64, seed)
        short = [data[i] for i in (1, 2, 3)]
        longest = {"input_ids": [2] + list(range(4, 19)), "attention_mask": [1] * 16}
        moved = (
            (
                _clipped_sum(engine, model, _LeftPadded("mask")([*short, longest]))
                - _clipped_sum(engine, model, _LeftPadded("mask")(short))
            )
            .norm()
            .item()
        )
        print(f"{strategy} seed {seed}: one 16-token example moved the clipped sum by {moved / clip:.4f}·C")
        assert moved <= clip * (1 + 1e-5)


def test_left_padding_without_positions_is_refused_on_every_chunk():
    batch = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]),
    }
    with pytest.raises(ValueError, match="left-padded.*padding_side = 'right'.*cumsum"):
        check_one_row_per_example(batch, 2)
    check_one_row_per_example({**batch, "attention_mask": batch["attention_mask"].flip(-1)}, 2)  # right padding
    check_one_row_per_example({**batch, "position_ids": (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)}, 2)


def test_probe_runs_again_after_the_trainable_set_switches(tmp_path, monkeypatch):
    """X+BiTFiT: full fine-tuning, then biases only; each trainable set is probed (a real and a spread chunk)."""
    from hf_private.engine import independence

    probed = []

    def counting(engine, *args, **kwargs):
        probed.append(len(engine.parameters))
        return check_example_independence(engine, *args, **kwargs)

    monkeypatch.setattr(independence, "check_example_independence", counting)
    dp = BitFitConfig(noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=0, full_finetune_epochs=0.25)
    trainer = PrivateTrainer(
        model=tiny.bert(),
        args=training_args(tmp_path, max_steps=4),
        train_dataset=tiny.sentiment_dataset(64),
        dp_config=dp,
        data_collator=DataCollatorWithPadding(tiny.tokenizer()),
    )
    trainer.train()
    assert trainer.plan.training_stages[1].start_step == 2
    assert len(probed) == 4 and probed[0] == probed[1] > probed[2] == probed[3], probed


class _AddBatchMean(torch.nn.Module):
    """No parameters, no hook to see it: every example's output depends on the whole chunk."""

    def forward(self, x):
        return x + x.mean(0, keepdim=True)


def test_layer_mixing_examples_is_refused(tmp_path):
    model = tiny.bert()
    model.bert.embeddings.dropout = _AddBatchMean()
    with pytest.raises(ValueError, match="depends on the other examples.*mixes examples"):
        make_trainer(tmp_path, model=model, max_steps=2).train()


def test_probe_leaves_sums_gradients_and_mode_as_they_were():
    model = tiny.bert().train()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    data = tiny.sentiment_dataset(6).rename_column("label", "labels")
    batch = dict(DataCollatorWithPadding(tiny.tokenizer())([data[i] for i in range(6)]))
    with engine.recording(6):
        _summed_loss(model, batch).backward()
    engine.finish_backward()
    sums = {p: s.clone() for p, s in engine.clipped_sums.items()}
    check_example_independence(engine, model, batch, _summed_loss, 6)
    assert model.training and not engine._calls and engine._chunk is None
    assert all(p.grad is None for p in model.parameters())
    assert sums.keys() == engine.clipped_sums.keys()
    assert all(torch.equal(s, engine.clipped_sums[p]) for p, s in sums.items())
