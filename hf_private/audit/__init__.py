"""Empirical privacy audit in one training run (Steinke, Nasr, Jagielski, NeurIPS 2023).

m canaries, each carrying a token of its own (a new vocabulary row nothing else uses), are each added to the
training set with probability ½. One private training run later, every canary is scored: white-box by how far
its own embedding row moved along the direction its gradient pointed at the start, black-box by how much its
loss fell. The k₊ highest scores are guessed "in" and
the k₋ lowest "out" (both counts fixed before training); if the run were (ε, δ)-DP, many correct guesses would
be unlikely, which gives an ε below which the claim is refuted at the stated confidence.

What it can and cannot show: the result is a *lower* bound. A bound above the claimed ε proves the
implementation (or its accounting) is broken; a bound below it proves nothing — last-iterate canary audits are
loose and catch gross bugs (missing noise, skipped clipping, a sensitivity off by the batch size), not a 20%
accounting error. The guarantee is the accountant's ε, never this number.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import math
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from scipy import stats
from torch import nn

from ..adapters import unwrap_peft
from ..logs import get_logger
from ..privacy import MechanismGroup, PrivacyLedger
from ..privacy.accountants import epsilon_bound, sampler_tail_delta

logger = get_logger(__name__)

WHITE_BOX = "white-box"
BLACK_BOX = "black-box"
_SCORE_HELP = {
    WHITE_BOX: "movement of the canary's own embedding row along its initial descent direction",
    BLACK_BOX: "decrease of the canary's loss from the initial to the trained model",
}
# Which data the audit trained on. Only the caller knows; "private" (the default) composes the audit run into the
# released model's guarantee, the other two are the caller's declaration that no training example was used.
AUDIT_DATA = {
    "private": "audit run on the training data, composed into the guarantee's ε",
    "public": "audit run on data declared public by the caller, not composed into ε",
    "disjoint": "audit run on data declared disjoint from the training data by the caller, not composed into ε",
}
AUDIT_MECHANISM_PREFIX = "audit:"
_EPSILON_CEILING = 1e3  # bisection stops here; no finite number of guesses supports more
_DESIGN_SEED = 2023  # public: the canaries' embedding rows and labels; only their inclusion is secret


# ---------------------------------------------------------------------- the bound
def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """p-value of "training is (ε, δ)-DP per canary" given `correct` right out of `guesses` non-abstaining guesses.

    Steinke et al. (2023), Theorem 5.2: P[V ≥ v] ≤ P[Bin(r, q) ≥ v] + 2mδ·max_{1≤i≤v} (1/i)·P[v > Bin(r, q) ≥ v−i]
    with q = e^ε / (1 + e^ε).
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"Need 0 ≤ correct ≤ guesses ≤ canaries, got {correct}, {guesses}, {canaries}.")
    if correct == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))
    p_value = float(stats.binom.sf(correct - 1, guesses, q))
    if delta > 0:
        below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q)  # P[Bin = v−1], P[Bin = v−2], ...
        worst = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
        p_value += 2 * canaries * delta * worst
    return min(1.0, p_value)


def one_run_epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """sup{ε : p(ε) < 1 − confidence}, by bisection; 0 when not even ε = 0 is rejected."""
    _check_confidence(confidence)
    beta = 1.0 - confidence

    def rejected(epsilon: float) -> bool:
        return one_run_p_value(canaries, guesses, correct, epsilon, delta) < beta

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high) and high < _EPSILON_CEILING:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def count_correct(scores: torch.Tensor, included: torch.Tensor, k_plus: int, k_minus: int) -> tuple[int, int]:
    """(guesses, correct): the k₊ highest scores are guessed "in", the k₋ lowest "out"; ties go by canary index."""
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > scores.numel():
        raise ValueError(f"Need k_plus, k_minus ≥ 0 and k_plus + k_minus ≤ {scores.numel()} canaries.")
    order = torch.argsort(scores.detach().cpu().double(), descending=True, stable=True)
    included = included.cpu().bool()
    correct = int(included[order[:k_plus]].sum()) + int((~included[order[scores.numel() - k_minus:]]).sum())
    return k_plus + k_minus, correct


def epsilon_from_error_rates(
    false_positives: int, negatives: int, false_negatives: int, positives: int, delta: float,
    confidence: float = 0.95,
) -> float:
    """ε lower bound from a threshold test's errors (Jagielski et al. 2020), Clopper–Pearson at `confidence`.

    (ε, δ)-DP forces FPR + e^ε·FNR ≥ 1 − δ and FNR + e^ε·FPR ≥ 1 − δ; both rates are replaced by their upper
    confidence bounds (each at half the miss probability), so the bound holds with the stated confidence.
    """
    _check_confidence(confidence)
    half = (1.0 - confidence) / 2
    fpr = _clopper_pearson_upper(false_positives, negatives, half)
    fnr = _clopper_pearson_upper(false_negatives, positives, half)
    candidates = [math.log((1 - delta - a) / b) for a, b in ((fpr, fnr), (fnr, fpr)) if 1 - delta - a > 0 < b]
    return max([0.0, *candidates])


def _clopper_pearson_upper(errors: int, trials: int, alpha: float) -> float:
    if trials <= 0:
        raise ValueError("Clopper–Pearson needs at least one trial.")
    return 1.0 if errors >= trials else float(stats.beta.ppf(1 - alpha, errors + 1, trials - errors))


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class ScoreBound:
    """The bound one scoring rule gives; with two rules each is held at half the miss probability."""

    score: str
    description: str
    guesses: int
    correct: int
    confidence: float
    epsilon_lower_bound: float


@dataclass(frozen=True)
class AuditResult:
    """ε_lb is the largest of the per-score bounds; each was computed at a confidence that makes the max valid.

    The audit run is itself a DP release of the data it trained on: `mechanisms` (its ledger, at its `delta` and
    `accountant`) are what `PrivateTrainer.attach_audit` composes into the released model's ε when `audit_data`
    is "private". `guarantee` is the audit run's own ("none" in insecure test mode). `claimed_epsilon` is the figure
    the audit tests: the run's ε, or, without a formal guarantee, the figure named `claim` from the report's
    `not_a_guarantee` (DP-FP paper mode: the paper's CLT approximation), never written as an ε.
    """

    epsilon_lower_bound: float
    confidence: float
    claimed_epsilon: float
    delta: float
    method: str
    canaries: int
    included: int
    k_plus: int
    k_minus: int
    bounds: tuple[ScoreBound, ...]
    date: str
    audit_data: str
    mechanisms: tuple[MechanismGroup, ...]
    accountant: str
    guarantee: str
    dataset_fingerprint: str | None
    claim: str = "epsilon"

    @property
    def refutes_claim(self) -> bool:
        """True when the audit proves the claimed ε wrong (at the stated confidence)."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    @property
    def declaration(self) -> str:
        return AUDIT_DATA[self.audit_data]

    def composed_mechanisms(self) -> list[MechanismGroup]:
        """What the audit adds to the training data's ledger: its run, renamed "audit:…"; nothing for declared data."""
        if self.audit_data != "private":
            return []
        return [replace(g, name=AUDIT_MECHANISM_PREFIX + g.name) for g in self.mechanisms]

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "bounds": [asdict(b) for b in self.bounds], "refutes_claim": self.refutes_claim,
             "declaration": self.declaration}
        del d["claimed_epsilon"], d["claim"]
        return {**d, **self._claim_entry(4)}

    def _claim_entry(self, digits: int) -> dict[str, Any]:
        """`claimed_epsilon` for a run with a guarantee; otherwise the figure tested, labelled as not being one."""
        value = round(self.claimed_epsilon, digits)
        if self.guarantee == "formal":
            return {"claimed_epsilon": value}
        return {"tested_figure": {"name": self.claim, "value": value,
                                  "note": "The audited run has no formal guarantee; this figure is tested as if it "
                                          "were one, and it is not a bound."}}

    def card_entry(self) -> dict[str, Any]:
        """The `privacy.audit` block of a model card; `PrivateTrainer.attach_audit` puts it there."""
        return {
            "kind": "empirical lower bound (not the guarantee)",
            "audit_data": self.audit_data,
            "declaration": self.declaration,
            "epsilon_lower_bound": round(self.epsilon_lower_bound, 4),
            "confidence": self.confidence,
            "canaries": self.canaries,
            "date": self.date,
            **self._claim_entry(4),
            "delta": self.delta,
            "method": self.method,
            "guesses": {"k_plus": self.k_plus, "k_minus": self.k_minus},
            "scores": {b.score: {"correct": b.correct, "guesses": b.guesses,
                                 "epsilon_lower_bound": round(b.epsilon_lower_bound, 4)} for b in self.bounds},
            "procedure": "one training run, Steinke, Nasr, Jagielski (NeurIPS 2023)",
        }


@functools.lru_cache(maxsize=16)
def _composed_bound(groups: tuple[tuple, ...], delta: float, accountant: str) -> tuple[float, str]:
    """Cached like the ledger's own ε: every card and report would otherwise recompute PRV (seconds each)."""
    return epsilon_bound([MechanismGroup(*group) for group in groups], delta, accountant)


def compose_audits(report: dict[str, Any], audits: Sequence[AuditResult], accountant: str) -> dict[str, Any]:
    """A privacy report whose ε also counts every audit run on the training data, at the report's one δ.

    Composed each time a report is made, never written into the training ledger: checkpoints must not record the
    audit as training spent, and repeated saves or a resume must not count it twice.
    """
    added = [group for audit in audits for group in audit.composed_mechanisms()]
    if not added or "epsilon" not in report:  # no guarantee to compose with (DP-FP paper mode): ε stays absent
        return report
    groups = [MechanismGroup.from_dict(m) for m in report["mechanisms"]] + added
    epsilon, used = _composed_bound(tuple(tuple(g.to_dict().values()) for g in groups), report["delta"], accountant)
    composed = {**report, "epsilon": epsilon, "accountant": used, "training_epsilon": report["epsilon"],
                "sampler_tail_delta": sampler_tail_delta(groups, report["delta"]),
                "mechanisms": [g.to_dict() for g in groups]}
    if report.get("guarantee") == "formal" and any(a.guarantee != "formal" for a in audits if a.composed_mechanisms()):
        composed.update(guarantee="none", guarantee_note=(
            "An audit run on the training data, composed into this ε, trained in insecure test mode (its "
            "DPConfig.noise_seed was set): its noise can be replayed by anyone who knows the seed."
        ))
    return composed


def _claimed_figure(report: dict[str, Any]) -> tuple[str, float]:
    """What the audit tests: ε, or without a guarantee the first figure of `not_a_guarantee` (the method's own claim,
    e.g. DP-FP's CLT approximation; in insecure test mode the accounting figure)."""
    if "epsilon" in report:
        return "epsilon", float(report["epsilon"])
    figures = report.get("not_a_guarantee") or {}
    if not figures:
        raise ValueError(f"The audited run has no guarantee and no figure to test: {report.get('guarantee_note')}")
    name, figure = next(iter(figures.items()))
    return name, float(figure["value"])


# ---------------------------------------------------------------------- canaries
def add_canary_tokens(model: nn.Module, count: int, generator: torch.Generator) -> list[int]:
    """Append `count` fresh vocabulary rows (ids nothing in the data uses) and return their ids."""
    base = unwrap_peft(model)
    embeddings = base.get_input_embeddings()
    if not isinstance(embeddings, nn.Embedding):
        raise ValueError(f"The audit needs an nn.Embedding input layer, got {type(embeddings).__name__}.")
    old = embeddings.num_embeddings
    base.resize_token_embeddings(old + count, mean_resizing=False)
    weight = base.get_input_embeddings().weight
    with torch.no_grad():
        scale = weight[:old].float().std().item()
        rows = torch.randn(count, weight.shape[1], generator=generator) * scale
        weight[old:] = rows.to(weight.dtype)
    return list(range(old, old + count))


def build_canaries(template: dict[str, Any], token_ids: Sequence[int], length: int, num_labels: int,
                   rng: random.Random) -> dict[str, list]:
    """Columns for one canary per token: the token repeated `length` times, a random (public) label."""
    columns: dict[str, list] = {name: [] for name in template}
    for token in token_ids:
        ids = [token] * length
        for name, value in template.items():
            if name == "input_ids":
                columns[name].append(ids)
            elif name == "attention_mask":
                columns[name].append([1] * length)
            elif name == "token_type_ids":
                columns[name].append([0] * length)
            elif name in ("label", "labels") and isinstance(value, int | np.integer):
                columns[name].append(rng.randrange(num_labels))
            elif name == "labels" and isinstance(value, list):
                columns[name].append(list(ids))  # language modelling: the canary predicts itself
            else:
                raise ValueError(
                    f"Cannot build a canary for dataset column {name!r}: the audit knows input_ids, attention_mask, "
                    "token_type_ids and an integer label(s) column (or LM labels). Drop other columns first."
                )
    if "input_ids" not in columns:
        raise ValueError("The audit needs a tokenized dataset with an input_ids column.")
    return columns


# ---------------------------------------------------------------------- scores
def _batches(trainer, rows: list[dict[str, Any]], batch_size: int = 64):
    for start in range(0, len(rows), batch_size):
        batch = trainer.data_collator(rows[start:start + batch_size])
        batch = {k: v.to(trainer.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        labels = batch.pop("labels")
        batch.pop("label", None)
        yield batch, labels


def _in_eval_mode(function):
    def wrapper(trainer, *args, **kwargs):
        was_training = trainer.model.training
        trainer.model.eval()
        try:
            return function(trainer, *args, **kwargs)
        finally:
            trainer.model.train(was_training)

    return wrapper


@_in_eval_mode
@torch.no_grad()
def canary_losses(trainer, rows: list[dict[str, Any]]) -> torch.Tensor:
    """Per-canary loss under the trainer's own collator and per-example loss (the black-box view)."""
    model = trainer.model
    return torch.cat([trainer.per_example_loss(model, model(**batch), labels).float().cpu()
                      for batch, labels in _batches(trainer, rows)])


@_in_eval_mode
def canary_descent_directions(trainer, rows: list[dict[str, Any]], token_ids: Sequence[int]) -> torch.Tensor:
    """−∇ of each canary's loss w.r.t. its own embedding row at the initial (public) weights, unit length.

    Only canary i uses token i, so one gradient of the summed loss holds every canary's own row gradient. The
    white-box score projects the row's movement on this direction: with the noise spread over d coordinates,
    a projection keeps the signal and 1/d of the noise variance.
    """
    model = trainer.model
    weight = unwrap_peft(model).get_input_embeddings().weight
    total = torch.zeros_like(weight, dtype=torch.float32)
    for batch, labels in _batches(trainer, rows):
        loss = trainer.per_example_loss(model, model(**batch), labels).sum()
        total += torch.autograd.grad(loss, weight)[0].float()
    directions = -total[list(token_ids)].cpu()
    return directions / directions.norm(dim=1, keepdim=True).clamp(min=1e-30)


def _canary_rows(model: nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    return unwrap_peft(model).get_input_embeddings().weight.detach()[list(token_ids)].float().cpu().clone()


# ---------------------------------------------------------------------- the audit
def run_audit(
    model_factory: Callable[[], nn.Module],
    train_dataset,
    dp_config,
    args,
    *,
    canaries: int = 1000,
    k_plus: int | None = None,
    k_minus: int = 0,
    confidence: float = 0.95,
    canary_length: int = 8,
    seed: int | None = None,
    scores: Sequence[str] = (WHITE_BOX, BLACK_BOX),
    audit_data: str = "private",
    **trainer_kwargs: Any,
) -> AuditResult:
    """Insert canaries, train once with `PrivateTrainer`, and bound ε from below.

    `model_factory()` builds the model to fine-tune (its vocabulary gets `canaries` new rows); `train_dataset` is a
    tokenized `datasets.Dataset`; `dp_config` and `args` are what the real run would use; `trainer_kwargs`
    (`data_collator`, `processing_class`, `per_example_loss`, ...) go to `PrivateTrainer`. `k_plus` defaults to
    a fifth of the canaries. `seed` fixes which canaries are included (the auditor's secret, independent of the
    training noise and of the canaries' design); None draws it from the OS. The white-box score needs a trainable
    input embedding and is skipped otherwise (DP-BiTFiT, LoRA); with two scores each is held at half the miss
    probability, so the larger bound keeps the stated confidence.

    `audit_data` says whose data `train_dataset` is. "private" (the default): the released model's training data,
    so the audit run is a second release of it and `PrivateTrainer.attach_audit` composes it into that model's ε.
    "public" or "disjoint": the caller declares that no example of the released model's training data is in
    `train_dataset`; ε is left unchanged and the card carries the declaration.
    """
    from ..trainer import PrivateTrainer

    if audit_data not in AUDIT_DATA:
        raise ValueError(f"audit_data must be one of {', '.join(map(repr, AUDIT_DATA))}, got {audit_data!r}.")
    _check_confidence(confidence)
    if not scores or set(scores) - {WHITE_BOX, BLACK_BOX}:
        raise ValueError(f"scores must be a non-empty subset of {(WHITE_BOX, BLACK_BOX)}, got {tuple(scores)}.")
    if canaries < 2:
        raise ValueError(f"The audit needs at least 2 canaries, got {canaries}.")
    k_plus = canaries // 5 if k_plus is None else k_plus
    if k_plus < 0 or k_minus < 0 or not 0 < k_plus + k_minus <= canaries:
        raise ValueError(f"Need 0 < k_plus + k_minus ≤ canaries, got k_plus={k_plus}, k_minus={k_minus}.")
    if len(train_dataset) == 0:
        raise ValueError("train_dataset is empty.")

    seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
    included = torch.rand(canaries, generator=torch.Generator().manual_seed(seed)) < 0.5
    model = model_factory()
    # The canaries themselves (rows, labels) come from a fixed public seed, so nothing about them depends on S.
    token_ids = add_canary_tokens(model, canaries, torch.Generator().manual_seed(_DESIGN_SEED))
    config = getattr(unwrap_peft(model), "config", None)
    canary_set = _canary_dataset(train_dataset, token_ids, canary_length, int(getattr(config, "num_labels", 2) or 2),
                                 random.Random(_DESIGN_SEED))
    data = _with_canaries(train_dataset, canary_set, included)
    logger.info("Audit: %d canaries, %d included, N=%d; guesses fixed in advance: k+=%d, k-=%d.",
                canaries, int(included.sum()), len(data), k_plus, k_minus)

    trainer = PrivateTrainer(model=model, args=args, train_dataset=data, dp_config=dp_config, **trainer_kwargs)
    rows = [canary_set[i] for i in range(canaries)]
    embedding = unwrap_peft(trainer.model).get_input_embeddings().weight
    active = [s for s in dict.fromkeys(scores) if s != WHITE_BOX or embedding.requires_grad]
    if WHITE_BOX in scores and WHITE_BOX not in active:
        logger.info("White-box score skipped: %s does not train the input embedding.", dp_config.method)
    if WHITE_BOX in active:
        start_rows = _canary_rows(trainer.model, token_ids)
        directions = canary_descent_directions(trainer, rows, token_ids)
    start_losses = canary_losses(trainer, rows) if BLACK_BOX in active else None

    trainer.train()

    per_score_confidence = 1 - (1 - confidence) / len(active)
    bounds = []
    for score in active:
        if score == WHITE_BOX:
            values = ((_canary_rows(trainer.model, token_ids) - start_rows) * directions).sum(dim=1)
        else:
            values = start_losses - canary_losses(trainer, rows)
        guesses, correct = count_correct(values, included, k_plus, k_minus)
        bound = one_run_epsilon_lower_bound(canaries, guesses, correct, trainer.delta, per_score_confidence)
        bounds.append(ScoreBound(score, _SCORE_HELP[score], guesses, correct, per_score_confidence, bound))
        logger.info("Audit %s score: %d of %d guesses correct → ε_lb = %.3f.", score, correct, guesses, bound)
    report = trainer.privacy_report()
    claim, claimed = _claimed_figure(report)
    return AuditResult(
        epsilon_lower_bound=max(b.epsilon_lower_bound for b in bounds),
        confidence=confidence,
        claimed_epsilon=claimed,
        claim=claim,
        delta=float(trainer.delta),
        method=dp_config.method,
        canaries=canaries,
        included=int(included.sum()),
        k_plus=k_plus,
        k_minus=k_minus,
        bounds=tuple(bounds),
        date=datetime.date.today().isoformat(),
        audit_data=audit_data,
        mechanisms=tuple(trainer.ledger.mechanisms),
        accountant=trainer.ledger.accountant,
        guarantee=report["guarantee"],
        dataset_fingerprint=getattr(train_dataset, "_fingerprint", None),
    )


def _canary_dataset(train_dataset, token_ids: Sequence[int], length: int, num_labels: int, rng: random.Random):
    from datasets import Dataset

    columns = build_canaries(train_dataset[0], token_ids, length, num_labels, rng)
    return Dataset.from_dict(columns, features=train_dataset.features)


def _with_canaries(train_dataset, canary_set, included: torch.Tensor):
    from datasets import concatenate_datasets

    chosen = torch.nonzero(included).flatten().tolist()
    return concatenate_datasets([train_dataset, canary_set.select(chosen)]) if chosen else train_dataset


# ---------------------------------------------------------------------- command line
_CANARY_LENGTH = 8


def demo_task(size: int, seed: int = 0):
    """A tiny BERT built from config and the generated sentiment task of `hf_private.demo` (tokenized with
    `hf_private.demo.demo_tokenizer`): the offline default of the CLI."""
    from ..demo import demo_model, sentiment_dataset

    def factory():
        return demo_model(hidden_size=32, num_attention_heads=2, intermediate_size=64)

    return factory, sentiment_dataset(size, seed)


def _parser() -> argparse.ArgumentParser:
    from ..methods import registered_methods

    parser = argparse.ArgumentParser(
        prog="hf-private-audit",
        description="One-run canary audit of hf_private's DP training: an empirical LOWER bound on ε. A bound above "
        "the claimed ε proves a bug; a bound below it proves nothing. Without --model_name_or_path it audits a "
        "tiny BERT on a generated task (offline, under a CPU-minute on a 2-core machine).",
    )
    add = parser.add_argument
    add("--model_name_or_path", help="Hub id or local path of a sequence-classification model (needs --train_file).")
    add("--train_file", help="Local csv/tsv/json training data with a text and a label column.")
    add("--text_column", default="sentence")
    add("--label_column", default="label")
    add("--max_seq_length", type=int, default=128)
    add("--demo_size", type=int, default=2000, help="Examples in the generated demo task.")
    add("--method", choices=registered_methods(), default="dp-sgd")
    add("--epsilon", type=float, default=2.0, help="Claimed (target) ε of the audited run.")
    add("--delta", type=float, default=1e-5, help="Claimed δ; the bound weakens as canaries·δ grows.")
    add("--clip_norm", type=float, default=1.0)
    add("--accountant", choices=("prv", "rdp"), default="prv")
    add("--epochs", type=float, default=3.0)
    add("--batch_size", type=int, default=64, help="Expected logical batch size.")
    add("--learning_rate", type=float, default=0.5)
    add("--optim", default="sgd", help="TrainingArguments.optim.")
    add("--canaries", type=int, default=1000)
    add("--k_plus", type=int, default=None, help="Top scores guessed 'in' (default: canaries // 5).")
    add("--k_minus", type=int, default=0, help="Bottom scores guessed 'out'.")
    add("--confidence", type=float, default=0.95)
    add("--canary_length", type=int, default=_CANARY_LENGTH)
    add("--seed", type=int, default=None, help="Seed of the canary inclusion draw (default: from the OS).")
    add("--audit_data", choices=tuple(AUDIT_DATA), default="private",
        help="Whose data --train_file is. 'private' (default): a released model's training data, so this run is "
        "composed into that model's ε. 'public'/'disjoint': you declare it shares no example with that data.")
    add("--ledger", default=None, help="privacy_ledger.json of the model released from the same data: prints its ε "
        "composed with this audit run.")
    add("--output_dir", default=None, help="Trainer output directory (default: a temporary one).")
    add("--output", default=None, help="Write the result as JSON here (it is always printed).")
    return parser


def _task_from_files(options):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from ..data_files import DataFileError, read_data_file

    if not (options.model_name_or_path and options.train_file):
        raise SystemExit("Give both --model_name_or_path and --train_file, or neither (the offline demo).")
    try:
        raw = read_data_file(options.train_file)
    except DataFileError as error:
        raise SystemExit(f"--train_file: {error}") from error
    tokenizer = AutoTokenizer.from_pretrained(options.model_name_or_path)
    data = raw.map(lambda b: tokenizer(b[options.text_column], truncation=True, max_length=options.max_seq_length),
                   batched=True, remove_columns=[c for c in raw.column_names if c != options.label_column])
    if options.label_column != "label":
        data = data.rename_column(options.label_column, "label")
    num_labels = len(set(data["label"]))

    def factory():
        return AutoModelForSequenceClassification.from_pretrained(options.model_name_or_path, num_labels=num_labels)

    return factory, data, {"data_collator": DataCollatorWithPadding(tokenizer), "processing_class": tokenizer}


def main(argv: Sequence[str] | None = None) -> int:
    """`hf-private-audit` / `python -m hf_private.audit`; exit status 1 when the audit refutes the claimed ε."""
    import tempfile

    from transformers import DataCollatorWithPadding, TrainingArguments

    from ..demo import demo_tokenizer
    from ..methods import method_class

    options = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    if options.model_name_or_path or options.train_file:
        factory, data, trainer_kwargs = _task_from_files(options)
    else:
        logger.info("No --model_name_or_path: auditing a tiny BERT on a generated task of %d examples.",
                    options.demo_size)
        factory, data = demo_task(options.demo_size)
        tokenizer = demo_tokenizer()
        trainer_kwargs = {"data_collator": DataCollatorWithPadding(tokenizer), "processing_class": tokenizer}
    config_cls = method_class(options.method).config_class
    dp_config = config_cls(target_epsilon=options.epsilon, target_delta=options.delta,
                           max_grad_norm=options.clip_norm, accountant=options.accountant)
    with tempfile.TemporaryDirectory(prefix="hf-private-audit-") as scratch:
        args = TrainingArguments(
            output_dir=options.output_dir or scratch, per_device_train_batch_size=options.batch_size,
            num_train_epochs=options.epochs, learning_rate=options.learning_rate, optim=options.optim,
            weight_decay=0.0, save_strategy="no", report_to="none", use_cpu=True, logging_steps=50,
            disable_tqdm=True,
        )
        result = run_audit(factory, data, dp_config, args, canaries=options.canaries, k_plus=options.k_plus,
                           k_minus=options.k_minus, confidence=options.confidence,
                           canary_length=options.canary_length, seed=options.seed, audit_data=options.audit_data,
                           **trainer_kwargs)
    payload = result.to_dict()
    sys.stdout.write(f"This is an {result.declaration}.\n")
    if options.ledger:
        ledger = PrivacyLedger.load(options.ledger)
        composed = compose_audits(ledger.report(), [result], ledger.accountant)
        payload["composed"] = {key: composed.get(key) for key in ("epsilon", "delta", "accountant", "training_epsilon")}
        sys.stdout.write(f"Composed guarantee of the released model: ε = {composed['epsilon']:.4g} at δ = "
                         f"{composed['delta']:.3g} (its training ledger alone: ε = {ledger.epsilon():.4g}).\n")
    elif result.audit_data == "private" and result.guarantee == "formal":
        sys.stdout.write(f"This audit run spent ε = {result.claimed_epsilon:.4g} (δ = {result.delta:.3g}) on its data: "
                         "a model released from the same data must count it. Pass --ledger with that model's "
                         "privacy_ledger.json to print the composed ε, or PrivateTrainer.attach_audit(result).\n")
    text = json.dumps(payload, indent=2)
    if options.output:
        with open(options.output, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    verdict = "REFUTES" if result.refutes_claim else "does not refute"
    logger.info("ε_lb = %.3f at %.0f%% confidence %s the %s = %.3f (an empirical lower bound, not the guarantee).",
                result.epsilon_lower_bound, 100 * result.confidence, verdict,
                "claimed ε" if result.claim == "epsilon" else f"tested figure {result.claim}", result.claimed_epsilon)
    return 1 if result.refutes_claim else 0
