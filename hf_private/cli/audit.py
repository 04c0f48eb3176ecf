"""The audit end to end: insert canaries, train once with `PrivateTrainer`, bound ε; and the `hf-private-audit` command.

This is the only part of the audit that drives a trainer, so it is the only one that imports it: the library beside
it (bounds, result, canaries, scores) is what the trainer itself imports, and importing it must not start the trainer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..audit.bounds import (
    check_confidence,
    count_correct,
    gdp_epsilon,
    one_run_epsilon_lower_bound,
    one_run_mu_lower_bound,
)
from ..audit.canaries import DESIGN_SEED, add_canary_tokens, canary_dataset, with_canaries
from ..audit.gradient_canaries import GradientCanaryInserter, draw_gradient_canaries
from ..audit.result import AUDIT_DATA, AuditCeiling, AuditResult, ScoreBound, claimed_figure, compose_audits
from ..audit.scores import (
    BLACK_BOX,
    SCORE_HELP,
    WHITE_BOX,
    WHITE_BOX_GRADIENT,
    canary_descent_directions,
    canary_losses,
    canary_rows,
)
from ..logs import get_logger
from ..models.head_choice import HEADS
from ..models.peft import auxiliary_parameter_names, unwrap_peft
from ..privacy import PrivacyLedger
from ..privacy.accountants import registered_accountants
from ..privacy.band_mf import BAND_MF_MECHANISM, DP_SGD
from ..trainer import PrivateTrainer

logger = get_logger(__name__)


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
    trainer_class: type | None = None,
    **trainer_kwargs: Any,
) -> AuditResult:
    """Insert canaries, train once with `PrivateTrainer`, and bound ε from below.

    `model_factory()` builds the model to fine-tune (its vocabulary gets `canaries` new rows); `train_dataset` is a
    tokenized `datasets.Dataset`; `dp_config` and `args` are what the real run would use; `trainer_kwargs`
    (`data_collator`, `processing_class`, `per_example_loss`, ...) go to `trainer_class` (default `PrivateTrainer`;
    a `privatize()`d class such as `privatize(SFTTrainer)`, with its own `args`, audits that trainer). A causal LM's
    canary is a sequence of its new token, which predicts itself. `k_plus` defaults to
    a fifth of the canaries. `seed` fixes which canaries are included and the gradient canaries' coordinates (the
    auditor's secret, independent of the training noise and of the canaries' design); None draws it from the OS.

    `scores`: "white-box" reads the token canaries' embedding rows where the input embedding trains; where it does
    not (LoRA, BiTFiT, sparse low-rank, DP-FP's head) it becomes "white-box-gradient": a second set of `canaries`
    gradient canaries (`gradient_canaries`), each scored on its own inclusion. "black-box" reads the token canaries'
    losses. Each score is held at its share of the miss probability, so the largest bound keeps the stated
    confidence.

    `audit_data` says whose data `train_dataset` is. "private" (the default): the released model's training data,
    so the audit run is a second release of it and `PrivateTrainer.attach_audit` composes it into that model's ε.
    "public" or "disjoint": the caller declares that no example of the released model's training data is in
    `train_dataset`; ε is left unchanged and the card carries the declaration.
    """
    if audit_data not in AUDIT_DATA:
        raise ValueError(f"audit_data must be one of {', '.join(map(repr, AUDIT_DATA))}, got {audit_data!r}.")
    mechanism = getattr(dp_config, "noise_mechanism", DP_SGD)
    if mechanism not in AUDITED_NOISE:
        raise ValueError(
            f"The one-run audit is not supported with noise_mechanism={mechanism!r}: its white-box score whitens "
            f"the correlated noise of {', '.join(map(repr, AUDITED_NOISE))} only. Audit the same model and data with "
            f"noise_mechanism={DP_SGD!r}, or skip the audit."
        )
    check_confidence(confidence)
    if not scores or set(scores) - set(SCORE_HELP):
        raise ValueError(f"scores must be a non-empty subset of {tuple(SCORE_HELP)}, got {tuple(scores)}.")
    if canaries < 2:
        raise ValueError(f"The audit needs at least 2 canaries, got {canaries}.")
    k_plus = canaries // 5 if k_plus is None else k_plus
    if k_plus < 0 or k_minus < 0 or not 0 < k_plus + k_minus <= canaries:
        raise ValueError(f"Need 0 < k_plus + k_minus ≤ canaries, got k_plus={k_plus}, k_minus={k_minus}.")
    if len(train_dataset) == 0:
        raise ValueError("train_dataset is empty.")

    secret = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    included = {
        TOKEN_CANARIES: torch.rand(canaries, generator=secret) < 0.5,
        GRADIENT_CANARIES: torch.rand(canaries, generator=secret) < 0.5,
    }
    active = list(dict.fromkeys(scores))
    setup = _AuditSetup(
        model_factory,
        train_dataset,
        dp_config,
        args,
        canaries,
        canary_length,
        included,
        trainer_class or PrivateTrainer,
        trainer_kwargs,
    )
    if WHITE_BOX in active and mechanism != DP_SGD:  # the embedding rows' final movement cannot be whitened
        logger.info(
            "%s noise is correlated: the white-box score uses gradient canaries, whitened step by step.", mechanism
        )
        active = list(dict.fromkeys(WHITE_BOX_GRADIENT if s == WHITE_BOX else s for s in active))
    trainer = setup.trainer(_canary_sets(active))
    if WHITE_BOX in active and not _trains_input_embedding(trainer):
        coordinates = sum(p.numel() for _, p in _always_trained(trainer))
        if coordinates >= canaries:
            logger.info(
                "%s does not train the input embedding: the white-box score uses gradient canaries.", dp_config.method
            )
            active = list(dict.fromkeys(WHITE_BOX_GRADIENT if s == WHITE_BOX else s for s in active))
        else:
            logger.warning(
                "White-box score skipped: %s does not train the input embedding, and its %d trainable "
                "coordinates cannot give %d gradient canaries a coordinate each (audit with canaries=%d "
                "or fewer for one).",
                dp_config.method,
                coordinates,
                canaries,
                coordinates,
            )
            active.remove(WHITE_BOX)
        if not active:
            raise ValueError("No score is left to audit with: ask for the black-box score too, or fewer canaries.")
        if _canary_sets(active) != setup.kinds:
            trainer = setup.trainer(_canary_sets(active))
    if WHITE_BOX_GRADIENT in active:
        gradient = draw_gradient_canaries(
            _always_trained(trainer), canaries, setup.token_ids[GRADIENT_CANARIES][0], secret
        )
        inserter = GradientCanaryInserter(trainer.model, gradient, lambda: trainer.privacy_run.max_grad_norm)
        trainer.privacy_run.add_instrument(inserter)
    token_ids, rows = setup.token_ids.get(TOKEN_CANARIES, []), setup.rows.get(TOKEN_CANARIES, [])
    if WHITE_BOX in active:
        start_rows = canary_rows(trainer.model, token_ids)
        directions = canary_descent_directions(trainer, rows, token_ids)
    start_losses = canary_losses(trainer, rows) if BLACK_BOX in active else None

    trainer.train()

    per_score_confidence = 1 - (1 - confidence) / len(active)
    bounds = []
    for score in active:
        if score == WHITE_BOX:
            values = ((canary_rows(trainer.model, token_ids) - start_rows) * directions).sum(dim=1)
        elif score == WHITE_BOX_GRADIENT:
            values = inserter.scores()
        else:
            values = start_losses - canary_losses(trainer, rows)
        score_included = included[GRADIENT_CANARIES if score == WHITE_BOX_GRADIENT else TOKEN_CANARIES]
        guesses, correct = count_correct(values, score_included, k_plus, k_minus)
        bound = one_run_epsilon_lower_bound(canaries, guesses, correct, trainer.delta, per_score_confidence)
        mu = one_run_mu_lower_bound(canaries, guesses, correct, trainer.delta, per_score_confidence)
        bounds.append(
            ScoreBound(
                score,
                SCORE_HELP[score],
                guesses,
                correct,
                per_score_confidence,
                bound,
                mu,
                gdp_epsilon(mu, trainer.delta),
                int(score_included.sum()),
            )
        )
        logger.info(
            "Audit %s score: %d of %d guesses correct → ε_lb = %.3f; μ-GDP: μ_lb = %.3f (ε %.3f at δ).",
            score,
            correct,
            guesses,
            bound,
            mu,
            bounds[-1].gdp_epsilon_lower_bound,
        )
    ceiling_mu = one_run_mu_lower_bound(
        canaries, k_plus + k_minus, k_plus + k_minus, trainer.delta, per_score_confidence
    )
    ceiling = AuditCeiling(
        epsilon=one_run_epsilon_lower_bound(
            canaries, k_plus + k_minus, k_plus + k_minus, trainer.delta, per_score_confidence
        ),
        mu=ceiling_mu,
        gdp_epsilon=gdp_epsilon(ceiling_mu, trainer.delta),
    )
    logger.info(
        "Audit ceiling with %d canaries and %d guesses: ε %.2f, μ %.2f (ε %.2f at δ).",
        canaries,
        k_plus + k_minus,
        ceiling.epsilon,
        ceiling.mu,
        ceiling.gdp_epsilon,
    )
    report = trainer.privacy_report()
    claim, claimed = claimed_figure(report)
    return AuditResult(
        epsilon_lower_bound=max(b.epsilon_lower_bound for b in bounds),
        confidence=confidence,
        claimed_epsilon=claimed,
        claim=claim,
        delta=float(trainer.delta),
        method=dp_config.method,
        canaries=canaries,
        included=sum(int(included[kind].sum()) for kind in _canary_sets(active)),
        k_plus=k_plus,
        k_minus=k_minus,
        bounds=tuple(bounds),
        date=datetime.date.today().isoformat(),
        audit_data=audit_data,
        mechanisms=tuple(trainer.ledger.mechanisms),
        accountant=trainer.ledger.accountant,
        guarantee=report["guarantee"],
        dataset_fingerprint=getattr(train_dataset, "_fingerprint", None),
        ceiling=ceiling,
        canary_sets=tuple(_canary_sets(active)),
    )


TOKEN_CANARIES, GRADIENT_CANARIES = "token", "gradient"
#: The noise mechanisms the audit's scores read soundly: DP-SGD's independent noise, BandMF's whitened by its strategy
#: (`GradientCanaryInserter.per_step`). Any other (a banded-inverse factorization) is refused by name until handled.
AUDITED_NOISE = (DP_SGD, BAND_MF_MECHANISM)


def _always_trained(trainer) -> list[tuple[str, nn.Parameter]]:
    """The engine's tensors the method trains from the first step on: those it names as trained before any step
    (`DPMethod.trained_parameter_names`) and the auxiliary ones trained in their place (RGP's carriers). Every
    trainable one for most methods; DP-FROST's head alone, as its selected partitions change from one selection to
    the next."""
    names = trainer.dp_method.trained_parameter_names(trainer.model) | auxiliary_parameter_names(trainer.model)
    return [(name, p) for name, p in trainer.privacy_run.engine.parameters if name in names]


def _trains_input_embedding(trainer) -> bool:
    embedding = unwrap_peft(trainer.model).get_input_embeddings().weight
    return any(p is embedding for _, p in _always_trained(trainer))


def _canary_sets(scores: Sequence[str]) -> list[str]:
    """The canary sets these scores read: token canaries (the embedding row, the loss), gradient canaries."""
    return [
        kind
        for kind, wanted in ((TOKEN_CANARIES, {WHITE_BOX, BLACK_BOX}), (GRADIENT_CANARIES, {WHITE_BOX_GRADIENT}))
        if wanted & set(scores)
    ]


@dataclass
class _AuditSetup:
    """Builds the audited trainer on the training set plus the included canaries of the sets it needs."""

    model_factory: Callable[[], nn.Module]
    train_dataset: Any
    dp_config: Any
    args: Any
    canaries: int
    canary_length: int
    included: dict[str, torch.Tensor]
    trainer_class: type
    trainer_kwargs: dict[str, Any]
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=list)  # the canary sets of the trainer built last

    def trainer(self, kinds: list[str]):
        """A fresh model with `canaries` new tokens per set (their rows from the public design seed), each set's
        canaries built alike (at user level each a new user) and its included ones appended to the training set."""
        model = self.model_factory()
        ids = add_canary_tokens(model, self.canaries * len(kinds), torch.Generator().manual_seed(DESIGN_SEED))
        config = getattr(unwrap_peft(model), "config", None)
        user_column = self.dp_config.user_column if self.dp_config.privacy_unit == "user" else None
        canary_set = canary_dataset(
            self.train_dataset,
            ids,
            self.canary_length,
            int(getattr(config, "num_labels", 2) or 2),
            random.Random(DESIGN_SEED),
            user_column,
        )
        m = self.canaries
        self.kinds = kinds
        self.token_ids = {kind: ids[i * m : (i + 1) * m] for i, kind in enumerate(kinds)}
        # the token canaries' rows, which their scores read; gradient canaries are scored from the released gradients
        self.rows = {
            kind: [canary_set[i * m + j] for j in range(m)] for i, kind in enumerate(kinds) if kind == TOKEN_CANARIES
        }
        chosen = torch.cat([self.included[kind] for kind in kinds])
        data = with_canaries(self.train_dataset, canary_set, chosen)
        logger.info(
            "Audit: %s canaries (%d each), %d included, N=%d.", " and ".join(kinds), m, int(chosen.sum()), len(data)
        )
        return self.trainer_class(
            model=model, args=self.args, train_dataset=data, dp_config=self.dp_config, **self.trainer_kwargs
        )


# ---------------------------------------------------------------------- command line
_CANARY_LENGTH = 8


def demo_task(size: int, seed: int = 0):
    """A tiny BERT built from config and the generated sentiment task of `hf_private.demos.sentiment` (tokenized with
    `hf_private.demos.sentiment.demo_tokenizer`): the offline default of the CLI."""
    from ..demos.sentiment import demo_model, sentiment_dataset

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
    add(
        "--head",
        choices=HEADS,
        default="auto",
        help="Classification head on --model_name_or_path: 'auto' reads the "
        "checkpoint's sentence-transformers pooling (the mean-pooled head for one that pools by mean), 'cls' or "
        "'mean' choose one (hf_private.sentence_classifier).",
    )
    add("--train_file", help="Local csv/tsv/json training data with a text and a label column.")
    add("--text_column", default="sentence")
    add("--label_column", default="label")
    add("--max_seq_length", type=int, default=128)
    add("--demo_size", type=int, default=2000, help="Examples in the generated demo task.")
    add("--method", choices=registered_methods(), default="dp-sgd")
    add("--epsilon", type=float, default=2.0, help="Claimed (target) ε of the audited run.")
    add("--delta", type=float, default=1e-5, help="Claimed δ; the bound weakens as canaries·δ grows.")
    add("--clip_norm", type=float, default=1.0)
    add("--accountant", choices=registered_accountants(), default="prv")
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
    add(
        "--audit_data",
        choices=tuple(AUDIT_DATA),
        default="private",
        help="Whose data --train_file is. 'private' (default): a released model's training data, so this run is "
        "composed into that model's ε. 'public'/'disjoint': you declare it shares no example with that data.",
    )
    add(
        "--ledger",
        default=None,
        help="privacy_ledger.json of the model released from the same data: prints its ε composed with this audit run.",
    )
    add("--output_dir", default=None, help="Trainer output directory (default: a temporary one).")
    add("--output", default=None, help="Write the result as JSON here (it is always printed).")
    return parser


def _task_from_files(options):
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from ..data.files import DataFileError, read_data_file
    from ..models.head_choice import sentence_classifier

    if not (options.model_name_or_path and options.train_file):
        raise SystemExit("Give both --model_name_or_path and --train_file, or neither (the offline demo).")
    try:
        raw = read_data_file(options.train_file)
    except DataFileError as error:
        raise SystemExit(f"--train_file: {error}") from error
    tokenizer = AutoTokenizer.from_pretrained(options.model_name_or_path)
    data = raw.map(
        lambda b: tokenizer(b[options.text_column], truncation=True, max_length=options.max_seq_length),
        batched=True,
        remove_columns=[c for c in raw.column_names if c != options.label_column],
    )
    if options.label_column != "label":
        data = data.rename_column(options.label_column, "label")
    num_labels = len(set(data["label"]))

    def factory():
        return sentence_classifier(options.model_name_or_path, num_labels=num_labels, head=options.head)

    return factory, data, {"data_collator": DataCollatorWithPadding(tokenizer), "processing_class": tokenizer}


def main(argv: Sequence[str] | None = None) -> int:
    """`hf-private-audit` / `python -m hf_private.audit`; exit status 1 when the audit refutes the claimed ε."""
    import tempfile

    from transformers import DataCollatorWithPadding, TrainingArguments

    from ..demos.sentiment import demo_tokenizer
    from ..methods import method_class

    options = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    if options.model_name_or_path or options.train_file:
        factory, data, trainer_kwargs = _task_from_files(options)
    else:
        logger.info(
            "No --model_name_or_path: auditing a tiny BERT on a generated task of %d examples.", options.demo_size
        )
        factory, data = demo_task(options.demo_size)
        tokenizer = demo_tokenizer()
        trainer_kwargs = {"data_collator": DataCollatorWithPadding(tokenizer), "processing_class": tokenizer}
    config_cls = method_class(options.method).config_class
    dp_config = config_cls(
        target_epsilon=options.epsilon,
        target_delta=options.delta,
        max_grad_norm=options.clip_norm,
        accountant=options.accountant,
    )
    with tempfile.TemporaryDirectory(prefix="hf-private-audit-") as scratch:
        args = TrainingArguments(
            output_dir=options.output_dir or scratch,
            per_device_train_batch_size=options.batch_size,
            num_train_epochs=options.epochs,
            learning_rate=options.learning_rate,
            optim=options.optim,
            weight_decay=0.0,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            logging_steps=50,
            disable_tqdm=True,
        )
        result = run_audit(
            factory,
            data,
            dp_config,
            args,
            canaries=options.canaries,
            k_plus=options.k_plus,
            k_minus=options.k_minus,
            confidence=options.confidence,
            canary_length=options.canary_length,
            seed=options.seed,
            audit_data=options.audit_data,
            **trainer_kwargs,
        )
    payload = result.to_dict()
    sys.stdout.write(f"This is an {result.declaration}.\n")
    if options.ledger:
        ledger = PrivacyLedger.load(options.ledger)
        composed = compose_audits(ledger.report(), [result], ledger.accountant)
        payload["composed"] = {key: composed.get(key) for key in ("epsilon", "delta", "accountant", "training_epsilon")}
        sys.stdout.write(
            f"Composed guarantee of the released model: ε = {composed['epsilon']:.4g} at δ = "
            f"{composed['delta']:.3g} (its training ledger alone: ε = {ledger.epsilon():.4g}).\n"
        )
    elif result.audit_data == "private" and result.guarantee == "formal":
        sys.stdout.write(
            f"This audit run spent ε = {result.claimed_epsilon:.4g} (δ = {result.delta:.3g}) on its data: "
            "a model released from the same data must count it. Pass --ledger with that model's "
            "privacy_ledger.json to print the composed ε, or PrivateTrainer.attach_audit(result).\n"
        )
    text = json.dumps(payload, indent=2)
    if options.output:
        with open(options.output, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    sys.stdout.write(f"{result.canary_summary()}\n{result.verdict()}\n")
    verdict = "REFUTES" if result.refutes_claim else "does not refute"
    logger.info(
        "ε_lb = %.3f at %.0f%% confidence %s the %s = %.3f (an empirical lower bound, not the guarantee).",
        result.epsilon_lower_bound,
        100 * result.confidence,
        verdict,
        "claimed ε" if result.claim == "epsilon" else f"tested figure {result.claim}",
        result.claimed_epsilon,
    )
    logger.info(
        "μ-GDP on the same guesses: μ_lb = %.3f, ε %.3f at δ = %.3g.",
        result.mu_lower_bound,
        result.gdp_epsilon_lower_bound,
        result.delta,
    )
    if result.ceiling is not None:
        logger.info(
            "The most these tests could certify with %d canaries and %d guesses: ε %.3f; μ %.3f (ε %.3f at δ).",
            result.canaries,
            result.k_plus + result.k_minus,
            result.ceiling.epsilon,
            result.ceiling.mu,
            result.ceiling.gdp_epsilon,
        )
    return 1 if result.refutes_claim else 0
