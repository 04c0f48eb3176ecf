"""What an accountant is: the interface each file of this package implements, and the numerics they share."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

import numpy as np

from ..events import Releases


class Accountant(ABC):
    """An upper bound on ε of a composition of Gaussian releases; registered by name with `register_accountant`.

    `epsilon_bound` does what every accountant would otherwise repeat before it asks one: it merges equal events
    (`events.merged_releases`), answers 0 for an empty history and ∞ for an un-noised release, and takes the noise
    sampler's tail out of δ (`tail.sampler_tail_delta`). So `epsilon` sees only noised releases (σ > 0), at the δ
    that is left. A release may be a user-level ELS one (k = `examples_per_user` ≥ 2): the accountant must bound
    it too, tightly or by a dominating mechanism, never by ignoring k.
    """

    #: A cheaper registered accountant whose answers are looser (larger ε) than this one's, used to seed the noise
    #: and step searches (`calibration`), which this accountant then finishes; None: searched by itself.
    search_seed: ClassVar[str | None] = None
    #: Added to the error when even the most noise allowed misses a target under this accountant.
    budget_hint: ClassVar[str] = ""

    @abstractmethod
    def epsilon(self, releases: Sequence[Releases], delta: float) -> tuple[float, str]:
        """ε at `delta` of the composition of `releases` (σ > 0 each, every (σ, q, k) once), a rigorous upper bound,
        and the name of what computed it: this accountant's, or the one that stood in where it could not run (the
        report names it, so that whoever recomputes ε from the card uses the same one)."""


@contextmanager
def quiet_numerics() -> Iterator[None]:
    """Silence opacus' numerical chatter that does not affect the bound.

    "Optimal order is the smallest/largest alpha": the RDP bound is still valid, only looser (we keep
    opacus' default orders, which the reference tables use); overflow in PRV's far tails.
    """
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.filterwarnings("ignore", message="Optimal order")
        yield
