"""Padding-free packing (`hf_private.packing`): a chunk's examples end to end in one row, each still clipped alone.

The same examples packed (DataCollatorWithFlattening) and padded one per row (DataCollatorForLanguageModeling) must
give the engine equal per-example norms and clipped sums, and through the public API equal released updates under a
test seed; adding one example to a packed batch moves the release by at most C. Each of these fails when the packed
examples' boundaries are wrong (a mutation test beside them), and attention across examples is caught by the probe.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, masking_utils

import hf_private.engine.packed_tokens
from hf_private import DPConfig, PackedClassificationCollator, PrivateTrainer
from hf_private.engine import PerExampleGradientEngine
from hf_private.losses import default_per_example_loss, is_causal_lm, packed_causal_lm_losses
from hf_private.packing import PACKED_LENGTHS_KEY, packed_lengths, slice_packed
from hf_private.sampling import EmptySafeCollator
from tests import tiny
from tests.helpers import training_args

pytestmark = pytest.mark.usefixtures("single_thread")

SEED = 20261125
MODELS = {"gpt2": tiny.gpt2, "llama": tiny.llama}


def build(name: str, lora: bool) -> torch.nn.Module:
    model = MODELS[name]()
    if lora:
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0))
    return model.train()


def _features(n: int, seed: int = 0) -> list[dict]:
    data = tiny.lm_dataset(n, seed=seed)
    return [{"input_ids": data[i]["input_ids"]} for i in range(n)]


def packed_batch(features: list[dict]) -> dict:
    return EmptySafeCollator(DataCollatorWithFlattening(), features[0])(features)


def padded_batch(features: list[dict]) -> dict:
    return dict(DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False)(features))


def engine_results(model, batch: dict, clip: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(per-example norms, clipped sums) of one chunk, read from a fresh engine; a packed causal LM's loss as the
    trainer computes it, any other model's from one output per example."""
    batch = dict(batch)
    lengths = batch.pop(PACKED_LENGTHS_KEY, None)
    labels = batch.pop("labels")
    examples = len(lengths) if lengths is not None else labels.shape[0]

    def summed_loss():
        if lengths is None or not is_causal_lm(model):
            return default_per_example_loss(model, model(**batch), labels).sum()
        logits = model(**batch, use_cache=False).logits  # as the trainer runs a packed chunk
        return packed_causal_lm_losses(logits, labels, lengths).sum()

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    try:
        with engine.recording(examples, probe=True, packed=lengths):
            summed_loss().backward()
        norms = engine.finish_backward()
        with engine.recording(examples, packed=lengths):
            summed_loss().backward()
        engine.finish_backward()
        sums = engine.pop_clipped_sums()
    finally:
        engine.detach()
    return norms, [sums[p] for _, p in engine.parameters]


# ---------------------------------------------------------------------- what a packed chunk is
def test_a_packed_chunk_says_how_long_each_example_is_and_slices_by_examples():
    features = _features(5)
    batch = packed_batch(features)
    lengths = batch[PACKED_LENGTHS_KEY]
    assert lengths.tolist() == [len(f["input_ids"]) for f in features]
    assert batch["input_ids"].shape == (1, int(lengths.sum()))
    part = slice_packed(batch, 1, 3)
    assert part[PACKED_LENGTHS_KEY].tolist() == lengths[1:3].tolist()
    assert part["input_ids"][0].tolist() == features[1]["input_ids"] + features[2]["input_ids"]
    assert part["position_ids"][0].tolist() == [*range(lengths[1]), *range(lengths[2])]


@pytest.mark.parametrize("change, message", [
    (lambda b: {**b, "attention_mask": torch.ones_like(b["input_ids"])}, "carries an attention_mask"),
    (lambda b: {k: torch.cat([v, v.new_zeros(1, 3)], 1) if torch.is_tensor(v) and v.dim() == 2 else v
                for k, v in b.items()}, "runs of position_ids restarting at 0 for 4 examples"),  # padded row
    (lambda b: {k: v.reshape(2, -1) if k != "labels" and torch.is_tensor(v) else v.reshape(2, -1)
                for k, v in b.items()}, "The packed batch has 2 rows"),
])
def test_padded_split_or_masked_packed_rows_are_refused(change, message):
    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10]}, {"input_ids": [11, 12, 13]},
                {"input_ids": [14, 15, 16]}]
    batch = dict(DataCollatorWithFlattening()(features))
    assert packed_lengths(batch, 4).tolist() == [3, 3, 3, 3]
    with pytest.raises(ValueError, match=message):
        packed_lengths(change(batch), 4)


# ---------------------------------------------------------------------- packed = padded, example by example
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_and_padded_give_equal_norms_and_clipped_sums(name, lora):
    features = _features(6)
    model = build(name, lora)
    norms, _ = engine_results(model, padded_batch(features), clip=1.0)
    clip = float(norms.median())  # half the examples clipped
    padded_norms, padded_sums = engine_results(model, padded_batch(features), clip)
    packed_norms, packed_sums = engine_results(model, packed_batch(features), clip)
    torch.testing.assert_close(packed_norms, padded_norms, rtol=1e-5, atol=1e-7)
    for packed, padded in zip(packed_sums, padded_sums):
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


def test_the_equality_test_fails_when_the_packed_boundaries_are_wrong(monkeypatch):
    """Boundaries shifted by one token (each example takes its neighbour's first token): the norms differ."""
    features = _features(6)
    model = build("gpt2", lora=False)
    padded_norms, _ = engine_results(model, padded_batch(features), clip=0.5)
    real = hf_private.engine.packed_tokens.PackedTokens.__init__

    def shifted(self, lengths):
        lengths = torch.as_tensor(lengths).clone()
        lengths[0] += 1
        lengths[-1] -= 1
        real(self, lengths)

    monkeypatch.setattr(hf_private.engine.packed_tokens.PackedTokens, "__init__", shifted)
    packed_norms, _ = engine_results(model, packed_batch(features), clip=0.5)
    assert not torch.allclose(packed_norms, padded_norms, rtol=1e-3)


def test_packed_rows_are_refused_when_the_engine_does_not_split_them(monkeypatch):
    monkeypatch.setattr(hf_private.engine.packed_tokens.PackedTokens, "holds", lambda self, tensor: False)
    with pytest.raises(ValueError, match="computed gradients for 1 rows.*per-row clipping"):
        engine_results(build("gpt2", lora=False), packed_batch(_features(6)), clip=0.5)


def test_attention_across_packed_examples_changes_the_norms(monkeypatch):
    """Without the block-diagonal mask transformers builds from the restarting positions, examples see each other:
    the norms then differ from the padded ones (what the trainer's independence probe detects)."""
    features = _features(6)
    model = build("llama", lora=False)
    padded_norms, _ = engine_results(model, padded_batch(features), clip=0.5)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    packed_norms, _ = engine_results(model, packed_batch(features), clip=0.5)
    assert not torch.allclose(packed_norms[1:], padded_norms[1:], rtol=1e-3)


# ---------------------------------------------------------------------- through the public API
def released_update(tmp_path, name: str, lora: bool, features: list[dict], collator, clip: float) -> torch.Tensor:
    """Σ of the clipped per-example gradients plus the replayed noise: one SGD step at q = 1, (W₀ − W₁)·B/lr."""
    from datasets import Dataset

    model = build(name, lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    before = torch.cat([p.detach().flatten() for p in trained]).double()
    dataset = Dataset.from_dict({"input_ids": [f["input_ids"] for f in features]})
    trainer = PrivateTrainer(
        model=model, args=training_args(tmp_path, per_device_train_batch_size=len(features), max_steps=1,
                                        learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                                        weight_decay=0.0),
        train_dataset=dataset, data_collator=collator, processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=0.2, max_grad_norm=clip, noise_seed=SEED))
    assert trainer.sample_rate == 1.0
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trained]).double()
    return (before - after) * len(features)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_and_padded_training_release_equal_updates(tmp_path, name, lora):
    features = _features(8)
    padded = released_update(tmp_path / "padded", name, lora, features,
                             DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False), clip=0.5)
    packed = released_update(tmp_path / "packed", name, lora, features, DataCollatorWithFlattening(), clip=0.5)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


CLIP = 0.01  # below every example's gradient norm here


@pytest.mark.parametrize("name", sorted(MODELS))
def test_adding_one_example_to_a_packed_batch_moves_the_release_by_at_most_C(tmp_path, name):
    mates = _features(7)
    added = _features(1, seed=5)
    with_it = released_update(tmp_path / "with", name, False, mates + added, DataCollatorWithFlattening(), CLIP)
    without = released_update(tmp_path / "without", name, False, mates, DataCollatorWithFlattening(), CLIP)
    moved = float((with_it - without).norm())
    assert 0.5 * CLIP < moved <= CLIP * (1 + 1e-4)


@pytest.mark.parametrize("collator", [DataCollatorWithFlattening, PackedClassificationCollator])
def test_a_stock_encoder_head_with_packed_batches_is_refused(tmp_path, collator):
    from datasets import Dataset

    data = tiny.sentiment_dataset(16)
    columns = {"input_ids": data["input_ids"]} if collator is DataCollatorWithFlattening else {
        "input_ids": data["input_ids"], "label": data["label"]}
    trainer = PrivateTrainer(
        model=tiny.bert(), args=training_args(tmp_path, per_device_train_batch_size=8, max_steps=1),
        train_dataset=Dataset.from_dict(columns), data_collator=collator(), processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0))
    with pytest.raises(ValueError, match="Packed batches are supported for causal LMs and hf_private's mean-pooled "
                                         "classifiers .*not BertForSequenceClassification"):
        trainer.train()
    assert trainer.ledger.total_steps == 0


# ---------------------------------------------------------------------- hf_private's mean-pooled classifiers
ENCODERS = {"bert": tiny.mean_pooled_bert, "roberta": tiny.mean_pooled_roberta}


def _sentences(n: int, seed: int = 0) -> list[dict]:
    data = tiny.sentiment_dataset(n, seed=seed)
    return [{"input_ids": data[i]["input_ids"], "label": data[i]["label"]} for i in range(n)]


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_a_mean_pooled_classifier_gives_packed_sentences_their_padded_norms_and_sums(name):
    from transformers import DataCollatorWithPadding

    sentences = _sentences(6)
    model = ENCODERS[name]().train()
    padded = dict(DataCollatorWithPadding(tiny.tokenizer())(sentences))
    packed = EmptySafeCollator(PackedClassificationCollator(), sentences[0])(sentences)
    assert packed["input_ids"].shape[0] == 1 and packed["labels"].shape == (6,)
    norms, _ = engine_results(model, padded, clip=1.0)
    clip = float(norms.median())
    padded_norms, padded_sums = engine_results(model, padded, clip)
    packed_norms, packed_sums = engine_results(model, packed, clip)
    torch.testing.assert_close(packed_norms, padded_norms, rtol=1e-5, atol=1e-7)
    for a, b in zip(packed_sums, padded_sums):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_encoder_equality_fails_without_the_block_diagonal_mask(monkeypatch):
    """Packed sentences attending to each other (the mask left out): their norms change."""
    from transformers import DataCollatorWithPadding

    sentences = _sentences(6)
    model = tiny.mean_pooled_bert().train()
    padded_norms, _ = engine_results(model, dict(DataCollatorWithPadding(tiny.tokenizer())(sentences)), 1.0)
    real = model.base_model.forward
    monkeypatch.setattr(model.base_model, "forward", lambda *a, attention_mask=None, **kw: real(*a, **kw))
    packed = EmptySafeCollator(PackedClassificationCollator(), sentences[0])(sentences)
    packed_norms, _ = engine_results(model, packed, 1.0)
    assert not torch.allclose(packed_norms, padded_norms, rtol=1e-3)


def classifier_update(tmp_path, sentences: list[dict], collator, clip: float) -> torch.Tensor:
    from datasets import Dataset

    model = tiny.mean_pooled_bert()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    trainer = PrivateTrainer(
        model=model, args=training_args(tmp_path, per_device_train_batch_size=len(sentences), max_steps=1,
                                        learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                                        weight_decay=0.0),
        train_dataset=Dataset.from_list(sentences), data_collator=collator, processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=0.2, max_grad_norm=clip, noise_seed=SEED))
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double()
    return (before - after) * len(sentences)


def test_packed_sentences_train_a_mean_pooled_classifier_as_padded_ones_do(tmp_path):
    from transformers import DataCollatorWithPadding

    sentences = _sentences(8)
    padded = classifier_update(tmp_path / "padded", sentences, DataCollatorWithPadding(tiny.tokenizer()), 0.5)
    packed = classifier_update(tmp_path / "packed", sentences, PackedClassificationCollator(), 0.5)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)
    moved = float((classifier_update(tmp_path / "more", sentences + _sentences(1, seed=4),
                                     PackedClassificationCollator(), CLIP)
                   - classifier_update(tmp_path / "less", sentences, PackedClassificationCollator(), CLIP)).norm())
    assert 0.5 * CLIP < moved <= CLIP * (1 + 1e-4)


def test_the_trainers_probe_refuses_packed_examples_that_attend_to_each_other(tmp_path, monkeypatch):
    """The mask transformers builds from restarting positions, removed: the first packed chunk's probe sees an
    example's norm change with its chunk-mates and refuses the run before any release."""
    from datasets import Dataset

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    trainer = PrivateTrainer(
        model=tiny.llama(), args=training_args(tmp_path, per_device_train_batch_size=8, max_steps=1),
        train_dataset=Dataset.from_dict({"input_ids": [f["input_ids"] for f in _features(16)]}),
        data_collator=DataCollatorWithFlattening(), processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0))
    with pytest.raises(ValueError, match="depends on the other examples"):
        trainer.train()
    assert trainer.ledger.total_steps == 0


# ---------------------------------------------------------------------- TRL's padding-free SFT, users
def sft_update(tmp_path, padding_free: bool, rows: list[dict], **config) -> torch.Tensor:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_private import privatize
    from tests.helpers import TRL_TEST_ARGS

    model = tiny.llama()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    args = SFTConfig(str(tmp_path), **{**TRL_TEST_ARGS, "max_length": None, **config}, padding_free=padding_free,
                     per_device_train_batch_size=len(rows), max_steps=1, learning_rate=1.0, optim="sgd",
                     lr_scheduler_type="constant", weight_decay=0.0)
    trainer = privatize(SFTTrainer)(model, args, train_dataset=Dataset.from_list(rows),
                                    processing_class=tiny.chat_tokenizer(),
                                    dp_config=DPConfig(noise_multiplier=0.2, max_grad_norm=0.05, noise_seed=SEED))
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double()
    return (before - after) * len(rows)


def test_trl_padding_free_sft_releases_what_padded_sft_releases(tmp_path):
    rows = [{"prompt": p["prompt"], "completion": p["completion"]} for p in tiny.prompt_completions(8)]
    padded = sft_update(tmp_path / "padded", False, rows)
    packed = sft_update(tmp_path / "packed", True, rows)
    assert padded.norm() > 0
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


def test_trl_bfd_packing_samples_sequences_and_releases_what_padded_sft_releases(tmp_path):
    """packing=True (BFD, rows of 64 tokens: every sequence shorter, none truncated): TRL's packed rows are split back
    into their sequences, so N counts sequences, and the release equals padded SFT's."""
    rows = [{"prompt": p["prompt"], "completion": p["completion"]} for p in tiny.prompt_completions(8)]
    padded = sft_update(tmp_path / "padded", False, rows)
    packed = sft_update(tmp_path / "bfd", False, rows, packing=True, max_length=64)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


def test_trl_bfd_packing_counts_sequences_not_packed_rows(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_private import privatize
    from tests.helpers import TRL_TEST_ARGS

    args = SFTConfig(str(tmp_path), **{**TRL_TEST_ARGS, "max_length": 64}, packing=True,
                     per_device_train_batch_size=4, max_steps=2)
    trainer = privatize(SFTTrainer)(tiny.llama(), args, train_dataset=Dataset.from_list(tiny.prompt_completions(24)),
                                    processing_class=tiny.chat_tokenizer(), dp_config=DPConfig(noise_multiplier=1.0))
    assert len(trainer.train_dataset) == trainer.dataset_size == 24 and "seq_lengths" not in \
        trainer.train_dataset.column_names
    trainer.train()
    assert trainer.ledger.total_steps == 2 and trainer.sample_rate == pytest.approx(4 / 24)


def test_packed_chunks_group_a_users_examples(tmp_path):
    """ULS with a packing collator: a user's drawn examples are packed in the same row and clipped as one unit."""
    from datasets import Dataset

    features = _features(24)
    dataset = Dataset.from_dict({"input_ids": [f["input_ids"] for f in features],
                                 "user_id": [i % 6 for i in range(24)]})
    dp = DPConfig(noise_multiplier=1.0, privacy_unit="user", user_column="user_id", examples_per_user=3)
    trainer = PrivateTrainer(
        model=tiny.gpt2(), args=training_args(tmp_path, per_device_train_batch_size=3, max_steps=2),
        train_dataset=dataset, data_collator=DataCollatorWithFlattening(), processing_class=tiny.tokenizer(),
        dp_config=dp)
    trainer.train()
    assert trainer.privacy_report()["unit"] == "user" and trainer.ledger.total_steps == 2


def test_a_poisson_chunk_larger_than_the_device_batch_is_sliced_by_examples_as_padded_chunks_are(tmp_path,
                                                                                                 monkeypatch):
    """q < 1: some Poisson chunks hold more examples than per_device_train_batch_size and are cut into pieces, a
    packed row by its examples' tokens; three steps end at the padded run's weights."""
    from datasets import Dataset

    import hf_private.trainer

    sliced = []
    real = hf_private.trainer.slice_packed
    monkeypatch.setattr(hf_private.trainer, "slice_packed",
                        lambda batch, start, stop: sliced.append(stop - start) or real(batch, start, stop))
    dataset = Dataset.from_dict({"input_ids": [f["input_ids"] for f in _features(16)]})
    weights = []
    for collator in (DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False), DataCollatorWithFlattening()):
        model = tiny.gpt2()
        PrivateTrainer(model=model, args=training_args(tmp_path / str(len(weights)), per_device_train_batch_size=3,
                                                       gradient_accumulation_steps=2, max_steps=3),
                       train_dataset=dataset, data_collator=collator, processing_class=tiny.tokenizer(),
                       dp_config=DPConfig(noise_multiplier=0.5, max_grad_norm=0.1, noise_seed=SEED)).train()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert len(sliced) > 6  # more pieces than the 3 × 2 chunks: some chunk was cut
    torch.testing.assert_close(weights[1], weights[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packing", [True, False])
def test_packed_chunks_are_cut_from_length_sorted_poisson_batches(tmp_path, packing):
    """A packed chunk's norms are computed on its examples padded to its longest: the sampler sorts each Poisson
    batch by length before cutting chunks when the collator packs (as group_by_length does for padded ones)."""
    from datasets import Dataset

    collator = DataCollatorWithFlattening() if packing else DataCollatorForLanguageModeling(tiny.tokenizer(),
                                                                                            mlm=False)
    trainer = PrivateTrainer(
        model=tiny.gpt2(), args=training_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=4),
        train_dataset=Dataset.from_dict({"input_ids": [f["input_ids"] for f in _features(64)]}),
        data_collator=collator, processing_class=tiny.tokenizer(), dp_config=DPConfig(noise_multiplier=1.0))
    sampler = trainer.get_train_dataloader().batch_sampler
    assert (sampler.lengths is not None) == packing
    if packing:
        lengths = [len(f["input_ids"]) for f in _features(64)]
        chunks = [[lengths[i] for i in chunk] for chunk in list(sampler)[:4]]
        assert all(max(a) <= min(b) for a, b in zip(chunks, chunks[1:]) if a and b)


def test_a_packed_chunk_runs_as_rows_of_whole_units_within_the_token_budget():
    from hf_private.packing import packed_pieces

    lengths = torch.tensor([5, 7, 300, 4, 4, 4, 9])
    pieces = list(packed_pieces([1] * 7, lengths, units_per_piece=4, row_tokens=16))
    assert [(a, b) for a, b, _ in pieces] == [(0, 2), (2, 3), (3, 6), (6, 7)]  # 300 alone; 4+4+4 then 9 > 16
    users = list(packed_pieces([2, 1, 3, 1], lengths, units_per_piece=4, row_tokens=10))
    assert [(a, b, units) for a, b, units in users] == [(0, 2, [2]), (2, 3, [1]), (3, 6, [3]), (6, 7, [1])]
    # each user's examples in one row, even past the budget (12 tokens > 10)
    assert [(a, b) for a, b, _ in packed_pieces([1] * 7, lengths, 3, None)] == [(0, 3), (3, 6), (6, 7)]


@pytest.mark.parametrize("row_tokens", [24, None])
def test_the_trainer_records_packed_rows_of_at_most_packed_row_tokens(tmp_path, monkeypatch, row_tokens):
    from datasets import Dataset

    rows = []
    recording = PerExampleGradientEngine.recording

    def spy(self, batch_size, rows_per_example=1, probe=False, packed=None):
        if packed is not None and not probe:
            rows.append(int(torch.as_tensor(packed).sum()))
        return recording(self, batch_size, rows_per_example, probe, packed)

    monkeypatch.setattr(PerExampleGradientEngine, "recording", spy)
    features = _features(32)
    trainer = PrivateTrainer(
        model=tiny.gpt2(), args=training_args(tmp_path, per_device_train_batch_size=16, max_steps=2),
        train_dataset=Dataset.from_dict({"input_ids": [f["input_ids"] for f in features]}),
        data_collator=DataCollatorWithFlattening(), processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0), packed_row_tokens=row_tokens)
    trainer.train()
    longest = max(len(f["input_ids"]) for f in features)
    assert rows and (max(rows) <= max(24, longest) if row_tokens else max(rows) > 24)


def test_packed_row_tokens_must_be_a_positive_int_or_none(tmp_path):
    with pytest.raises(ValueError, match="packed_row_tokens must be an integer >= 1 or None, got 0"):
        PrivateTrainer(model=tiny.gpt2(), args=training_args(tmp_path), train_dataset=tiny.lm_dataset(8),
                       dp_config=DPConfig(noise_multiplier=1.0), packed_row_tokens=0)


def test_a_custom_per_example_loss_is_refused_for_a_packed_causal_lm(tmp_path):
    """It is handed the packed row's logits and labels and cannot tell the examples apart."""
    from datasets import Dataset

    trainer = PrivateTrainer(
        model=tiny.gpt2(), args=training_args(tmp_path, per_device_train_batch_size=8, max_steps=1),
        train_dataset=Dataset.from_dict({"input_ids": [f["input_ids"] for f in _features(16)]}),
        data_collator=DataCollatorWithFlattening(), processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0), per_example_loss=default_per_example_loss)
    with pytest.raises(ValueError, match="cannot say which packed example each token belongs to"):
        trainer.train()
    assert trainer.ledger.total_steps == 0


def test_readme_packing_script_runs_as_written(tmp_path, monkeypatch, capsys):
    from huggingface_hub import ModelCard

    from tests.helpers import run_readme_block

    namespace = run_readme_block("### Padding-free packing: no padding, each example still clipped alone", tmp_path,
                                 monkeypatch)
    report = namespace["trainer"].privacy_report()
    assert "every text clipped alone" in capsys.readouterr().out
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] <= 8.0
    privacy = ModelCard.load(tmp_path / "packed-lm" / "final" / "README.md").data.to_dict()["privacy"]
    assert privacy["epsilon"] == pytest.approx(report["epsilon"])
