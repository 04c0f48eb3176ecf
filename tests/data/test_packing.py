"""Padding-free packing (`hf_private.data.packing`): a chunk's examples end to end in rows, each still clipped alone.

The same examples packed (DataCollatorWithFlattening; in one row, or laid out as rows of whole examples padded to the
longest, as the trainer runs them) and padded one per row (DataCollatorForLanguageModeling) must give the engine equal
per-example norms and clipped sums, and through the public API equal released updates under a
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
from hf_private.data.packing import (
    PACKED_LENGTHS_KEY,
    PACKED_ROWS_KEY,
    PackedLayout,
    lay_out_rows,
    packed_layout,
    packed_lengths,
    slice_packed,
)
from hf_private.data.sampling import EmptySafeCollator
from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError
from hf_private.integrations.losses import default_per_example_loss, packed_causal_lm_losses
from hf_private.models.support import is_causal_lm
from tests.support import tiny
from tests.support.helpers import training_args

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


def engine_results(
    model, batch: dict, clip: float, rows: list[int] | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(per-example norms, clipped sums) of one chunk, read from a fresh engine; a packed chunk laid out in `rows`
    (examples per row) as the trainer lays it out, a packed causal LM's loss as the trainer computes it, any other
    model's from one output per example."""
    if rows is not None:
        batch = lay_out_rows(batch, rows, mask_padding=not is_causal_lm(model))
    layout = packed_layout(batch)
    batch = {k: v for k, v in batch.items() if k not in (PACKED_LENGTHS_KEY, PACKED_ROWS_KEY)}
    labels = batch.pop("labels")
    examples = layout.examples if layout is not None else labels.shape[0]

    def summed_loss():
        if layout is None or not is_causal_lm(model):
            return default_per_example_loss(model, model(**batch), labels).sum()
        logits = model(**batch, use_cache=False).logits  # as the trainer runs a packed chunk
        return packed_causal_lm_losses(logits, labels, layout).sum()

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    try:
        with engine.recording(examples, probe=True, packed=layout):
            summed_loss().backward()
        norms = engine.finish_backward()
        with engine.recording(examples, packed=layout):
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


def test_a_packed_chunk_laid_out_in_rows_pads_each_row_with_a_segment_of_its_own():
    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [10, 11, 12, 13]}, {"input_ids": [14]}]
    batch = packed_batch(features)
    rows = lay_out_rows(batch, [2, 1, 1], mask_padding=True)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 13, 0], [14, 0, 0, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0], [0, 0, 0, 0, 0]]
    assert rows["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 11, 12, 13, -100], [-100] + [-100] * 4]
    assert rows["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    layout = packed_layout(rows)
    assert (layout.rows, layout.width, layout.owner().tolist()) == (
        3,
        5,
        [[0, 0, 0, 1, 1], [2, 2, 2, 2, -1], [3, -1, -1, -1, -1]],
    )
    assert "attention_mask" not in lay_out_rows(batch, [2, 1, 1], mask_padding=False)
    for start, stop in ((0, 2), (1, 3), (3, 4)):  # slicing the rows gives what slicing the one row gives
        laid, row = slice_packed(rows, start, stop), slice_packed(batch, start, stop)
        assert set(laid) == set(row) and all(torch.equal(laid[k], row[k]) for k in row)
    with pytest.raises(ValueError, match=r"rows of \[2, 1\] examples do not hold the chunk's 4"):
        PackedLayout(batch[PACKED_LENGTHS_KEY], [2, 1])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: {**b, "attention_mask": torch.ones_like(b["input_ids"])}, "carries an attention_mask"),
        (
            lambda b: {
                k: torch.cat([v, v.new_zeros(1, 3)], 1) if torch.is_tensor(v) and v.dim() == 2 else v
                for k, v in b.items()
            },
            "runs of position_ids restarting at 0 for 4 examples",
        ),  # padded row
        (
            lambda b: {
                k: v.reshape(2, -1) if k != "labels" and torch.is_tensor(v) else v.reshape(2, -1) for k, v in b.items()
            },
            "The packed batch has 2 rows",
        ),
    ],
)
def test_padded_split_or_masked_packed_rows_are_refused(change, message):
    features = [
        {"input_ids": [5, 6, 7]},
        {"input_ids": [8, 9, 10]},
        {"input_ids": [11, 12, 13]},
        {"input_ids": [14, 15, 16]},
    ]
    batch = dict(DataCollatorWithFlattening()(features))
    assert packed_lengths(batch, 4).tolist() == [3, 3, 3, 3]
    with pytest.raises(ValueError, match=message):
        packed_lengths(change(batch), 4)


# ---------------------------------------------------------------------- packed = padded, example by example
ROWS = {"one-row": None, "rows": [2, 3, 1]}  # a packed chunk in one row, or in rows of unequal length, padded


@pytest.mark.parametrize("rows", sorted(ROWS))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_and_padded_give_equal_norms_and_clipped_sums(name, lora, rows):
    features = _features(6)
    model = build(name, lora)
    norms, _ = engine_results(model, padded_batch(features), clip=1.0)
    clip = float(norms.median())  # half the examples clipped
    padded_norms, padded_sums = engine_results(model, padded_batch(features), clip)
    packed_norms, packed_sums = engine_results(model, packed_batch(features), clip, ROWS[rows])
    torch.testing.assert_close(packed_norms, padded_norms, rtol=1e-5, atol=1e-7)
    for packed, padded in zip(packed_sums, padded_sums):
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


def test_the_equality_test_fails_when_the_packed_boundaries_are_wrong(monkeypatch):
    """Boundaries shifted by one token (each example takes its neighbour's first token): the norms differ."""
    features = _features(6)
    model = build("gpt2", lora=False)
    padded_norms, _ = engine_results(model, padded_batch(features), clip=0.5)
    real = hf_private.engine.packed_tokens.PackedTokens.__init__

    def shifted(self, layout):
        lengths = layout.lengths.clone()
        lengths[0] += 1
        lengths[-1] -= 1
        real(self, PackedLayout(lengths, layout.row_examples))

    monkeypatch.setattr(hf_private.engine.packed_tokens.PackedTokens, "__init__", shifted)
    packed_norms, _ = engine_results(model, packed_batch(features), clip=0.5)
    assert not torch.allclose(packed_norms, padded_norms, rtol=1e-3)


@pytest.mark.parametrize("rows, seen", [(None, 1), ([2, 3, 1], 3)])
def test_packed_rows_are_refused_when_the_engine_does_not_split_them(monkeypatch, rows, seen):
    monkeypatch.setattr(hf_private.engine.packed_tokens.PackedTokens, "holds", lambda self, tensor: False)
    with pytest.raises(ValueError, match=f"computed gradients for {seen} rows.*per-row clipping"):
        engine_results(build("gpt2", lora=False), packed_batch(_features(6)), 0.5, rows)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_a_rows_padding_longer_than_the_models_positions_trains_as_padded(name):
    """Rows wider than the model's position table (tiny: 20): a short row's padding sits at position 0, so it never
    indexes past the table, and the norms and sums stay the padded ones."""
    if name == "bert":
        features, model = _sentences(8), ENCODERS["bert"]().train()
        from transformers import DataCollatorWithPadding

        padded = dict(DataCollatorWithPadding(tiny.tokenizer())(features))
        packed = EmptySafeCollator(PackedClassificationCollator(), features[0])(features)
    else:
        features, model = _features(8), build("gpt2", lora=False)
        padded, packed = padded_batch(features), packed_batch(features)
    rows = [7, 1]  # 7 examples (> 20 tokens) in one row, one short example padded to its width
    assert int(packed[PACKED_LENGTHS_KEY][:7].sum()) - int(packed[PACKED_LENGTHS_KEY][7]) > tiny.SEQ_LEN + 4
    padded_norms, padded_sums = engine_results(model, padded, 0.5)
    packed_norms, packed_sums = engine_results(model, packed, 0.5, rows)
    torch.testing.assert_close(packed_norms, padded_norms, rtol=1e-5, atol=1e-7)
    for a, b in zip(packed_sums, padded_sums):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_equality_test_fails_when_rows_are_read_as_one(monkeypatch):
    """The rows' tokens taken in memory order, as if the chunk were one row (the padding read as tokens of the
    examples after it): the norms differ."""
    features = _features(6)
    model = build("llama", lora=False)
    padded_norms, _ = engine_results(model, padded_batch(features), clip=0.5)
    monkeypatch.setattr(
        PackedLayout, "token_index", lambda self, device="cpu": torch.arange(self.tokens, device=device)
    )
    packed_norms, _ = engine_results(model, packed_batch(features), 0.5, ROWS["rows"])
    assert not torch.allclose(packed_norms, padded_norms, rtol=1e-3)


@pytest.mark.parametrize("rows", sorted(ROWS))
def test_attention_across_packed_examples_changes_the_norms(monkeypatch, rows):
    """Without the block-diagonal mask transformers builds from the restarting positions, examples see each other:
    the norms then differ from the padded ones (what the trainer's independence probe detects)."""
    features = _features(6)
    model = build("llama", lora=False)
    padded_norms, _ = engine_results(model, padded_batch(features), clip=0.5)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    packed_norms, _ = engine_results(model, packed_batch(features), 0.5, ROWS[rows])
    assert not torch.allclose(packed_norms[1:], padded_norms[1:], rtol=1e-3)


# ---------------------------------------------------------------------- through the public API
def released_update(
    tmp_path, name: str, lora: bool, features: list[dict], collator, clip: float, **trainer_kwargs
) -> torch.Tensor:
    """Σ of the clipped per-example gradients plus the replayed noise: one SGD step at q = 1, (W₀ − W₁)·B/lr."""
    from datasets import Dataset

    model = build(name, lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    before = torch.cat([p.detach().flatten() for p in trained]).double()
    dataset = Dataset.from_dict({"input_ids": [f["input_ids"] for f in features]})
    trainer = PrivateTrainer(
        model=model,
        args=training_args(
            tmp_path,
            per_device_train_batch_size=len(features),
            max_steps=1,
            learning_rate=1.0,
            optim="sgd",
            lr_scheduler_type="constant",
            weight_decay=0.0,
        ),
        train_dataset=dataset,
        data_collator=collator,
        processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=0.2, max_grad_norm=clip, noise_seed=SEED),
        **trainer_kwargs,
    )
    assert trainer.sample_rate == 1.0
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trained]).double()
    return (before - after) * len(features)


# PrivateTrainer's packing budgets for 8 examples of 5-11 tokens: one row; rows of <= 24 tokens in one forward; and
# those rows in forwards of <= 48 padded tokens
ROW_TOKENS = {
    "one-row": {"packed_row_tokens": None},
    "rows": {"packed_row_tokens": 24},
    "forwards": {"packed_row_tokens": 24, "packed_forward_tokens": 48},
}


@pytest.mark.parametrize("rows", sorted(ROW_TOKENS))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_and_padded_training_release_equal_updates(tmp_path, name, lora, rows):
    features = _features(8)
    padded = released_update(
        tmp_path / "padded",
        name,
        lora,
        features,
        DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
        clip=0.5,
    )
    packed = released_update(
        tmp_path / "packed", name, lora, features, DataCollatorWithFlattening(), clip=0.5, **ROW_TOKENS[rows]
    )
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


CLIP = 0.01  # below every example's gradient norm here


@pytest.mark.parametrize("rows", sorted(ROW_TOKENS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_adding_one_example_to_a_packed_batch_moves_the_release_by_at_most_C(tmp_path, name, rows):
    mates = _features(7)
    added = _features(1, seed=5)
    with_it = released_update(
        tmp_path / "with", name, False, mates + added, DataCollatorWithFlattening(), CLIP, **ROW_TOKENS[rows]
    )
    without = released_update(
        tmp_path / "without", name, False, mates, DataCollatorWithFlattening(), CLIP, **ROW_TOKENS[rows]
    )
    moved = float((with_it - without).norm())
    assert 0.5 * CLIP < moved <= CLIP * (1 + 1e-4)


@pytest.mark.parametrize("collator", [DataCollatorWithFlattening, PackedClassificationCollator])
def test_a_stock_encoder_head_with_packed_batches_is_refused(tmp_path, collator):
    from datasets import Dataset

    data = tiny.sentiment_dataset(16)
    columns = (
        {"input_ids": data["input_ids"]}
        if collator is DataCollatorWithFlattening
        else {"input_ids": data["input_ids"], "label": data["label"]}
    )
    trainer = PrivateTrainer(
        model=tiny.bert(),
        args=training_args(tmp_path, per_device_train_batch_size=8, max_steps=1),
        train_dataset=Dataset.from_dict(columns),
        data_collator=collator(),
        processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0),
    )
    with pytest.raises(
        ValueError,
        match="Packed batches are supported for causal LMs and hf_private's mean-pooled "
        "classifiers .*not BertForSequenceClassification",
    ):
        trainer.train()
    assert trainer.ledger.total_steps == 0


# ---------------------------------------------------------------------- hf_private's mean-pooled classifiers
ENCODERS = {"bert": tiny.mean_pooled_bert, "roberta": tiny.mean_pooled_roberta}


def _sentences(n: int, seed: int = 0) -> list[dict]:
    data = tiny.sentiment_dataset(n, seed=seed)
    return [{"input_ids": data[i]["input_ids"], "label": data[i]["label"]} for i in range(n)]


@pytest.mark.parametrize("rows", sorted(ROWS))
@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_a_mean_pooled_classifier_gives_packed_sentences_their_padded_norms_and_sums(name, rows):
    from transformers import DataCollatorWithPadding

    sentences = _sentences(6)
    model = ENCODERS[name]().train()
    padded = dict(DataCollatorWithPadding(tiny.tokenizer())(sentences))
    packed = EmptySafeCollator(PackedClassificationCollator(), sentences[0])(sentences)
    assert packed["input_ids"].shape[0] == 1 and packed["labels"].shape == (6,)
    norms, _ = engine_results(model, padded, clip=1.0)
    clip = float(norms.median())
    padded_norms, padded_sums = engine_results(model, padded, clip)
    packed_norms, packed_sums = engine_results(model, packed, clip, ROWS[rows])
    torch.testing.assert_close(packed_norms, padded_norms, rtol=1e-5, atol=1e-7)
    for a, b in zip(packed_sums, padded_sums):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", sorted(ROWS))
def test_the_encoder_equality_fails_without_the_block_diagonal_mask(monkeypatch, rows):
    """Packed sentences attending to each other (the mask left out): their norms change. In rows they attend to the
    rows' padding too, whose gradient then belongs to no sentence: the engine finds the per-sentence gradients short
    of the parameter's gradient and refuses."""
    from transformers import DataCollatorWithPadding

    sentences = _sentences(6)
    model = tiny.mean_pooled_bert().train()
    padded_norms, _ = engine_results(model, dict(DataCollatorWithPadding(tiny.tokenizer())(sentences)), 1.0)
    real = model.base_model.forward
    monkeypatch.setattr(model.base_model, "forward", lambda *a, attention_mask=None, **kw: real(*a, **kw))
    packed = EmptySafeCollator(PackedClassificationCollator(), sentences[0])(sentences)
    if ROWS[rows] is not None:
        with pytest.raises(UnsupportedLayerError, match="do not add up to its gradient"):
            engine_results(model, packed, 1.0, ROWS[rows])
        return
    packed_norms, _ = engine_results(model, packed, 1.0)
    assert not torch.allclose(packed_norms, padded_norms, rtol=1e-3)


def test_a_packed_row_that_begins_inside_a_sentence_is_refused():
    from hf_private.models.heads import packed_owner

    positions = torch.tensor([[0, 1, 0, 1], [2, 0, 1, 0]])
    with pytest.raises(ValueError, match="starting at 0 at each row's first attended token"):
        packed_owner(positions)
    assert packed_owner(positions, torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]])).tolist() == [
        [0, 0, 1, 1],
        [-1, 2, 2, -1],
    ]


def test_the_encoder_equality_fails_when_a_rows_padding_is_pooled(monkeypatch):
    """Rows laid out without their attention_mask: each row's padding is read as a sentence of its own and the head
    gives more outputs than the chunk has sentences, which the trainer refuses (check_packed_head)."""
    sentences = _sentences(6)
    model = tiny.mean_pooled_bert().train()
    packed = EmptySafeCollator(PackedClassificationCollator(), sentences[0])(sentences)
    rows = lay_out_rows(packed, ROWS["rows"], mask_padding=False)
    logits = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"]).logits
    assert logits.shape[0] > 6


def classifier_update(tmp_path, sentences: list[dict], collator, clip: float, **trainer_kwargs) -> torch.Tensor:
    from datasets import Dataset

    model = tiny.mean_pooled_bert()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    trainer = PrivateTrainer(
        model=model,
        args=training_args(
            tmp_path,
            per_device_train_batch_size=len(sentences),
            max_steps=1,
            learning_rate=1.0,
            optim="sgd",
            lr_scheduler_type="constant",
            weight_decay=0.0,
        ),
        train_dataset=Dataset.from_list(sentences),
        data_collator=collator,
        processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=0.2, max_grad_norm=clip, noise_seed=SEED),
        **trainer_kwargs,
    )
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double()
    return (before - after) * len(sentences)


@pytest.mark.parametrize("rows", sorted(ROW_TOKENS))
def test_packed_sentences_train_a_mean_pooled_classifier_as_padded_ones_do(tmp_path, rows):
    from transformers import DataCollatorWithPadding

    sentences = _sentences(8)
    row_tokens = ROW_TOKENS[rows]
    padded = classifier_update(tmp_path / "padded", sentences, DataCollatorWithPadding(tiny.tokenizer()), 0.5)
    packed = classifier_update(tmp_path / "packed", sentences, PackedClassificationCollator(), 0.5, **row_tokens)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)
    moved = float(
        (
            classifier_update(
                tmp_path / "more", sentences + _sentences(1, seed=4), PackedClassificationCollator(), CLIP, **row_tokens
            )
            - classifier_update(tmp_path / "less", sentences, PackedClassificationCollator(), CLIP, **row_tokens)
        ).norm()
    )
    assert 0.5 * CLIP < moved <= CLIP * (1 + 1e-4)


def test_the_trainers_probe_refuses_packed_examples_that_attend_to_each_other(tmp_path, monkeypatch):
    """The mask transformers builds from restarting positions, removed: the first packed chunk's probe sees an
    example's norm change with its chunk-mates and refuses the run before any release."""
    from datasets import Dataset

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    trainer = PrivateTrainer(
        model=tiny.llama(),
        args=training_args(tmp_path, per_device_train_batch_size=8, max_steps=1),
        train_dataset=Dataset.from_dict({"input_ids": [f["input_ids"] for f in _features(16)]}),
        data_collator=DataCollatorWithFlattening(),
        processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0),
    )
    with pytest.raises(ValueError, match="depends on the other examples"):
        trainer.train()
    assert trainer.ledger.total_steps == 0


# ---------------------------------------------------------------------- TRL's padding-free SFT, users
def sft_update(
    tmp_path, padding_free: bool, rows: list[dict], packed_row_tokens: int | None = 128, **config
) -> torch.Tensor:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_private import privatize
    from tests.support.helpers import TRL_TEST_ARGS

    model = tiny.llama()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    args = SFTConfig(
        str(tmp_path),
        **{**TRL_TEST_ARGS, "max_length": None, **config},
        padding_free=padding_free,
        per_device_train_batch_size=len(rows),
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
    )
    trainer = privatize(SFTTrainer)(
        model,
        args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny.chat_tokenizer(),
        dp_config=DPConfig(noise_multiplier=0.2, max_grad_norm=0.05, noise_seed=SEED),
        packed_row_tokens=packed_row_tokens,
    )
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double()
    return (before - after) * len(rows)


@pytest.mark.parametrize("row_tokens", [128, 16], ids=["one-row", "rows"])  # 8 sequences of 56 tokens in all
def test_trl_padding_free_sft_releases_what_padded_sft_releases(tmp_path, row_tokens):
    rows = [{"prompt": p["prompt"], "completion": p["completion"]} for p in tiny.prompt_completions(8)]
    padded = sft_update(tmp_path / "padded", False, rows)
    packed = sft_update(tmp_path / "packed", True, rows, packed_row_tokens=row_tokens)
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
    from tests.support.helpers import TRL_TEST_ARGS

    args = SFTConfig(
        str(tmp_path), **{**TRL_TEST_ARGS, "max_length": 64}, packing=True, per_device_train_batch_size=4, max_steps=2
    )
    trainer = privatize(SFTTrainer)(
        tiny.llama(),
        args,
        train_dataset=Dataset.from_list(tiny.prompt_completions(24)),
        processing_class=tiny.chat_tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0),
    )
    assert (
        len(trainer.train_dataset) == trainer.dataset_size == 24
        and "seq_lengths" not in trainer.train_dataset.column_names
    )
    trainer.train()
    assert trainer.ledger.total_steps == 2 and trainer.sample_rate == pytest.approx(4 / 24)


def test_packed_chunks_group_a_users_examples(tmp_path):
    """ULS with a packing collator: a user's drawn examples are packed in the same row and clipped as one unit."""
    from datasets import Dataset

    features = _features(24)
    dataset = Dataset.from_dict(
        {"input_ids": [f["input_ids"] for f in features], "user_id": [i % 6 for i in range(24)]}
    )
    dp = DPConfig(noise_multiplier=1.0, privacy_unit="user", user_column="user_id", examples_per_user=3)
    trainer = PrivateTrainer(
        model=tiny.gpt2(),
        args=training_args(tmp_path, per_device_train_batch_size=3, max_steps=2),
        train_dataset=dataset,
        data_collator=DataCollatorWithFlattening(),
        processing_class=tiny.tokenizer(),
        dp_config=dp,
    )
    trainer.train()
    assert trainer.privacy_report()["unit"] == "user" and trainer.ledger.total_steps == 2


def test_a_poisson_chunk_larger_than_the_device_batch_is_sliced_by_examples_as_padded_chunks_are(tmp_path, monkeypatch):
    """q < 1: some Poisson chunks hold more examples than per_device_train_batch_size and are cut into pieces, a
    packed row by its examples' tokens; three steps end at the padded run's weights."""
    from datasets import Dataset

    import hf_private.data.chunks

    sliced = []
    real = hf_private.data.chunks.slice_packed
    monkeypatch.setattr(
        hf_private.data.chunks,
        "slice_packed",
        lambda batch, start, stop: sliced.append(stop - start) or real(batch, start, stop),
    )
    dataset = Dataset.from_dict({"input_ids": [f["input_ids"] for f in _features(16)]})
    weights = []
    for collator in (DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False), DataCollatorWithFlattening()):
        model = tiny.gpt2()
        PrivateTrainer(
            model=model,
            args=training_args(
                tmp_path / str(len(weights)), per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3
            ),
            train_dataset=dataset,
            data_collator=collator,
            processing_class=tiny.tokenizer(),
            dp_config=DPConfig(noise_multiplier=0.5, max_grad_norm=0.1, noise_seed=SEED),
        ).train()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert len(sliced) > 6  # more pieces than the 3 × 2 chunks: some chunk was cut
    torch.testing.assert_close(weights[1], weights[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packing", [True, False])
def test_packed_chunks_are_cut_from_length_sorted_poisson_batches(tmp_path, packing):
    """A packed chunk's norms are computed on its examples padded to its longest: the sampler sorts each Poisson
    batch by length before cutting chunks when the collator packs (as group_by_length does for padded ones)."""
    from datasets import Dataset

    collator = DataCollatorWithFlattening() if packing else DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False)
    trainer = PrivateTrainer(
        model=tiny.gpt2(),
        args=training_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=4),
        train_dataset=Dataset.from_dict({"input_ids": [f["input_ids"] for f in _features(64)]}),
        data_collator=collator,
        processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0),
    )
    sampler = trainer.get_train_dataloader().batch_sampler
    assert (sampler.lengths is not None) == packing
    if packing:
        lengths = [len(f["input_ids"]) for f in _features(64)]
        chunks = [[lengths[i] for i in chunk] for chunk in list(sampler)[:4]]
        assert all(max(a) <= min(b) for a, b in zip(chunks, chunks[1:]) if a and b)


def test_a_packed_chunk_runs_as_rows_of_whole_units_within_the_token_budget():
    from hf_private.data.packing import packed_pieces

    lengths = torch.tensor([5, 7, 300, 4, 4, 4, 9])
    # a forward of at most 4 units, in rows of at most 16 tokens (300 alone; 4+4 then 9 > 16)
    assert list(packed_pieces([1] * 7, lengths, units_per_piece=4, row_tokens=16)) == [
        (0, 4, [1, 1, 1, 1], [2, 1, 1]),
        (4, 7, [1, 1, 1], [2, 1]),
    ]
    # at most 40 padded tokens a forward: 300 alone; rows of 12 and 8 padded to 12; 8 + 9 fits no row of 12, 3 × 12 < 40
    assert list(packed_pieces([1] * 7, lengths, 7, 16, forward_tokens=40)) == [
        (0, 2, [1, 1], [2]),
        (2, 3, [1], [1]),
        (3, 7, [1, 1, 1, 1], [3, 1]),
    ]
    # varlen kernels (a batch of one row): a forward per row
    pieces = list(packed_pieces([1] * 7, lengths, units_per_piece=4, row_tokens=16, forward_tokens=0))
    assert [(a, b, rows) for a, b, _, rows in pieces] == [(0, 2, [2]), (2, 3, [1]), (3, 6, [3]), (6, 7, [1])]
    users = list(packed_pieces([2, 1, 3, 1], lengths, units_per_piece=4, row_tokens=10))
    # each user's examples in one row, even past the budget (12 tokens > 10)
    assert users == [(0, 7, [2, 1, 3, 1], [2, 1, 3, 1])]
    assert [(a, b, rows) for a, b, _, rows in packed_pieces([1] * 7, lengths, 3, None)] == [
        (0, 3, [3]),
        (3, 6, [3]),
        (6, 7, [1]),
    ]


def _recorded_layouts(monkeypatch) -> list[PackedLayout]:
    """The packed layouts the engine is told of in training (not in the independence probe)."""
    recorded = []
    recording = PerExampleGradientEngine.recording

    def spy(self, batch_size, rows_per_example=1, probe=False, packed=None):
        if packed is not None and not probe:
            recorded.append(packed)
        return recording(self, batch_size, rows_per_example, probe, packed)

    monkeypatch.setattr(PerExampleGradientEngine, "recording", spy)
    return recorded


def _train_packed_gpt2(tmp_path, **trainer_kwargs) -> list[dict]:
    from datasets import Dataset

    features = _features(32)
    trainer = PrivateTrainer(
        model=trainer_kwargs.pop("model", None) or tiny.gpt2(),
        args=training_args(tmp_path, per_device_train_batch_size=16, max_steps=2),
        train_dataset=Dataset.from_dict({"input_ids": [f["input_ids"] for f in features]}),
        data_collator=DataCollatorWithFlattening(),
        processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0),
        **trainer_kwargs,
    )
    trainer.train()
    return features


@pytest.mark.parametrize(
    "row_tokens, forward_tokens, attention",
    [(24, 48, "sdpa"), (24, 48, "eager"), (24, None, "sdpa"), (None, None, "sdpa"), ("auto", 256, "sdpa")],
)
def test_the_trainer_runs_a_packed_chunk_as_rows_of_at_most_packed_row_tokens(
    tmp_path, monkeypatch, row_tokens, forward_tokens, attention
):
    """Under masked attention a chunk's rows share a forward: each within the row budget, each forward within the
    padded-token budget (a wider row alone), at most a chunk of examples."""
    recorded = _recorded_layouts(monkeypatch)
    model = tiny.gpt2()
    model.config._attn_implementation = attention
    features = _train_packed_gpt2(
        tmp_path, model=model, packed_row_tokens=row_tokens, packed_forward_tokens=forward_tokens
    )
    longest = max(len(f["input_ids"]) for f in features)
    rows = {"auto": 32}.get(row_tokens, row_tokens)
    widest = max(max(layout.row_tokens) for layout in recorded)
    assert recorded and (widest <= max(rows, longest) if rows else widest > 24)
    assert all(layout.examples <= 16 for layout in recorded)
    if forward_tokens is not None:
        assert all(layout.rows * layout.width <= max(forward_tokens, layout.width) for layout in recorded)
    assert any(layout.rows > 1 for layout in recorded) == (rows is not None)


@pytest.mark.parametrize("row_tokens", [24, "auto"])
def test_varlen_attention_runs_each_packed_row_alone(tmp_path, monkeypatch, row_tokens):
    """flash-attention kernels read packed boundaries only in a batch of one row: there each row is a forward, and
    "auto" makes a chunk one row (the kernel attends within each example whatever the row's length)."""
    import hf_private.data.packing

    monkeypatch.setattr(hf_private.data.packing, "rows_share_a_forward", lambda model: False)
    recorded = _recorded_layouts(monkeypatch)
    _train_packed_gpt2(tmp_path, packed_row_tokens=row_tokens)
    assert recorded and all(layout.rows == 1 for layout in recorded)
    assert (
        max(layout.tokens for layout in recorded) <= 24
        if row_tokens == 24
        else max(layout.examples for layout in recorded) > 2
    )


def test_only_eager_and_sdpa_attention_share_a_forward_between_packed_rows():
    from hf_private.data.packing import rows_share_a_forward

    model = tiny.llama()
    for attention, shared in (("sdpa", True), ("eager", True), ("flash_attention_2", False), ("flex_attention", False)):
        model.config._attn_implementation = attention
        assert rows_share_a_forward(model) is shared
        assert rows_share_a_forward(get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2))) is shared


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"packed_row_tokens": 0}, "packed_row_tokens must be an integer >= 1 or None or 'auto', got 0"),
        ({"packed_row_tokens": "wide"}, "packed_row_tokens must be .* got 'wide'"),
        ({"packed_forward_tokens": True}, "packed_forward_tokens must be an integer >= 1 or None, got True"),
    ],
)
def test_packing_budgets_must_be_positive_ints(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrivateTrainer(
            model=tiny.gpt2(),
            args=training_args(tmp_path),
            train_dataset=tiny.lm_dataset(8),
            dp_config=DPConfig(noise_multiplier=1.0),
            **kwargs,
        )


def test_a_custom_per_example_loss_is_refused_for_a_packed_causal_lm(tmp_path):
    """It is handed the packed row's logits and labels and cannot tell the examples apart."""
    from datasets import Dataset

    trainer = PrivateTrainer(
        model=tiny.gpt2(),
        args=training_args(tmp_path, per_device_train_batch_size=8, max_steps=1),
        train_dataset=Dataset.from_dict({"input_ids": [f["input_ids"] for f in _features(16)]}),
        data_collator=DataCollatorWithFlattening(),
        processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0),
        per_example_loss=default_per_example_loss,
    )
    with pytest.raises(ValueError, match="cannot say which packed example each token belongs to"):
        trainer.train()
    assert trainer.ledger.total_steps == 0


def test_docs_packing_script_runs_as_written(tmp_path, monkeypatch, capsys):
    from huggingface_hub import ModelCard

    from tests.support.helpers import run_doc_block

    namespace = run_doc_block("guides/packing.md", tmp_path, monkeypatch)
    report = namespace["trainer"].privacy_report()
    assert "every text clipped alone" in capsys.readouterr().out
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] <= 8.0
    privacy = ModelCard.load(tmp_path / "packed-lm" / "final" / "README.md").data.to_dict()["privacy"]
    assert privacy["epsilon"] == pytest.approx(report["epsilon"])
