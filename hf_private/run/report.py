"""What a private run says about its privacy: the report (`trainer.privacy_report()`, what the card states), the
figures a run without a formal guarantee may still show, and the lines that announce the plan.

Pure functions of the ledger, the plan, the method config, what the guarantee is about (`subject`), the method and
the attached audits: `PrivacyRun` calls them with its current state and logs what they return, so the numbers a user
reads are computed in one place and cannot drift from the state they describe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..audit import AuditResult, compose_audits
from ..data.users import UserIndex, sampled_unit, user_level_plan
from ..methods import DPMethod, MethodConfig
from ..privacy import MechanismGroup, PrivacyLedger, PrivacyPlan, compute_epsilon
from ..privacy.adaptive_clip import describe_clip

# Noise std per coordinate of the averaged update, in units of C (σ / expected batch), above which a run is warned
# that it will learn little: a rule of thumb (usual DP fine-tuning runs sit near 1e-3; 0.05 means twenty perfectly
# aligned clipped gradients per step to match one noise standard deviation).
NOISY_UPDATE = 0.05

TEST_MODE_NOTE = (
    "Trained in insecure test mode (DPConfig.noise_seed is set): the noise and sampling can be replayed "
    "by anyone who knows the seed, so no privacy loss is bounded."
)


def privacy_report(
    ledger: PrivacyLedger,
    plan: PrivacyPlan,
    config: MethodConfig,
    subject: dict[str, Any],
    method: DPMethod,
    audits: Sequence[AuditResult],
    *,
    noise_multiplier: float,
    trainable_fraction: float,
) -> dict[str, Any]:
    """ε, δ and what they rest on, as the card states them (`trainer.privacy_report()`); `noise_multiplier` is the
    current training stage's σ, `trainable_fraction` the share of the model's values the method trains.

    Returns:
        A dict with:

        - `epsilon` (float): the ε spent so far, at `delta`; absent without a formal guarantee.
        - `delta` (float): δ of the guarantee (the DP config's, or 1/(2N)).
        - `guarantee` (str): "formal", or "none" with `guarantee_note` saying why (DP-FP paper mode, a test seed).
        - `accountant` (str): what computed ε ("prv", "rdp", or "pld" for user-level ELS histories).
        - `sampler_tail_delta` (float): the part of δ the noise sampler's finite tail takes.
        - `dataset_size` (int): N, what sampling draws from (users under ULS; the kept examples under ELS).
        - `steps`, `planned_steps` (int): optimizer steps taken and planned.
        - `mechanisms` (list of dict): every release in the ledger (name, σ, q, steps, C, ...), enough to
          recompute ε.
        - `unit`, `trainer`, `base_model`: the privacy unit ("example", "preference pair", "user", ...), the
          trainer class, and the public base model (None for a local path); at user level also `user_column`,
          `user_sampling` and `examples_per_user` or `max_examples_per_user`.
        - `method`, `target_epsilon`, `noise_multiplier`, `sample_rate`, `max_grad_norm`, `expected_batch_size`,
          `trainable_fraction`, `phases` (each training stage and its first step), and `method_details` where
          the method reports its own.
        - With an audit on the training data attached: `epsilon` composed with it and `training_epsilon`,
          training's own. After a resume from a checkpoint older than the newest ledger: `forks` (and
          `epsilon_with_forks`).
        - Without a formal guarantee: no `epsilon` (nor `training_epsilon`); the numbers that may still be shown,
          each labelled, under `not_a_guarantee`.
    """
    report = ledger.report()
    notes = [note for note in dict.fromkeys([ledger.guarantee()[1], plan.guarantee[1]]) if note]
    if config.noise_seed is not None:
        notes.append(TEST_MODE_NOTE)
    report.pop("guarantee_note", None)
    report["guarantee"] = "none" if notes else "formal"
    if notes:
        report["guarantee_note"] = " ".join(notes)
    report.update(
        steps=plan.training_steps(ledger.mechanisms),  # optimizer steps; a method's own releases are in `mechanisms`
        method=method.name,
        **subject,
        target_epsilon=config.target_epsilon,
        noise_multiplier=noise_multiplier,
        sample_rate=plan.sample_rate,
        max_grad_norm=config.max_grad_norm,
        planned_steps=plan.planned_steps,
        expected_batch_size=plan.expected_batch_size,
        trainable_fraction=trainable_fraction,
        phases=[{"mechanism": stage.name, "from_step": stage.start_step} for stage in plan.training_stages],
    )
    details = method.report()
    if details:
        report["method_details"] = details
    report = compose_audits(report, audits, ledger.accountant)
    if ledger.forks:
        report["forks"] = ledger.forks
        if report["guarantee"] == "formal" and all(fork["newer_ledger_found"] for fork in ledger.forks):
            both = [MechanismGroup.from_dict(m) for m in report["mechanisms"]] + [
                MechanismGroup.from_dict(m) for fork in ledger.forks for m in fork["newer_releases"]
            ]
            report["epsilon_with_forks"] = compute_epsilon(both, report["delta"], ledger.accountant)
    if report["guarantee"] == "formal":
        return report
    return without_guarantee(report, method.figures_without_guarantee())


def without_guarantee(report: dict[str, Any], figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report of a run without a formal guarantee: no number labelled ε; what may be shown (the method's
    `figures`, each {"value", "what"}), labelled."""
    figures = dict(figures)
    epsilon = report.pop("epsilon", None)
    report.pop("training_epsilon", None)
    if epsilon is not None and math.isfinite(epsilon):  # only a test seed (this run's or an audit's) leaves one
        figures["accounting_with_a_secret_seed"] = {
            "value": epsilon,
            "what": f"What the {report['accountant']} accountant gives for these mechanisms at δ: it would bound "
            "the privacy loss had all the noise and sampling come from a secret key. Some came from a "
            "test seed (this run's or a composed audit's), which replays them, so it bounds nothing.",
        }
    if figures:
        report["not_a_guarantee"] = figures
    return report


def plan_lines(
    plan: PrivacyPlan,
    config: MethodConfig,
    unit: str,
    users: UserIndex | None,
    *,
    mechanism: str,
    noise_multiplier: float,
) -> list[str]:
    """The plan as the run announces it, at WARNING: the one line a DP user must read, then, when σ over the expected
    batch leaves the update mostly noise, what to change. `unit` is the privacy unit (`subject["unit"]`); at user
    level (`users`, the training set's) the plan also says what happens to the data."""
    units = f"{sampled_unit(config, unit)}s"  # what N and the batch count
    data = "" if users is None else " " + user_level_plan(config, users, plan.steps_per_epoch)
    if not plan.has_guarantee:
        return [
            f"Training plan WITHOUT a privacy guarantee ({mechanism}): N={plan.dataset_size:d} {units}, "
            f"q={plan.sample_rate:.5g}, {plan.planned_steps:d} steps. {plan.guarantee[1]}{data}"
        ]
    target, clip, batch = config.target_epsilon, describe_clip(config), plan.expected_batch_size
    if config.noise_seed is not None:  # calibrated as usual, but the known seed replays the noise
        calibrated = "" if target is None else f" (calibrated as for target {target:g})"
        lines = [
            f"Training plan in insecure test mode, WITHOUT a privacy guarantee ({mechanism}): N={plan.dataset_size:d} "
            f"{units}, q={plan.sample_rate:.5g}, {plan.planned_steps:d} steps, noise multiplier "
            f"σ={noise_multiplier:.4g}{calibrated}, clip norm {clip}. DPConfig.noise_seed replays the noise and "
            f"sampling: never publish this model as private.{data}"
        ]
    else:
        targeted = "" if target is None else f", target ε={target:g}"
        lines = [
            f"Private training plan ({mechanism}): N={plan.dataset_size:d} {units}, sampling rate "
            f"q={plan.sample_rate:.5g} (expected logical batch {batch:d} {units}), {plan.planned_steps:d} steps, "
            f"noise multiplier σ={noise_multiplier:.4g}, clip norm {clip}, δ={plan.delta:.3g}, "
            f"{plan.accountant} accountant{targeted}.{data}"
        ]
    noise_per_batch = noise_multiplier / batch
    if noise_per_batch > NOISY_UPDATE:
        lines.append(
            f"The model will be mostly noise: σ={noise_multiplier:.4g} over an expected batch of {batch:d} {units} "
            f"puts noise of {noise_per_batch:.3g}·C on every coordinate of each averaged update (learning usually "
            f"needs well under {NOISY_UPDATE:g}·C). Use a larger logical batch (per_device_train_batch_size × "
            "gradient_accumulation_steps), fewer epochs, more data, or a larger target ε."
        )
    return lines
