"""Contract tests of Poisson sampling at rate q, every step, empty batches included."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import datasets
import pytest
import torch
from scipy import stats
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast, default_data_collator

from hf_private.data.sampling import (
    EmptySafeCollator,
    PoissonBatchSampler,
    batch_size_of,
    expected_steps_per_epoch,
)
from hf_private.privacy import SecretRandom

# Two-sided tail probability for every statistical check: false alarms ~1e-5, fixed test seeds.
ALPHA = 1e-5


def _gen(seed: int) -> SecretRandom:
    """A reproducible secret stream (an explicit key: the tests need the same draws on every run)."""
    return SecretRandom(key=seed.to_bytes(32, "little"))


def _logical_batches(sampler: PoissonBatchSampler) -> list[list[int]]:
    batches = list(sampler)
    k = sampler.num_chunks
    return [sum(batches[i : i + k], []) for i in range(0, len(batches), k)]


def _looks_binomial(sizes: list[int], n: int, q: float) -> bool:
    """z-test on the mean and chi-square test on the variance against Bin(n, q)."""
    t = len(sizes)
    sizes_t = torch.tensor(sizes, dtype=torch.float64)
    mean, var = sizes_t.mean().item(), sizes_t.var().item()
    z = (mean - n * q) / math.sqrt(n * q * (1 - q) / t)
    chi2 = (t - 1) * var / (n * q * (1 - q))
    lo, hi = stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], t - 1)
    return abs(z) < stats.norm.isf(ALPHA / 2) and lo < chi2 < hi


def test_batch_sizes_follow_binomial():
    n, q, steps = 2000, 0.05, 400
    sampler = PoissonBatchSampler(n, q, steps, random=_gen(1))
    sizes = [len(b) for b in _logical_batches(sampler)]
    assert len(sizes) == steps
    assert _looks_binomial(sizes, n, q)


def test_binomial_check_rejects_fixed_size_batches():
    """Power: the check above fails for fixed-size batches of the right mean."""
    n, q, steps = 2000, 0.05, 400
    assert not _looks_binomial([round(n * q)] * steps, n, q)


def test_every_example_included_at_rate_q():
    n, q, steps = 200, 0.1, 400
    counts = torch.zeros(n, dtype=torch.float64)
    for batch in PoissonBatchSampler(n, q, steps, random=_gen(2)):
        counts[batch] += 1
    assert counts.min() >= 1, "some example was never sampled"
    total, expected = counts.sum().item(), n * steps * q
    assert abs(total - expected) / math.sqrt(expected * (1 - q)) < stats.norm.isf(ALPHA / 2)
    # Per-example counts are Bin(steps, q): their normalised squared deviations sum to ~chi2(n).
    chi2 = ((counts - steps * q) ** 2 / (steps * q * (1 - q))).sum().item()
    assert chi2 < stats.chi2.isf(ALPHA, n)


def test_no_duplicates_within_a_batch_and_indices_in_range():
    for batch in PoissonBatchSampler(50, 0.5, 100, random=_gen(3)):
        assert len(set(batch)) == len(batch)
        assert all(0 <= i < 50 for i in batch)
        assert batch == sorted(batch)


@pytest.mark.parametrize("shared_seed", [False, True], ids=["independent", "shared-seed"])
def test_ranks_are_disjoint_shards_with_poisson_union(shared_seed: bool):
    n, q, steps, world = 2001, 0.05, 400, 2
    seeds = [4] * world if shared_seed else [4 + r for r in range(world)]
    samplers = [PoissonBatchSampler(n, q, steps, rank=r, world_size=world, random=_gen(seeds[r])) for r in range(world)]
    per_rank = [_logical_batches(s) for s in samplers]
    union_sizes = []
    for step in range(steps):
        parts = [set(per_rank[r][step]) for r in range(world)]
        for r, part in enumerate(parts):
            assert all(i % world == r for i in part), "index outside this rank's shard"
        assert not parts[0] & parts[1]
        union_sizes.append(len(parts[0] | parts[1]))
    assert _looks_binomial(union_sizes, n, q)


def test_chunks_split_the_logical_batch():
    n, q, steps, k = 30, 0.2, 200, 3
    chunked = PoissonBatchSampler(n, q, steps, num_chunks=k, random=_gen(5))
    whole = PoissonBatchSampler(n, q, steps, random=_gen(5))
    assert len(chunked) == steps * k
    batches = list(chunked)
    assert len(batches) == steps * k
    for step, logical in enumerate(whole):
        chunks = batches[step * k : (step + 1) * k]
        assert sum(chunks, []) == logical
        sizes = [len(c) for c in chunks]
        assert max(sizes) - min(sizes) <= 1


def test_empty_logical_batch_gives_empty_chunks():
    sampler = PoissonBatchSampler(10, 0.01, 50, num_chunks=3, random=_gen(6))
    batches = list(sampler)
    assert len(batches) == len(sampler) == 150
    empty_steps = [i for i in range(0, 150, 3) if batches[i : i + 3] == [[], [], []]]
    assert empty_steps, "expected some empty logical batches at q=0.01, N=10"


def test_empty_batches_are_yielded_not_skipped():
    sampler = PoissonBatchSampler(50, 0.002, 200, random=_gen(7))
    sizes = [len(b) for b in sampler]
    assert len(sizes) == 200
    assert sizes.count(0) > 100  # P(empty) = 0.998**50 ~ 0.90
    assert sum(sizes) > 0


def test_default_generator_is_not_the_public_seed():
    torch.manual_seed(0)
    first = list(PoissonBatchSampler(1000, 0.1, 5))
    torch.manual_seed(0)
    second = list(PoissonBatchSampler(1000, 0.1, 5))
    assert first != second


def test_set_epoch_does_not_reseed():
    sampler = PoissonBatchSampler(1000, 0.1, 5)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(0)
    assert list(sampler) != first
    other = PoissonBatchSampler(1000, 0.1, 5)
    other.set_epoch(0)
    assert list(other) != first


def test_attributes_and_expected_steps():
    s = PoissonBatchSampler(100, 0.25, 4, num_chunks=2, rank=1, world_size=3)
    assert (s.num_samples, s.sample_rate, s.steps_per_epoch) == (100, 0.25, 4)
    assert (s.num_chunks, s.rank, s.world_size) == (2, 1, 3)
    assert expected_steps_per_epoch(0.05) == 20
    assert expected_steps_per_epoch(0.3) == 3
    assert expected_steps_per_epoch(1.0) == 1
    assert PoissonBatchSampler.steps_per_epoch_for(0.01) == 100


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_samples": 0},
        {"sample_rate": 0.0},
        {"sample_rate": 1.5},
        {"sample_rate": -0.1},
        {"sample_rate": float("nan")},
        {"steps_per_epoch": 0},
        {"num_chunks": 0},
        {"rank": -1},
        {"rank": 2, "world_size": 2},
        {"world_size": 0},
        {"num_samples": 10.5},
    ],
)
def test_invalid_arguments_raise(kwargs):
    args = {"num_samples": 10, "sample_rate": 0.1, "steps_per_epoch": 5} | kwargs
    with pytest.raises(ValueError):
        PoissonBatchSampler(**args)


def test_expected_steps_rejects_bad_rate():
    with pytest.raises(ValueError):
        expected_steps_per_epoch(0.0)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, "good": 2, "bad": 3, "movie": 4, "very": 5}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def _assert_same_batch(a, b):
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key])


def test_empty_safe_collator_with_padding(tokenizer):
    collate = DataCollatorWithPadding(tokenizer)
    features = [dict(tokenizer(t), label=y) for t, y in [("good movie", 1), ("very very bad movie", 0)]]
    with pytest.raises(AttributeError):  # the failure this wrapper exists for
        collate([])
    safe = EmptySafeCollator(collate, features[0])
    full = safe(features)
    _assert_same_batch(full, collate(features))
    empty = safe([])
    assert set(empty) == set(full) == {"input_ids", "attention_mask", "labels"}
    for key, value in empty.items():
        assert value.shape[0] == 0 and value.dtype == full[key].dtype
        assert value.shape[1:] == collate([features[0]])[key].shape[1:]
    assert batch_size_of(empty) == 0 and batch_size_of(full) == 2


def test_empty_safe_collator_with_default_collator():
    features = [
        {"input_ids": [1, 2, 3], "label": 0, "weight": 0.5},
        {"input_ids": [4, 5, 6], "label": 1, "weight": 1.0},
    ]
    with pytest.raises(IndexError):
        default_data_collator([])
    safe = EmptySafeCollator(default_data_collator, features[0])
    _assert_same_batch(safe(features), default_data_collator(features))
    empty = safe([])
    assert set(empty) == {"input_ids", "labels", "weight"}
    assert empty["input_ids"].shape == (0, 3) and empty["input_ids"].dtype == torch.long
    assert empty["labels"].shape == (0,) and empty["weight"].dtype == torch.float32
    assert safe([]) is not empty  # callers may mutate the returned dict


def test_empty_safe_collator_keeps_non_tensors_and_caches():
    calls = []

    def collate(features):
        calls.append(len(features))
        x = torch.ones(len(features), 2, dtype=torch.float16)
        return {"x": x, "scale": torch.tensor(2.0), "tag": "t"}

    safe = EmptySafeCollator(collate, {"x": 1})
    for _ in range(3):
        empty = safe([])
        assert empty["x"].shape == (0, 2) and empty["x"].dtype == torch.float16
        assert empty["scale"].dim() == 0 and empty["tag"] == "t"
    assert calls == [1]


def test_batch_size_of():
    assert batch_size_of({"ids": [1, 2], "scale": torch.tensor(1.0), "x": torch.zeros(4, 2)}) == 4
    with pytest.raises(ValueError):
        batch_size_of({"ids": [1, 2], "scale": torch.tensor(1.0)})


def test_dataloader_iterates_every_batch_including_empty(tokenizer):
    texts = ["good movie", "bad movie", "very good", "very very bad movie", "movie"] * 4
    ds = datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(len(texts))]})
    ds = ds.map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    sampler = PoissonBatchSampler(len(ds), 0.05, 60, num_chunks=2, random=_gen(8))
    loader = DataLoader(
        ds, batch_sampler=sampler, collate_fn=EmptySafeCollator(DataCollatorWithPadding(tokenizer), ds[0])
    )
    assert len(loader) == 120
    sizes = [batch_size_of(batch) for batch in loader]
    assert len(sizes) == 120
    assert 0 in sizes and sum(sizes) > 0


def test_lengths_order_each_batch_without_changing_it():
    """Length-sorted chunks: per step the same examples as unsorted (same secret draw), in order of length."""
    n, q, steps, k = 60, 0.3, 100, 3
    lengths = torch.tensor([(7 * i) % 23 for i in range(n)])
    plain = _logical_batches(PoissonBatchSampler(n, q, steps, num_chunks=k, random=_gen(8)))
    ordered = PoissonBatchSampler(n, q, steps, num_chunks=k, random=_gen(8), lengths=lengths)
    batches = list(ordered)
    for step, logical in enumerate(plain):
        chunks = batches[step * k : (step + 1) * k]
        joined = sum(chunks, [])
        assert sorted(joined) == sorted(logical)
        assert [int(lengths[i]) for i in joined] == sorted(int(lengths[i]) for i in logical)
        sizes = [len(c) for c in chunks]
        assert max(sizes) - min(sizes) <= 1


def test_lengths_must_cover_every_example():
    with pytest.raises(ValueError, match="lengths has 9 entries for 10 examples"):
        PoissonBatchSampler(10, 0.5, 5, random=_gen(9), lengths=torch.ones(9))
