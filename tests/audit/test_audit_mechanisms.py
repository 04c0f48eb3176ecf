"""The one-run audit of adaptive clipping and of BandMF's correlated noise (issue 50).

Adaptive clipping: each gradient canary is inserted at the C its step clips at and read in units of that C. BandMF:
the released canary coordinates carry w = C⁻¹z, correlated from step to step; the white-box score whitens them with
the strategy C first. Each sound audit is paired with an unnoised run the same audit must refute.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithPadding

from hf_private import DPConfig
from hf_private.audit import AuditResult
from hf_private.cli import audit as audit_cli
from hf_private.models.peft import unwrap_peft
from hf_private.privacy.band_mf import strategy_matrix
from tests.audit.test_audit import AUDIT_ARGS, BUGS, CLAIMED_EPSILON, CLIP, DELTA, assert_power
from tests.audit.test_gradient_canaries import DEFAULT_CANARIES
from tests.support import tiny
from tests.support.helpers import training_args

BANDS = 4


def _audit(output_dir, monkeypatch, dp: DPConfig, **kwargs) -> tuple[AuditResult, audit_cli.GradientCanaryInserter]:
    """The audit of a tiny BERT, and the gradient canaries' inserter it used (to read what it released)."""
    inserters = []

    class Recorded(audit_cli.GradientCanaryInserter):
        """Also notes every canary a chunk held: the others' reads are noise (and the data's drift) alone."""

        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            self.sampled = torch.zeros(self.canaries.count, dtype=torch.bool)
            self.model = args[0]
            inserters.append(self)

        def _canary_of_units(self, units):
            canary = super()._canary_of_units(units)
            self.sampled[canary[canary >= 0]] = True
            return canary

    monkeypatch.setattr(audit_cli, "GradientCanaryInserter", Recorded)
    tok = tiny.tokenizer()
    result = audit_cli.run_audit(
        tiny.bert,
        tiny.sentiment_dataset(400, seed=1),
        dp,
        training_args(output_dir, **AUDIT_ARGS),
        canaries=DEFAULT_CANARIES,
        seed=0,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        **kwargs,
    )
    (inserter,) = inserters
    return result, inserter


@pytest.mark.parametrize("bug", [None, "noise-not-added"], ids=["sound", "noise-not-added"])
def test_an_adaptive_clipping_run_is_audited_at_each_steps_c(tmp_path, monkeypatch, bug):
    if bug is not None:
        BUGS[bug](monkeypatch)
    dp = DPConfig(
        target_epsilon=CLAIMED_EPSILON,
        target_delta=DELTA,
        max_grad_norm="adaptive",
        initial_max_grad_norm=CLIP,
        noise_seed=1000,
    )
    result, inserter = _audit(tmp_path, monkeypatch, dp, scores=("white-box-gradient",))
    assert_power(result, result.bounds[0], bug)
    # every step's read is scaled by the C it clipped at: the adapted trajectory, which moved
    assert inserter.clips[0] == CLIP and len(set(inserter.clips)) == len(inserter.clips) == len(inserter.released)


def _lag_one_correlation(steps: torch.Tensor) -> float:
    """Σ x_t x_{t−1} / Σ x_t² pooled over the canaries: zero-mean noise needs no centring (which would bias it by
    about −1/steps)."""
    return float((steps[1:] * steps[:-1]).sum() / (steps[1:] * steps[1:]).sum())


def _noise_only(inserter) -> torch.Tensor:
    """The canaries whose coordinate no data gradient reaches: in the input embedding's new canary rows, and never
    sampled themselves (a sampled canary's row carries only its inserted gradient, at its own coordinate)."""
    canaries = inserter.canaries
    embedding = unwrap_peft(inserter.model).get_input_embeddings().weight
    names = [canaries.parameter_names[int(i)] for i in canaries.parameter]
    in_rows = torch.tensor([inserter._parameters.get(name) is embedding for name in names])
    rows = canaries.flat_index // embedding.shape[1]
    return in_rows & (rows >= canaries.first_token) & ~inserter.sampled


@pytest.mark.parametrize("bug", [None, "noise-not-added"], ids=["sound", "noise-not-added"])
def test_a_band_mf_run_is_audited_on_whitened_noise(tmp_path, monkeypatch, bug):
    """BandMF's white-box score reads gradient canaries (the embedding rows' final movement cannot be whitened).
    On coordinates no data reaches the reads are noise alone: their lag-1 correlation is that of w = C⁻¹z (from
    the covariance C⁻¹C⁻ᵀ) before whitening and 0 after, each within 4 standard errors."""
    if bug is not None:
        BUGS[bug](monkeypatch)
    dp = DPConfig(
        target_epsilon=CLAIMED_EPSILON, target_delta=DELTA, max_grad_norm=CLIP, noise_seed=1000,
        noise_mechanism="band-mf", bands=BANDS,
    )  # fmt: skip
    result, inserter = _audit(tmp_path, monkeypatch, dp)
    assert [b.score for b in result.bounds] == ["white-box-gradient", "black-box"]
    assert_power(result, result.bounds[0], bug)
    if bug is not None:
        return
    strategy = inserter.strategy
    assert len(strategy) == BANDS and any(strategy[1:])  # a real banded strategy, not the identity
    raw = torch.stack(inserter.released) / torch.tensor(inserter.clips, dtype=torch.float64).unsqueeze(1)
    noise = _noise_only(inserter)
    steps = raw.shape[0]
    inverse = torch.linalg.inv(strategy_matrix(strategy, steps))
    covariance = inverse @ inverse.T
    expected = float(covariance.diagonal(-1)[BANDS - 1 :].sum() / covariance.diagonal()[BANDS:].sum())
    tolerance = 4 / (noise.sum().item() * (steps - BANDS)) ** 0.5
    assert abs(expected) > 2 * tolerance  # the test can tell correlated from whitened noise
    before = _lag_one_correlation(raw[BANDS - 1 :, noise])  # pairs (t−1, t) with t ≥ b
    after = _lag_one_correlation(inserter.per_step()[BANDS - 1 :, noise])
    assert before == pytest.approx(expected, abs=tolerance)
    assert after == pytest.approx(0.0, abs=tolerance)
