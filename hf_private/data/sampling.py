"""Poisson batch sampling and empty-batch-safe collation.

The privacy accountant assumes every example enters every logical batch independently with
probability ``q``.  Shuffled fixed-size batches do not satisfy that, so the train loader is built from
:class:`PoissonBatchSampler`; its batches can be empty, which stock collators cannot handle, hence
:class:`EmptySafeCollator`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from ..privacy.rng import SecretRandom
from .packing import PACKED_LENGTHS_KEY, packed_lengths
from .rows import PACKING_KEYS, PER_EXAMPLE_KEYS, check_one_row_per_example

__all__ = [
    "EmptySafeCollator",
    "PartitionedPoissonBatchSampler",
    "band_partitions",
    "PoissonBatchSampler",
    "batch_size_of",
    "example_lengths",
    "expected_steps_per_epoch",
    "sampling_random",
]


def sampling_random(test_seed: int | None = None) -> SecretRandom:
    """The sampler's secret generator (`hf_private.privacy.rng`): a fresh OS-drawn key, independent on every rank.

    Insecure test mode (`test_seed` set: a stream's seed, `rng.test_stream_seed`): one key from the seed on every rank,
    so a multi-process run draws the very logical batch a single process would (each rank keeps its shard).
    """
    return SecretRandom(test_seed=test_seed)


def _check_sample_rate(sample_rate: float) -> float:
    if not (isinstance(sample_rate, (int, float)) and 0.0 < sample_rate <= 1.0):
        raise ValueError(f"sample_rate must be a number in (0, 1], got {sample_rate!r}")
    return float(sample_rate)


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def expected_steps_per_epoch(sample_rate: float) -> int:
    """Steps that visit N examples in expectation: N / E[batch] = 1 / q, at least one."""
    return max(1, round(1.0 / _check_sample_rate(sample_rate)))


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields Poisson(q) logical batches, each split into ``num_chunks`` micro-batches.

    Every step, each index of this rank's shard ``range(rank, num_samples, world_size)`` is kept
    independently with probability ``sample_rate``; the union over ranks is a Poisson sample of the
    whole dataset.  The logical batch is yielded as exactly ``num_chunks`` lists (near-equal, in
    order, possibly empty) because Trainer's gradient-accumulation loop fetches that many batches per
    optimizer step.  Empty batches are yielded, never skipped: the step still adds noise.

    The mask is drawn over all ``num_samples`` indices and then restricted to the shard, so the union
    stays Poisson whether the ranks use independent secret streams or one stream keyed alike (test mode).
    Inclusion compares float64 uniforms from the secret ChaCha20 stream with q (`SecretRandom.uniform`).

    With ``lengths`` (one per example), each logical batch is ordered by length before it is split, so a chunk
    holds examples of similar length and pads little (about half the tokens on SST-2 in chunks of 64). The
    batch is the same set either way: the order only decides which chunk an example is computed in, and the
    clipped sum does not depend on it.
    """

    steps_per_epoch_for = staticmethod(expected_steps_per_epoch)

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        num_chunks: int = 1,
        rank: int = 0,
        world_size: int = 1,
        random: SecretRandom | None = None,
        lengths: torch.Tensor | None = None,
    ) -> None:
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.sample_rate = _check_sample_rate(sample_rate)
        self.steps_per_epoch = _check_int("steps_per_epoch", steps_per_epoch, 1)
        self.num_chunks = _check_int("num_chunks", num_chunks, 1)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.random = random if random is not None else sampling_random()
        self._shard_indices = torch.arange(rank, num_samples, world_size)
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"lengths has {len(lengths)} entries for {num_samples} examples")
        self.lengths = None if lengths is None else torch.as_tensor(lengths)

    def _draw(self) -> torch.Tensor:
        """One logical batch of this rank: its shard's indices whose uniform draw falls below q."""
        uniforms = self.random.uniform(self.num_samples)
        keep = uniforms[self.rank :: self.world_size] < self.sample_rate
        batch = self._shard_indices[keep]
        if self.lengths is not None:
            batch = batch[torch.argsort(self.lengths[batch], stable=True)]
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            for chunk in torch.tensor_split(self._draw(), self.num_chunks):
                yield chunk.tolist()

    def __len__(self) -> int:
        return self.steps_per_epoch * self.num_chunks

    def set_epoch(self, epoch: int) -> None:
        """No-op: reseeding from the (public) epoch number would make the sample predictable."""


def band_partitions(num_samples: int, bands: int, random: SecretRandom) -> torch.Tensor:
    """Each example's BandMF partition in {0, …, b−1}, drawn i.i.d. uniformly from `random`, once per run.

    i.i.d. rather than `index mod b`: removing one example must leave every other example's partition as it was in
    distribution (a position-based rule would move every later example to another partition). The assignment does not
    depend on the data, but it is kept secret (the checkpoint stores it; it is never pushed) like the Poisson draws.
    """
    return torch.clamp((random.uniform(num_samples) * bands).long(), max=bands - 1)


class PartitionedPoissonBatchSampler(PoissonBatchSampler):
    """BandMF's b-min-sep sampling (Choquette-Choo et al. 2023, arXiv 2306.08153, Alg. 2): training step t
    Poisson-samples only partition t mod b, at rate q̂ = b·B/N, so the expected batch stays B and an example takes
    part in steps at least b apart. `step()` is the run's training step about to be drawn (read from the ledger when
    the batch is drawn, so a resumed run continues the cycle where it stopped)."""

    def __init__(
        self, *args: Any, partitions: torch.Tensor, bands: int, step: Callable[[], int], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if len(partitions) != self.num_samples:
            raise ValueError(f"partitions has {len(partitions)} entries for {self.num_samples} examples")
        self.partitions, self.bands, self.step = torch.as_tensor(partitions), _check_int("bands", bands, 1), step

    def _draw(self) -> torch.Tensor:
        uniforms = self.random.uniform(self.num_samples)
        keep = (uniforms < self.sample_rate) & (self.partitions == self.step() % self.bands)
        batch = self._shard_indices[keep[self.rank :: self.world_size]]
        if self.lengths is not None:
            batch = batch[torch.argsort(self.lengths[batch], stable=True)]
        return batch


class EmptySafeCollator:
    """Wraps a collate function so that an empty Poisson batch yields zero-length tensors.

    Stock collators fail on ``[]`` (``DataCollatorWithPadding`` raises AttributeError,
    ``default_data_collator`` IndexError).  The empty batch mirrors the collated template example:
    same keys, same dtypes and trailing shapes, batch dimension 0.  Every batch is checked to keep each
    example in rows of its own (`check_one_row_per_example`), or to pack whole examples into one row that says
    where each starts (`packing.packed_lengths`, carried as `PACKED_LENGTHS_KEY`).
    """

    def __init__(self, collate_fn: Callable[[list], Mapping[str, Any]], template_example: dict) -> None:
        self.collate_fn = collate_fn
        self.template_example = template_example
        self._empty: dict[str, Any] | None = None

    def __call__(self, features: list) -> Mapping[str, Any]:
        if len(features) > 0:
            batch = self.collate_fn(features)
            lengths = packed_lengths(batch, len(features))
            if lengths is None:
                check_one_row_per_example(batch, len(features))
                return batch
            return {**batch, PACKED_LENGTHS_KEY: lengths}
        if self._empty is None:
            template = self.collate_fn([self.template_example])
            if packed_lengths(template, 1) is not None:  # a packing collator: an empty chunk packs nothing
                template = {k: v for k, v in template.items() if k not in PACKING_KEYS}
            check_one_row_per_example(template, 1)
            self._empty = {
                key: value.new_empty((0, *value.shape[1:]))
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else value
                for key, value in template.items()
            }
        return dict(self._empty)


def slice_examples(value: Any, size: int, start: int, stop: int) -> Any:
    """Examples start:stop of a collated batch entry of `size` examples (an entry of another shape as it is)."""
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == size:
        return value[start:stop]
    return value


def chunk_lengths(args: Any, dataset: Any, processing_class: Any, packed: bool = False) -> torch.Tensor | None:
    """Lengths for length-sorted chunks when TrainingArguments asks to group by length, or when chunks are packed: a
    packed chunk's examples are regathered one per row for the per-example norms, padded to the chunk's longest, so
    chunks of similar lengths keep that padding small (else None). Sorting happens after the Poisson draw: which
    examples are in a logical batch does not change."""
    if not packed and getattr(args, "train_sampling_strategy", "random") != "group_by_length":
        return None
    names = getattr(processing_class, "model_input_names", None) or ["input_ids"]
    return example_lengths(dataset, args.length_column_name, names[0])


def example_lengths(dataset: Any, length_column: str, input_name: str) -> torch.Tensor:
    """One length per example, for length-sorted chunks: the `length_column` if the dataset has one, else the
    length of each example's `input_name` (as Trainer's group_by_length computes them)."""
    columns = getattr(dataset, "column_names", None) or []
    if length_column in columns:
        return torch.as_tensor(list(dataset[length_column]))
    if input_name in columns:
        return torch.tensor([len(x) for x in dataset[input_name]])
    try:
        return torch.tensor([len(dataset[i][input_name]) for i in range(len(dataset))])
    except (KeyError, TypeError, IndexError):
        raise ValueError(
            f"train_sampling_strategy='group_by_length' needs each example's length: give the dataset a "
            f"'{length_column}' column (TrainingArguments.length_column_name) or an '{input_name}' entry per example."
        ) from None


def batch_size_of(inputs: Mapping[str, Any]) -> int:
    """Number of examples (Poisson batches make it vary, 0 included): the packed examples of a packed chunk, else
    the leading dimension of `labels`, else of `input_ids`/`inputs_embeds`, else of the first batched tensor (others
    may broadcast a leading 1)."""
    if PACKED_LENGTHS_KEY in inputs:
        return len(inputs[PACKED_LENGTHS_KEY])
    keys = [k for k in PER_EXAMPLE_KEYS if k in inputs] + [k for k in inputs if k not in PER_EXAMPLE_KEYS]
    for value in (inputs[k] for k in keys):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError(f"no batched tensor in inputs (keys: {list(inputs)})")
