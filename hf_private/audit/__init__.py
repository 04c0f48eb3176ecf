"""Empirical privacy audit in one training run (Steinke, Nasr, Jagielski, NeurIPS 2023).

m canaries, each carrying a token of its own (a new vocabulary row nothing else uses), are each added to the
training set with probability ½. One private training run later, every canary is scored: white-box by how far its
own embedding row moved along the direction its gradient pointed at the start, black-box by how much its loss fell.
Where the input embedding does not train (LoRA, BiTFiT, sparse low-rank, DP-FP's head), the white-box score comes
from a second set of m gradient canaries (`gradient_canaries`): a sampled one's gradient is replaced by a secret
Dirac in the method's own trainable coordinates, read back from every step's released noisy gradient. The k₊ highest
scores are guessed "in" and the k₋ lowest "out" (both counts fixed before training); if the run were (ε, δ)-DP, many
correct guesses would be unlikely, which gives an ε below which the claim is refuted at the stated confidence. The
same guesses are also tested against μ-GDP (every (ε, δ_μ(ε)) point of the Gaussian trade-off curve at once), which
certifies more from them; both are reported with the ceiling each could reach with these canaries and guesses (every
guess right: about ε = 5.8 with 1,000 canaries, 7.8 with 10,000, all guessed, at δ = 1e-5).

What it can and cannot show: the result is a *lower* bound. A bound above the claimed ε proves the implementation
(or its accounting) is broken; a bound below it proves nothing — last-iterate canary audits are loose and catch
gross bugs (missing noise, skipped clipping, a sensitivity off by the batch size), not a 20% accounting error. The
guarantee is the accountant's ε, never this number.

This package is the library the trainer and the model card use, and it never imports the trainer: `bounds` (counts
of correct guesses → ε and μ-GDP lower bounds), `result` (`AuditResult`, its card entry and its composition into the
privacy report), `canaries` (the canary tokens and examples), `scores` (white-box and black-box scores of a trained
model) and `gradient_canaries` (inserted through the engine, read from the optimizer). What drives a training run
lives in `cli`: `run_audit` and the `hf-private-audit` command (`python -m hf_private.audit`); import it as
`hf_private.cli.audit`, it is not re-exported here.
"""

from ..privacy.events import AUDIT_MECHANISM_PREFIX
from .bounds import (
    count_correct,
    epsilon_from_error_rates,
    gdp_delta,
    gdp_epsilon,
    one_run_epsilon_lower_bound,
    one_run_gdp_p_value,
    one_run_mu_lower_bound,
    one_run_p_value,
)
from .canaries import add_canary_tokens, build_canaries
from .result import AUDIT_DATA, AuditCeiling, AuditResult, ScoreBound, compose_audits
from .scores import BLACK_BOX, WHITE_BOX, canary_descent_directions, canary_losses

__all__ = [
    "AUDIT_DATA",
    "AUDIT_MECHANISM_PREFIX",
    "BLACK_BOX",
    "WHITE_BOX",
    "AuditCeiling",
    "AuditResult",
    "ScoreBound",
    "add_canary_tokens",
    "build_canaries",
    "canary_descent_directions",
    "canary_losses",
    "compose_audits",
    "count_correct",
    "epsilon_from_error_rates",
    "gdp_delta",
    "gdp_epsilon",
    "one_run_epsilon_lower_bound",
    "one_run_gdp_p_value",
    "one_run_mu_lower_bound",
    "one_run_p_value",
]
