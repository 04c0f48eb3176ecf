"""Is an evaluation set held out? Checked against the training set before its metrics are called held-out.

Metrics on training examples are un-noised functions of the private data: the card must never present them as a
held-out result. An evaluation set overlaps the training set when it is the same object, has the same `datasets`
fingerprint, or has a row that repeats a training example (`row_identity`): the same unpadded tokens, the same text,
or, for sets stored at different max_length, the same first tokens (at least MIN_PREFIX) up to where the shorter set
stops. Labels are left out: the same input under another label still shows what the model learnt from that example.

Memory: a 16-byte blake2b key per training row for tokens and one for text (about 100 bytes each in a Python set),
one more set when a truncation comparison is needed, and a key per evaluation row it must test that way; time is
one pass over each set, plus one over the training set per truncation length compared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from .logs import get_logger
from .prediction_collapse import HeldOutPredictions
from .row_identity import MIN_PREFIX, Identity, examples, identity, prefix_key, text_key, token_key

logger = get_logger(__name__)

HELD_OUT = "held-out"
OVERLAPS = "overlaps the training data"
# What a shared row repeats; the card's held-out heading says the same ("checked to repeat no ...").
COMPARED = "training example's tokens, padding ignored, or text"

_LABEL_COLUMNS = ("label", "labels", "label_ids")
_TIMING_METRICS = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")


class _Keys(NamedTuple):
    tokens: set[bytes]
    texts: set[bytes]
    longest: int  # the longest token row: the training set's truncation length, if it was truncated


class TrainingRows:
    """The training set's row keys, computed once (on first need) per way of comparing."""

    def __init__(self, train_dataset, input_columns: Sequence[str], label_columns: Sequence[str] = (),
                 pad_token_id: int | None = None) -> None:
        self.train_dataset = train_dataset
        self.input_columns = list(input_columns)  # what the model accepts; other columns never reach it
        self.label_columns = {*_LABEL_COLUMNS, *label_columns}
        self.pad_token_id = pad_token_id
        self._keys: dict[Identity, _Keys] = {}
        self._prefixes: dict[tuple[Identity, int], set[bytes]] = {}
        self._checked: dict[int, tuple[Any, int]] = {}  # id → (dataset, overlap); holding it keeps its id unique

    def overlap(self, eval_dataset, name: str) -> int:
        """How many rows of `eval_dataset` are training rows (all, for the training set); warns once per set."""
        seen = self._checked.get(id(eval_dataset))
        if seen is not None and seen[0] is eval_dataset:
            return seen[1]
        count, size = self._count_overlap(eval_dataset)
        self._checked[id(eval_dataset)] = (eval_dataset, count)
        if count:
            logger.warning(
                "Evaluation set %r shares %d of its %d rows with the training data (each repeats a %s): its metrics "
                "are un-noised functions of the private training data, not a held-out result, and the model card "
                "will not publish them.", name, count, size, COMPARED,
            )
        return count

    def _count_overlap(self, eval_dataset) -> tuple[int, int]:
        """(rows of `eval_dataset` that are training rows, rows of `eval_dataset`); one pass, streaming sets too."""
        train = self.train_dataset
        fingerprint = getattr(eval_dataset, "_fingerprint", None)
        if eval_dataset is train or (fingerprint is not None and fingerprint == getattr(train, "_fingerprint", None)):
            return len(eval_dataset), len(eval_dataset)
        how = identity(train, eval_dataset, self.input_columns, self.label_columns, self.pad_token_id)
        if how is None:
            return 0, 0  # no column in common: no row can be shared
        known = self._training_keys(how)
        shared = size = longest = 0
        untested: list[tuple[int, bytes]] = []  # (cut, prefix key) per unmatched row; the cut applying shows at the end
        for example in examples(eval_dataset, how):
            size += 1
            longest = max(longest, example.length)
            if token_key(example) in known.tokens or text_key(example) in known.texts:
                shared += 1
            elif (cut := min(known.longest, example.length)) > MIN_PREFIX:
                untested.append((cut, prefix_key(example, cut)))
        cut = min(known.longest, longest)
        if untested and longest != known.longest and cut > MIN_PREFIX:
            truncated = self._training_prefixes(how, cut)
            shared += sum(row_cut == cut and key in truncated for row_cut, key in untested)
        return shared, size

    def _training_keys(self, how: Identity) -> _Keys:
        if how not in self._keys:
            tokens, texts, longest = set(), set(), 0
            for example in examples(self.train_dataset, how):
                tokens.add(token_key(example))
                if (text := text_key(example)) is not None:
                    texts.add(text)
                longest = max(longest, example.length)
            self._keys[how] = _Keys(tokens, texts, longest)
        return self._keys[how]

    def _training_prefixes(self, how: Identity, cut: int) -> set[bytes]:
        """Prefix keys at `cut` of the training rows at least `cut` long (`row_identity.prefix_key`)."""
        if (how, cut) not in self._prefixes:
            self._prefixes[how, cut] = {prefix_key(example, cut) for example in examples(self.train_dataset, how)
                                        if example.length >= cut}
        return self._prefixes[how, cut]


class Evaluations:
    """Each evaluation's metrics with the verdict on the very set that produced them (what the card may publish), and
    the held-out predictions counted for the collapse warning. Overlapping sets given at construction warn at once."""

    def __init__(self, training_rows: TrainingRows, eval_dataset) -> None:
        self.training_rows = training_rows
        self.results: dict[str, tuple[str, dict[str, float]]] = {}  # prefix → (HELD_OUT or OVERLAPS, last metrics)
        self.predictions = HeldOutPredictions()  # counted in compute_loss, checked after evaluate()
        for prefix, dataset in eval_sets(eval_dataset):
            training_rows.overlap(dataset, prefix)

    def record(self, dataset, prefix: str, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """`evaluate()` on `dataset`, its predictions counted if held out, its metrics recorded under `prefix`."""
        status = OVERLAPS if self.training_rows.overlap(dataset, prefix) else HELD_OUT
        with self.predictions.counting(held_out=status == HELD_OUT):
            metrics = evaluate()
        self.results[prefix] = (status, published_metrics(metrics, prefix))
        return metrics


def pad_token_id(processing_class) -> int | None:
    """The tokenizer's pad id, also behind a processor; without one, only an attention_mask shows padding."""
    pad = getattr(getattr(processing_class, "tokenizer", processing_class), "pad_token_id", None)
    return pad if isinstance(pad, int) else None


def eval_sets(eval_dataset, prefix: str = "eval") -> Iterator[tuple[str, Any]]:
    """(metric key prefix, dataset) for each evaluation set, named as `Trainer.evaluate` prefixes its metrics."""
    if isinstance(eval_dataset, Mapping):
        for name, dataset in eval_dataset.items():
            yield f"{prefix}_{name}", dataset
    elif eval_dataset is not None:
        yield prefix, eval_dataset


def published_metrics(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """What `evaluate(metric_key_prefix=prefix)` returned, less timings and memory (not results)."""
    start = f"{prefix}_"
    return {key: round(value, 4) for key, value in metrics.items() if key.startswith(start)
            and key[len(start):] not in _TIMING_METRICS and not key[len(start):].startswith("mem_")}


def card_evaluation(results: Mapping[str, tuple[str, dict[str, float]]]) -> tuple[dict[str, float], list[str]]:
    """(held-out metrics the card publishes, a note for each evaluation set it withholds) from prefix → (status,
    metrics)."""
    published: dict[str, float] = {}
    notes = []
    for prefix, (status, metrics) in results.items():
        if status == HELD_OUT:
            published.update(metrics)
        else:
            notes.append(f"`{prefix}` was evaluated on data overlapping the training data: its metrics are "
                         "un-noised, not covered by the privacy guarantee and not a held-out result, so they are "
                         "not published.")
    return published, notes
