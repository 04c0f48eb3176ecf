"""Is an evaluation set held out? Checked against the training set before its metrics are called held-out.

Metrics on training examples are un-noised functions of the private data: the card must never present them as a
held-out result. Both sets are compared unit by unit (`row_identity.examples`): a row, or each sequence of a row that
packs several (TRL's packing). An evaluation set overlaps the training set when it is the same object, has the same
`datasets` fingerprint, or has a unit that repeats a training unit: the same unpadded tokens, the same text, or, for
sets stored at different max_length, the same first tokens (at least MIN_PREFIX) up to where the shorter set stops.
Labels, and columns a trainer derives from a unit (DPO's precomputed reference log-probabilities), are left out: the
same input under another label still shows what the model learnt from that example.

Three verdicts: held-out, overlapping, and unknown where the check cannot tell (a packed row it cannot cut into its
sequences, on either side; rows packed so that sequences may be cut across them; sets with no column in common).
Only a held-out set's metrics are published.

Memory: a 16-byte blake2b key per training row for tokens and one for text (about 100 bytes each in a Python set),
one more set when a truncation comparison is needed, and a key per evaluation row it must test that way; time is
one pass over each set, plus one over the training set per truncation length compared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, NamedTuple

from ..logs import get_logger
from .prediction_collapse import HeldOutPredictions
from .row_identity import MIN_PREFIX, Identity, examples, identity, prefix_key, text_key, token_key

logger = get_logger(__name__)

HELD_OUT = "held-out"
OVERLAPS = "overlaps the training data"
UNKNOWN = "not known to be held out"
# What a shared unit repeats; the card's held-out heading says the same ("checked to repeat no ...").
COMPARED = "training example's tokens, padding ignored, or text"

_LABEL_COLUMNS = ("label", "labels", "label_ids")
_TIMING_METRICS = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")


class _Keys(NamedTuple):
    tokens: set[bytes]
    texts: set[bytes]
    longest: int  # the longest token row: the training set's truncation length, if it was truncated
    undivided: int  # training rows packing sequences that could not be cut apart


class Overlap(NamedTuple):
    """What the check found in one evaluation set."""

    shared: int  # its units that repeat a training unit
    units: int  # its units compared
    unknown: str | None  # why units that repeat none may still be training data (None: they are not)

    @property
    def verdict(self) -> str:
        return OVERLAPS if self.shared else UNKNOWN if self.unknown else HELD_OUT


class TrainingRows:
    """The training set's unit keys, computed once (on first need) per way of comparing.

    `label_columns`: labels, and the columns a trainer derives from a unit (left out of its key). `unmarked`: why the
    trainer's evaluation rows may hold parts of units that nothing in a row delimits (TRL packing that cuts
    sequences across rows), which leaves every set not shown to overlap unknown; None when rows hold whole units.
    """

    def __init__(
        self,
        train_dataset,
        input_columns: Sequence[str],
        label_columns: Sequence[str] = (),
        pad_token_id: int | None = None,
        unmarked: str | None = None,
    ) -> None:
        self.train_dataset = train_dataset
        self.input_columns = list(input_columns)  # what the model accepts; other columns never reach it
        self.label_columns = {*_LABEL_COLUMNS, *label_columns}
        self.pad_token_id = pad_token_id
        self.unmarked = unmarked
        self._keys: dict[Identity, _Keys] = {}
        self._prefixes: dict[tuple[Identity, int], set[bytes]] = {}
        self._checked: dict[int, tuple[Any, Overlap]] = {}  # id → (dataset, overlap); holding it keeps its id unique

    def overlap(self, eval_dataset, name: str) -> Overlap:
        """What `eval_dataset` shares with the training data (all of it, for the training set); warns once per set."""
        seen = self._checked.get(id(eval_dataset))
        if seen is not None and seen[0] is eval_dataset:
            return seen[1]
        found = self._count_overlap(eval_dataset)
        self._checked[id(eval_dataset)] = (eval_dataset, found)
        if found.shared:
            logger.warning(
                "Evaluation set %r shares %d of its %d units (rows, or the sequences packed in a row) with the "
                "training data (each repeats a %s): its metrics are un-noised functions of the private training "
                "data, not a held-out result, and the model card will not publish them.",
                name,
                found.shared,
                found.units,
                COMPARED,
            )
        elif found.unknown:
            logger.warning(
                "Evaluation set %r could not be checked against the training data: %s. Its metrics may be un-noised "
                "functions of the private training data, and the model card will not publish them as held-out.",
                name,
                found.unknown,
            )
        return found

    def _count_overlap(self, eval_dataset) -> Overlap:
        """Units of `eval_dataset` that are training units, and why the rest may be; one pass, streaming sets too."""
        train = self.train_dataset
        fingerprint = getattr(eval_dataset, "_fingerprint", None)
        if eval_dataset is train or (fingerprint is not None and fingerprint == getattr(train, "_fingerprint", None)):
            return Overlap(len(eval_dataset), len(eval_dataset), None)
        how = identity(train, eval_dataset, self.input_columns, self.label_columns, self.pad_token_id)
        if how is None:
            return Overlap(0, 0, "it has no column in common with the training set, so no row can be compared")
        known = self._training_keys(how)
        shared = size = longest = undivided = 0
        untested: list[tuple[int, bytes]] = []  # (cut, prefix key) per unmatched unit; the cut applying shows last
        for example in examples(eval_dataset, how):
            size += 1
            longest = max(longest, example.length)
            if token_key(example) in known.tokens or text_key(example) in known.texts:
                shared += 1
                continue
            undivided += example.undivided
            if (cut := min(known.longest, example.length)) > MIN_PREFIX:
                untested.append((cut, prefix_key(example, cut)))
        cut = min(known.longest, longest)
        if untested and longest != known.longest and cut > MIN_PREFIX:
            truncated = self._training_prefixes(how, cut)
            shared += sum(row_cut == cut and key in truncated for row_cut, key in untested)
        return Overlap(shared, size, self._unknown(undivided, known.undivided))

    def _unknown(self, undivided: int, training_undivided: int) -> str | None:
        """Why units that matched nothing may still be training units."""
        if undivided:
            return (
                f"{undivided} of its rows pack several sequences that could not be cut apart (their seq_lengths "
                "or restarting position_ids do not add up, or the row has text or other columns that are not one "
                "value per token), so their sequences were not compared"
            )
        if training_undivided:
            return (
                f"{training_undivided} training rows pack several sequences that could not be cut apart, so "
                "their sequences are not known"
            )
        return self.unmarked

    def _training_keys(self, how: Identity) -> _Keys:
        if how not in self._keys:
            tokens, texts, longest, undivided = set(), set(), 0, 0
            for example in examples(self.train_dataset, how):
                tokens.add(token_key(example))
                if (text := text_key(example)) is not None:
                    texts.add(text)
                longest = max(longest, example.length)
                undivided += example.undivided
            self._keys[how] = _Keys(tokens, texts, longest, undivided)
        return self._keys[how]

    def _training_prefixes(self, how: Identity, cut: int) -> set[bytes]:
        """Prefix keys at `cut` of the training rows at least `cut` long (`row_identity.prefix_key`)."""
        if (how, cut) not in self._prefixes:
            self._prefixes[how, cut] = {
                prefix_key(example, cut) for example in examples(self.train_dataset, how) if example.length >= cut
            }
        return self._prefixes[how, cut]


class Evaluations:
    """Each evaluation's metrics with the verdict on the very set that produced them (what the card may publish), and
    the held-out predictions counted for the collapse warning. Overlapping sets given at construction warn at once.

    The verdict is made on the set an evaluation reads (`reading`, as its dataloader is built), as the trainer's
    evaluate prepared it: TRL tokenizes a set passed to `evaluate()`, appends an EOS to its text and packs it, so the
    set as passed is not the set evaluated. An evaluation that built no dataloader through `reading` is unknown."""

    def __init__(self, training_rows: TrainingRows, eval_dataset) -> None:
        self.training_rows = training_rows
        self.results: dict[str, tuple[str, dict[str, float]]] = {}  # prefix → (verdict, last metrics)
        self.predictions = HeldOutPredictions()  # counted in compute_loss, checked after evaluate()
        self._open: tuple[str, ExitStack] | None = None  # the evaluation under way: its prefix, its counting
        self._verdicts: list[str] = []  # of the sets it read
        for prefix, dataset in eval_sets(eval_dataset):
            training_rows.overlap(dataset, prefix)

    def record(self, prefix: str, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """`evaluate()`, its metrics recorded under `prefix` with the verdict on the set it read."""
        self._verdicts = []
        with ExitStack() as counting:
            self._open = (prefix, counting)
            try:
                metrics = evaluate()
            finally:
                self._open = None
        status = self._verdicts[0] if len(set(self._verdicts)) == 1 else UNKNOWN
        if not self._verdicts:
            logger.warning(
                "Evaluation %r read no set through PrivateTrainingMixin.get_eval_dataloader (a subclass "
                "overrides it without calling super()?): the set evaluated was not checked against the "
                "training data, and the model card will not publish its metrics as held-out.",
                prefix,
            )
        self.results[prefix] = (status, published_metrics(metrics, prefix))
        return metrics

    def reading(self, dataset) -> None:
        """The set the evaluation under way reads: judged, and its predictions counted if held out (outside an
        evaluation, e.g. in predict(), nothing is recorded)."""
        if self._open is None:
            return
        prefix, counting = self._open
        verdict = self.training_rows.overlap(dataset, prefix).verdict
        self._verdicts.append(verdict)
        counting.enter_context(self.predictions.counting(held_out=verdict == HELD_OUT))


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
    return {
        key: round(value, 4)
        for key, value in metrics.items()
        if key.startswith(start)
        and key[len(start) :] not in _TIMING_METRICS
        and not key[len(start) :].startswith("mem_")
    }


def card_evaluation(results: Mapping[str, tuple[str, dict[str, float]]]) -> tuple[dict[str, float], list[str]]:
    """(held-out metrics the card publishes, a note for each evaluation set it withholds) from prefix → (status,
    metrics)."""
    published: dict[str, float] = {}
    notes = []
    for prefix, (status, metrics) in results.items():
        if status == HELD_OUT:
            published.update(metrics)
        elif status == OVERLAPS:
            notes.append(
                f"`{prefix}` was evaluated on data overlapping the training data: its metrics are "
                "un-noised, not covered by the privacy guarantee and not a held-out result, so they are "
                "not published."
            )
        else:
            notes.append(
                f"`{prefix}` was evaluated on data that could not be checked against the training data "
                "(the training log says why): its metrics may be un-noised functions of the training data, "
                "not covered by the privacy guarantee, so they are not published as a held-out result."
            )
    return published, notes
