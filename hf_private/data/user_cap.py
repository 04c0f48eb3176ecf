"""The ELS cap as a checkpoint keeps it: per user, which examples, named by their content, never by row number.

Under ELS every user keeps at most k examples, drawn secretly once (`users.cap_examples`), and the ledger accounts k.
A resumed run must keep the very same examples, and row numbers do not name them: after an unseeded `shuffle()` in the
launch script, or data files listed in another order, the same numbers are other rows (a user then had 20 of the 21
kept examples while the ledger accounted k = 1). So `user_cap.json` holds, per user, the fingerprints of the examples
kept, and a resume maps them onto the current rows, whatever their order, and refuses a training set whose rows
changed, naming how many users and rows differ.

An example's digest is SHA-256 of its columns as stored (a `datasets` format aside), user id included, in one
canonical JSON form. What is written tells nothing that needs less than all of a user's examples to test: each kept
example is stored as an HMAC of its digest under its user's key, the SHA-256 of all that user's digests (a multiset:
identical examples of one user are kept as often as they were), and the user under an HMAC of that key. No row, id,
text or per-user count is written.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .users import UserIndex

#: how the examples are fingerprinted; a checkpoint written another way is refused, not misread
FINGERPRINT = "sha256-canonical-json/hmac-per-user-v1"
_USER_KEY, _USER_TAG = b"hf_private user cap: user key\0", b"hf_private user cap: user tag"
_BATCH = 1024  # rows read at once from a datasets.Dataset


def example_digests(dataset: Any) -> list[bytes]:
    """SHA-256 of each row's columns as stored, in canonical JSON (sorted keys; tensors and arrays as lists)."""
    digests = []
    for row, example in enumerate(_rows(dataset)):
        try:
            text = json.dumps(example, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"Training example {row} cannot be fingerprinted for the ELS cap a checkpoint keeps "
                f"({error}): keep its columns to numbers, strings, lists, tensors, arrays or bytes."
            ) from None
        digests.append(hashlib.sha256(text.encode("utf-8")).digest())
    return digests


def _rows(dataset: Any) -> Iterator[dict[str, Any]]:
    """The rows as stored: a datasets.Dataset read in batches without its format, any other dataset row by row."""
    if not hasattr(dataset, "with_format"):
        yield from (dataset[i] for i in range(len(dataset)))
        return
    dataset = dataset.with_format(None)
    for start in range(0, len(dataset), _BATCH):
        batch = dataset[start : start + _BATCH]
        yield from (dict(zip(batch, values)) for values in zip(*batch.values()))


def _plain(value: Any) -> Any:
    """What JSON cannot write, as what it holds (tagged where a plain form could be mistaken for it)."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": bytes(value).hex()}
    if hasattr(value, "tobytes"):  # e.g. a decoded image
        return {"__" + type(value).__name__ + "__": value.tobytes().hex()}
    raise TypeError(f"a {type(value).__name__} value")


@dataclass(frozen=True)
class UserExamples:
    """A training set's examples by user and by content: what the cap is stored as, and checked against on resume."""

    index: UserIndex
    keys: list[bytes]  # per user: SHA-256 of the sorted digests of all its examples
    marks: list[str]  # per example: HMAC of its digest under its user's key

    @classmethod
    def of(cls, dataset: Any, index: UserIndex) -> UserExamples:
        digests = example_digests(dataset)
        order, starts = index.grouped()
        keys = [
            hashlib.sha256(_USER_KEY + b"".join(sorted(digests[i] for i in order[starts[u] : starts[u + 1]]))).digest()
            for u in range(index.users)
        ]
        marks = [hmac.new(keys[u], digest, "sha256").hexdigest() for u, digest in zip(index.user_of, digests)]
        return cls(index, keys, marks)

    def tags(self) -> list[str]:
        """Each user's name in the record: it changes whenever any of the user's examples does."""
        return [hmac.new(key, _USER_TAG, "sha256").hexdigest() for key in self.keys]

    def record(self, kept: np.ndarray) -> dict[str, list[str]]:
        """Per user (its tag), the sorted marks of its kept examples: every user, so a resume checks them all."""
        tags = self.tags()
        record: dict[str, list[str]] = {tag: [] for tag in tags}
        for i in kept:
            record[tags[self.index.user_of[i]]].append(self.marks[i])
        return {tag: sorted(marks) for tag, marks in record.items()}

    def kept_from(self, record: dict[str, list[str]], k: int) -> np.ndarray:
        """The sorted rows of this training set that hold the examples `record` kept; refused when any user's
        examples differ from those the record was drawn on, or when the record keeps more than k of a user's."""
        tags = self.tags()
        changed = [u for u, tag in enumerate(tags) if tag not in record]
        gone = len(set(record) - set(tags))
        if changed or gone:
            raise ValueError(self._changed(changed, gone, k))
        wanted = {tag: Counter(marks) for tag, marks in record.items()}
        kept = []
        for i, (user, mark) in enumerate(zip(self.index.user_of, self.marks)):
            if wanted[tags[user]][mark] > 0:
                wanted[tags[user]][mark] -= 1
                kept.append(i)
        unmatched = sum(sum(left.values()) for left in wanted.values())
        if unmatched or any(len(marks) > k for marks in record.values()):
            raise ValueError(
                f"The checkpoint's ELS cap is not one drawn on this training set ({unmatched} kept "
                f"examples unmatched, or more than max_examples_per_user={k} of a user's): it was "
                "edited or corrupted. Resume from another checkpoint, or start afresh in a new "
                "output_dir."
            )
        return np.asarray(kept, dtype=np.int64)

    def _changed(self, changed: list[int], gone: int, k: int) -> str:
        """Which users differ (by their first row here) and how many rows they have; how many of the record's are
        gone. Positions and counts only: no id or content."""
        order, starts = self.index.grouped()
        first = [int(order[starts[u]]) for u in changed]
        rows = int(sum(starts[u + 1] - starts[u] for u in changed))
        shown = ", ".join(map(str, first[:5])) + (f" and {len(first) - 5} more" if len(first) > 5 else "")
        return (
            f"The training set is not the one the checkpoint's ELS cap was drawn on. Users whose examples differ "
            f"from all of the checkpoint's: {len(changed)} of {self.index.users}"
            + (f" (first seen at rows {shown}; {rows} rows between them)" if changed else "")
            + f". The checkpoint's users not found: {gone}. The cap holds each user to the "
            f"max_examples_per_user={k} examples drawn then, matched by content whatever the rows' order: resume "
            "with the same training set (its rows in any order), or start afresh in a new output_dir."
        )
