"""The ε written into each training log line: never decreasing, never below the ε spent, exact at the end, cheap.

Why not the exact ε every time: one PRV evaluation takes 0.03-0.2 s, as much as several training steps of a small
model. So a line may carry the exact ε of a few steps *ahead* (`PrivacyLedger.epsilon_ahead`): adding releases never
lowers ε, so it bounds what has been spent until training gets there, and it is logged again until then. How far
ahead is set by a cost budget: the seconds spent in the accountant for the logs stay within `COST_SHARE` of the
projected training time. While the budget affords the exact ε at every remaining log, that is what is logged; else
the evaluations still affordable are spaced geometrically so that they reach the end of the run.

A look-ahead extends the current mechanism only, so it never looks past `horizon_cap`: the run's stop, the end of
the current training stage, or a method's next own release (DP-FROST's selection). When the run stops at its
limit (the planned steps or the budget), the last look-ahead is the exact final ε and the column never decreases.
Stopped earlier by anything else (a callback, an exception), the exact final ε can be below the last logged bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..logs import get_logger
from .ledger import MechanismGroup, PrivacyLedger
from .plan import PrivacyPlan

logger = get_logger(__name__)

# The accountant's share of the training time for the logged ε (the final exact ε included).
COST_SHARE = 0.02


def horizon_cap(plan: PrivacyPlan, mechanisms: Sequence[MechanismGroup], steps: int, limit: int,
                next_release: int | None) -> int:
    """The most training steps a look-ahead after `steps` may assume while the current mechanism stays the same.

    That is `limit` (where the run stops), capped at the end of the current training stage and at `next_release`
    (the training step before which the method next releases a stage of its own); `steps` itself (no look-ahead)
    when the ledger's last release is not the current training stage's or the run is already past the limit.
    """
    if steps < 1 or not mechanisms or mechanisms[-1].name != plan.stage_at(steps - 1).name:
        return steps
    stage = plan.stage_at(steps - 1)
    cap = limit if stage == plan.training_stages[-1] else min(limit, stage.end_step)
    if next_release is not None:
        cap = min(cap, next_release)
    return max(steps, cap)


class EpsilonLog:
    """Chooses the ε of each training log line of one `train()` call (see the module docstring).

    `clock` (seconds) measures both the training time since `start_step` and the accountant's; tests inject a fake.
    `accountant_seconds` and `training_seconds()` are the totals the cost budget compares.
    """

    def __init__(self, ledger: PrivacyLedger, start_step: int, share: float = COST_SHARE,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.ledger = ledger
        self.share = share
        self.accountant_seconds = 0.0
        self._clock = clock
        self._started = clock()
        self._start_step = start_step
        self._last_step = start_step  # the training steps at the previous log line
        self._cost: float | None = None  # seconds of the last evaluation
        self._cost_horizon = 1  # the training steps it evaluated
        self._logged = -math.inf  # the last value logged
        self._covered: tuple[list[MechanismGroup], MechanismGroup] | None = None  # the history _logged bounds

    def training_seconds(self) -> float:
        """Wall time since the start, less the accountant's."""
        return self._clock() - self._started - self.accountant_seconds

    def at_step(self, steps: int, cap: int, limit: int) -> float:
        """The ε to log after `steps` training steps; `cap` from `horizon_cap`, `limit` where the run stops."""
        if not self._covers():
            horizon = self._horizon(steps, cap, limit)
            value = self._timed(lambda: self.ledger.epsilon_ahead(horizon - steps))
            self._cost_horizon = horizon
            *prefix, current = self.ledger.mechanisms
            self._covered = (prefix, replace(current, steps=current.steps + horizon - steps))
            self._logged = max(value, self._logged)
        self._last_step = steps
        return self._logged

    def final(self) -> float:
        """The exact ε at the end of training (free when the last look-ahead reached the final step)."""
        exact = self._timed(self.ledger.epsilon)
        if exact < self._logged:
            logger.info("The last logged ε=%.4g was an upper bound for steps the run did not reach (it stopped "
                        "early): the exact final ε is %.4g.", self._logged, exact)
        return exact

    def _covers(self) -> bool:
        """Whether the last logged value still bounds ε: only the mechanism it extended ran since, not past it."""
        if self._covered is None or not self.ledger.mechanisms:
            return False
        prefix, extended = self._covered
        *now_prefix, current = self.ledger.mechanisms
        return now_prefix == prefix and current.same_mechanism(extended) and current.steps <= extended.steps

    def _horizon(self, steps: int, cap: int, limit: int) -> int:
        """The training steps to evaluate ε at: `steps` (exact) while the budget affords the exact ε on every line
        left, else the first of the most geometrically spaced horizons t·r, t·r², …, limit that it affords.

        An evaluation at g steps is priced at the last one's seconds × √(g / its steps): PRV's time grows about as
        the square root of the steps (its grid spacing shrinks as 1/√T; measured on the demo's mechanism, 0.031 s at
        20 steps, 0.095 s at 234, 0.50 s at 3000).
        """
        if cap <= steps or not self._cost:  # nothing to look ahead to; no cost measured yet, or it was cached
            return steps
        budget = self._budget(steps, limit) * math.sqrt(self._cost_horizon) / self._cost  # in units of √steps
        gap = max(1, steps - self._last_step)  # as between the last two lines
        # Σ √line over the lines steps, steps + gap, … ≤ ∫ √x dx / gap (√ increases), then the final at `limit`
        exact = 2 / 3 * ((limit + gap) ** 1.5 - steps ** 1.5) / gap + math.sqrt(limit)
        if exact <= budget:
            return steps
        n = 1
        while n < (limit - steps) // gap + 1 and _geometric_cost(steps, limit, n + 1) <= budget:
            n += 1
        return cap if n == 1 else min(cap, math.ceil(steps * (limit / steps) ** (1 / n)))

    def _budget(self, steps: int, limit: int) -> float:
        """Seconds left to the accountant: `share` of the training time projected to `limit`, less those spent."""
        per_step = self.training_seconds() / max(1, steps - self._start_step)
        return self.share * per_step * max(1, limit - self._start_step) - self.accountant_seconds

    def _timed(self, evaluate: Callable[[], float]) -> float:
        before = self._clock()
        value = evaluate()
        self._cost = self._clock() - before
        self.accountant_seconds += self._cost
        return value


def _geometric_cost(steps: int, limit: int, n: int) -> float:
    """Σ √(steps·r^k) for k = 1..n, r = (limit/steps)^(1/n): n evaluations reaching `limit`, in units of √steps."""
    ratio = (limit / steps) ** (1 / (2 * n))
    return ratio * (math.sqrt(limit) - math.sqrt(steps)) / (ratio - 1)
