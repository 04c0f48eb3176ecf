"""Privacy hardening (issue 17, items 4 and 5): interrupted batches and non-finite records.

An interrupted logical batch must never be released inside the next one (its records would get 2·C), and one
non-finite record must contribute exactly zero instead of turning the release into NaN when it is sampled.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorWithPadding

from hf_private import DPConfig, PrivateTrainer
from hf_private.engine import PerExampleGradientEngine
from hf_private.engine.terms import IndexTerm, OuterTerm, SampleTerm
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny
from tests.support.helpers import make_trainer, snapshot, training_args

CLIP = 0.5
BAD = 2  # the non-finite example of the engine tests


# ---------------------------------------------------------------- the engine drops a non-finite example
def _regression_batch(examples: list[int], labels: list[float]) -> dict[str, torch.Tensor]:
    """Padded to a fixed length, so an example's activations do not depend on which others share its batch."""
    data = tiny.sentiment_dataset(8, seed=5)
    texts = [" ".join(tiny.VOCAB[i] for i in data[b]["input_ids"][1:-1]) for b in examples]
    batch = tiny.tokenizer()(texts, padding="max_length", max_length=tiny.SEQ_LEN, truncation=True, return_tensors="pt")
    return {**batch, "labels": torch.tensor([labels[b] for b in examples], dtype=torch.float64)}


def _clip_and_sum(engine, model, batch) -> tuple[torch.Tensor, set[type]]:
    engine.reset()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with engine.recording(batch["labels"].shape[0]):
        default_per_example_loss(model, model(**inputs), batch["labels"]).sum().backward()
    kinds = {type(term) for call in engine._calls for term in call.terms.values()}
    engine.finish_backward()
    return torch.cat([engine.clipped_sums[p].flatten() for _, p in engine.parameters]), kinds


def _inf_activations(example: int):
    def hook(module, args, output):
        scale = torch.ones(output.shape[0], 1, 1, dtype=output.dtype)
        scale[example] = math.inf
        return output * scale

    return hook


@pytest.mark.parametrize("cause", ["nan-label", "inf-activation"])
def test_non_finite_example_contributes_exactly_zero(cause):
    model = tiny.bert(num_labels=1).double().train()  # a regression head: a float label can be NaN
    engine = PerExampleGradientEngine(model, CLIP)
    engine.attach()
    labels = [0.3, -1.2, 0.8, 2.0, -0.4, 1.1]
    everyone, others = list(range(6)), [b for b in range(6) if b != BAD]
    if cause == "nan-label":
        labels[BAD] = math.nan
        handle = None
    else:
        handle = model.bert.embeddings.register_forward_hook(_inf_activations(BAD))
    with_bad, kinds = _clip_and_sum(engine, model, _regression_batch(everyone, labels))
    if handle is not None:
        handle.remove()
    assert not engine.verified, "the autograd self-check must wait for a chunk without a non-finite example"
    without, _ = _clip_and_sum(engine, model, _regression_batch(others, labels))
    assert engine.verified
    assert kinds == {OuterTerm, IndexTerm, SampleTerm}, f"every term path must be exercised, got {kinds}"
    assert torch.isfinite(with_bad).all(), f"{(~torch.isfinite(with_bad)).sum()} non-finite coordinates released"
    difference = (with_bad - without).abs().max().item()
    print(f"{cause}: max |Σ with - Σ without| = {difference:.3g} (‖Σ‖ = {without.norm():.3g})")
    assert difference <= 1e-12 * without.norm().item()


# ---------------------------------------------------------------- the trainer
def _trainer(tmp_path, per_example_loss, dataset=None, model=None, **overrides) -> PrivateTrainer:
    tok = tiny.tokenizer()
    args = {"per_device_train_batch_size": 4, "max_steps": 2, **overrides}
    return PrivateTrainer(
        model=model if model is not None else tiny.bert(),
        args=training_args(tmp_path, **args),
        train_dataset=dataset if dataset is not None else tiny.sentiment_dataset(96),
        data_collator=DataCollatorWithPadding(tok),
        dp_config=DPConfig(noise_multiplier=1.0, noise_seed=0),
        per_example_loss=per_example_loss,
    )


def _with_float_label(value: float) -> Dataset:
    data = tiny.sentiment_dataset(16).to_dict()
    data["label"] = [float(x) for x in data["label"]]
    data["label"][3] = value
    return Dataset.from_dict(data)


def test_finite_float_labels_are_accepted(tmp_path):
    make_trainer(tmp_path, model=tiny.bert(num_labels=1), dataset=_with_float_label(0.5))


@pytest.mark.parametrize(
    "reduce",
    [lambda losses: losses.mean(), lambda losses: losses[:, None], lambda losses: losses[1:]],
    ids=["batch-mean", "column", "one-short"],
)
def test_per_example_loss_must_return_one_value_per_example(tmp_path, reduce):
    def loss(model, outputs, labels):
        return reduce(default_per_example_loss(model, outputs, labels))

    trainer = _trainer(tmp_path, loss)
    with pytest.raises(
        ValueError,
        match=r"per_example_loss must return a tensor of shape \[B\] = \[\d+\].*got "
        r"shape \[.*\]\. A batch-mean or scalar loss is not allowed",
    ):
        trainer.train()
    assert trainer.ledger.total_steps == 0


def test_logged_loss_and_weights_stay_finite_when_one_loss_is_not(tmp_path):
    """Example 0 (the only label 2) has an infinite loss, and is in every logical batch (q = 1)."""
    data = tiny.sentiment_dataset(16).to_dict()
    data["label"][0] = 2

    def loss(model, outputs, labels):
        scale = torch.where(labels == 2, math.inf, 1.0)
        return default_per_example_loss(model, outputs, labels) * scale

    trainer = _trainer(
        tmp_path,
        loss,
        dataset=Dataset.from_dict(data),
        model=tiny.bert(num_labels=3),
        per_device_train_batch_size=16,
        logging_nan_inf_filter=False,
    )
    before = snapshot(trainer.model)
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"logged losses: {logged}")
    assert len(logged) == 2 and all(math.isfinite(x) and x > 0 for x in logged)
    for name, p in trainer.model.named_parameters():
        assert torch.isfinite(p).all(), f"{name} became non-finite"
        assert not torch.equal(p, before[f"param:{name}"]), f"{name} did not train"


# ---------------------------------------------------------------- an interrupted logical batch
def test_recording_forgets_a_chunk_that_raised():
    model = tiny.bert().train()
    engine = PerExampleGradientEngine(model, CLIP)
    engine.attach()
    batch = tiny.tokenizer()(["good movie", "bad plot"], padding=True, return_tensors="pt")
    with pytest.raises(KeyboardInterrupt):
        with engine.recording(2):  # unverified: autograd's own (un-clipped) gradients are on
            default_per_example_loss(model, model(**batch), torch.tensor([1, 0])).sum().backward()
            raise KeyboardInterrupt
    assert not engine._calls
    assert all(p.grad is None and p.requires_grad for _, p in engine.parameters)
    with pytest.raises(RuntimeError, match="must follow a backward pass"):
        engine.finish_backward()


def _flat(engine, sums) -> torch.Tensor:
    return torch.cat([sums[p].flatten() if p in sums else torch.zeros(p.numel()) for _, p in engine.parameters])


def _spy_on_releases(engine, events: list) -> None:
    """Log each chunk's contribution to the clipped sums and each noiseless sum the optimizer releases."""
    finish, pop = engine.finish_backward, engine.pop_clipped_sums

    def finish_backward():
        before = _flat(engine, engine.clipped_sums)
        norms = finish()
        events.append(("chunk", _flat(engine, engine.clipped_sums) - before))
        return norms

    def pop_clipped_sums():
        sums = pop()
        events.append(("release", _flat(engine, sums)))
        return sums

    engine.finish_backward, engine.pop_clipped_sums = finish_backward, pop_clipped_sums


@pytest.mark.parametrize("how", ["train-again", "out-of-memory-retry"])
def test_interrupted_logical_batch_is_not_released_with_the_next(tmp_path, how):
    """The 2nd training chunk of the first logical batch raises; the first release must hold only fresh chunks.

    "train-again": the user calls train() again. "out-of-memory-retry": Trainer's auto_find_batch_size catches
    the error and re-runs its loop inside the same train() call, never passing through PrivateTrainer.train.
    """
    events: list = []
    calls = {"training": 0}

    def flaky_loss(model, outputs, labels):
        if model.training:
            calls["training"] += 1
            if calls["training"] == 2:
                events.append(("interrupted", None))
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return default_per_example_loss(model, outputs, labels)

    trainer = _trainer(
        tmp_path, flaky_loss, gradient_accumulation_steps=2, auto_find_batch_size=how == "out-of-memory-retry"
    )
    _spy_on_releases(trainer.engine, events)
    if how == "train-again":
        with pytest.raises(RuntimeError, match="allocate memory"):
            trainer.train()
    trainer.train()
    kinds = [kind for kind, _ in events]
    cut = kinds.index("interrupted")
    assert "release" not in kinds[:cut]
    stale = [c for kind, c in events[:cut] if kind == "chunk"]
    assert stale and any(c.norm() > 0 for c in stale), "the interrupted batch must have finished a chunk"
    first = kinds.index("release")
    fresh = torch.stack([c for kind, c in events[cut:first] if kind == "chunk"]).sum(0)
    released = events[first][1]
    print(
        f"{how}: ‖stale‖ = {torch.stack(stale).sum(0).norm():.4g}, ‖fresh‖ = {fresh.norm():.4g}, "
        f"‖released - fresh‖ = {(released - fresh).norm():.3g}"
    )
    assert torch.allclose(released, fresh, rtol=0, atol=1e-6)
