"""TRL's `DPOTrainer` (trl ≥ 1.16), privatized: one unit is one preference pair (a prompt with its chosen and its
rejected completion), clipped as one example.

TRL collates a batch of B pairs into 2B rows, the B chosen rows first and the B rejected rows after them; a clip per
row would clip chosen and rejected separately and let one pair move the released sum by 2C while the accountant
assumes C. The private path collates the same rows as [B, 2, T] (`PairCollator`), so a chunk holds B units of two
consecutive rows (chosen, rejected) and the engine clips the sum of each pair's two rows, as it clips a multiple-choice
example's choices.

The training loss is each pair's own loss (`pair_losses`), with TRL's formulas for every loss type whose value for a
pair depends on that pair alone, summed over pairs: never TRL's mean over the batch. The policy's log-probabilities
come from the model's own logits, not TRL's fused LM head, whose matmul with `lm_head.weight` bypasses the module the
engine hooks (a trained head's gradient would escape the clip). The reference log-probabilities are computed without
gradient, per pair, from the frozen `ref_model`, from the base model with the adapter disabled (PEFT), or read from
the dataset (`precompute_ref_log_probs`): no reference quantity depends on another pair.

Refused: the loss types that sort the batch ('aot', 'aot_unpaired': a pair's loss then depends on its batch-mates),
padding-free batches, Liger kernels, activation offloading, a Mixture-of-Experts load-balancing loss, vision-language
preference data, and a `per_example_loss` (the pair loss is DPOConfig's). TRL's training metrics (rewards, margins,
log-probabilities) are un-noised functions of the private batch: the private path never computes them, so
`DPOTrainer.log` finds none to add. Evaluation is TRL's own.

Nothing here is imported unless the trainer class comes from trl.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data.labels import IGNORE_INDEX
from ..models.peft import is_peft_model
from .base import RefusedKeyword, RefusedSetting, TrainerFamily
from .trl_shared import KERNEL_AND_BATCH_SETTINGS, PACKING_ISSUE, PEFT_CONFIG

#: rows of one preference pair in a collated training chunk: chosen, then rejected
PAIR_ROWS = 2
#: the collated entries that hold one row per completion (2B rows: B chosen, then B rejected)
ROW_KEYS = ("input_ids", "attention_mask", "completion_mask")
#: loss types whose value for one pair depends on the other pairs of its batch
BATCH_COUPLED_LOSSES = {
    "aot": "it sorts the batch's log-ratios, so each pair's loss depends on its batch-mates",
    "aot_unpaired": "it sorts the batch's chosen and rejected log-ratios apart, so each pair's loss depends on its "
    "batch-mates",
}


# ---------------------------------------------------------------------- collation: one pair, two consecutive rows
class PairCollator:
    """TRL's preference collator, with each pair's chosen and rejected rows stacked as [B, 2, T]."""

    def __init__(self, collate_fn: Callable[[list], Mapping[str, Any]]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, features: list) -> dict[str, Any]:
        batch = dict(self.collate_fn(features))
        pairs = len(features)
        for key in ROW_KEYS:
            value = batch.get(key)
            if torch.is_tensor(value):
                if value.shape[0] != PAIR_ROWS * pairs:
                    raise ValueError(
                        f"The preference collator gave {key!r} {value.shape[0]} rows for {pairs} pairs "
                        f"(expected {PAIR_ROWS * pairs}: the chosen rows, then the rejected rows)."
                    )
                batch[key] = torch.stack(value.chunk(PAIR_ROWS), dim=1)  # row b: (chosen b, rejected b)
        return batch


# ---------------------------------------------------------------------- log-probabilities of the completions
def completion_token_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    """log p(token_t | tokens before t) at each completion token (0 elsewhere), [R, T - 1], in float32.

    As the label's logit minus the log-sum-exp: autograd then keeps no [R, T, V] log-softmax beside the logits."""
    labels = input_ids[:, 1:].masked_fill(completion_mask[:, 1:] == 0, IGNORE_INDEX)
    shifted = logits[:, :-1]
    token = shifted.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).float() - shifted.float().logsumexp(-1)
    return token * (labels != IGNORE_INDEX)


def sequence_logps(token_logps: torch.Tensor, completion_mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """Σ_t of each row's completion log-probabilities, [B, 2]; with LD-DPO's `ld_alpha`, the tokens of the longer
    completion beyond the pair's shorter one count α times (its own pair's lengths only)."""
    pairs = token_logps.view(-1, PAIR_ROWS, token_logps.shape[-1])
    if ld_alpha is None:
        return pairs.sum(-1)
    shifted = completion_mask[:, 1:].reshape(pairs.shape)
    position = shifted.cumsum(-1)
    shared = shifted.sum(-1).min(dim=1, keepdim=True).values.unsqueeze(-1)  # the pair's shorter completion
    in_shared = (position > 0) & (position <= shared)
    return (pairs * in_shared).sum(-1) + ld_alpha * (pairs * (position > shared)).sum(-1)


# ---------------------------------------------------------------------- the pair losses (TRL's formulas, per pair)
@dataclass(frozen=True)
class PairTerms:
    """What the loss types read, for each pair of a chunk; every tensor is [B, 2] (chosen, rejected) or [B]."""

    log_ratios: torch.Tensor  # log π(y|x) − log π_ref(y|x)
    scores: torch.Tensor  # f'(π/π_ref) of the f-divergence (the log-ratios for reverse KL)
    logps: torch.Tensor  # log π(y|x)
    ref_logps: torch.Tensor  # log π_ref(y|x)
    completion_tokens: torch.Tensor  # completion tokens of each row (≥ 1)
    chosen_nll: torch.Tensor  # [B]: mean negative log-likelihood of the chosen completion's own tokens

    @property
    def delta(self) -> torch.Tensor:
        return self.scores[:, 0] - self.scores[:, 1]

    @property
    def mean_delta(self) -> torch.Tensor:
        """Δ of the scores averaged over each completion's own tokens (IPO, sigmoid_norm)."""
        mean = self.scores / self.completion_tokens
        return mean[:, 0] - mean[:, 1]


def _exo_pair(t: PairTerms, beta: float, smoothing: float, tau: float) -> torch.Tensor:
    z = beta * t.delta
    eps = torch.tensor(smoothing, dtype=z.dtype, device=z.device)
    return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - torch.log(eps)
    )


def _robust(t: PairTerms, beta: float, smoothing: float, tau: float) -> torch.Tensor:
    z = beta * t.delta
    return (-(1 - smoothing) * F.logsigmoid(z) + smoothing * F.logsigmoid(-z)) / (1 - 2 * smoothing)


def _nca_pair(t: PairTerms, beta: float, smoothing: float, tau: float) -> torch.Tensor:
    chosen, rejected = beta * t.log_ratios[:, 0], beta * t.log_ratios[:, 1]
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _discopop(t: PairTerms, beta: float, smoothing: float, tau: float) -> torch.Tensor:
    z = beta * t.delta
    mix = torch.sigmoid(z / tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


PairLoss = Callable[[PairTerms, float, float, float], torch.Tensor]
#: loss type → ℓ(pair terms, β, label_smoothing, discopop_tau), one loss per pair, as TRL's DPOTrainer defines it
PAIR_LOSSES: dict[str, PairLoss] = {
    "sigmoid": lambda t, beta, s, tau: -F.logsigmoid(beta * t.delta),
    "hinge": lambda t, beta, s, tau: torch.relu(1 - beta * t.delta),
    "ipo": lambda t, beta, s, tau: (t.mean_delta - 1 / (2 * beta)) ** 2,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "robust": _robust,
    "bco_pair": lambda t, beta, s, tau: (
        -F.logsigmoid(beta * t.log_ratios[:, 0]) - F.logsigmoid(-beta * t.log_ratios[:, 1])
    ),
    "sppo_hard": lambda t, beta, s, tau: (
        (t.log_ratios[:, 0] - 0.5 / beta) ** 2 + (t.log_ratios[:, 1] + 0.5 / beta) ** 2
    ),
    "apo_zero": lambda t, beta, s, tau: (
        1 - torch.sigmoid(beta * t.log_ratios[:, 0]) + torch.sigmoid(beta * t.log_ratios[:, 1])
    ),
    "apo_down": lambda t, beta, s, tau: (
        torch.sigmoid(beta * t.log_ratios[:, 0]) + 1 - torch.sigmoid(beta * (t.log_ratios[:, 0] - t.log_ratios[:, 1]))
    ),
    "discopop": _discopop,
    "sigmoid_norm": lambda t, beta, s, tau: -F.logsigmoid(beta * t.mean_delta),
    # TRL averages the chosen tokens' NLL over the whole batch; here over each pair's own chosen tokens
    "sft": lambda t, beta, s, tau: t.chosen_nll,
}


def divergence_scores(log_ratios: torch.Tensor, divergence: str, alpha: float) -> torch.Tensor:
    """f'(π/π_ref) for DPOConfig.f_divergence_type, row by row."""
    if divergence == "reverse_kl" or (divergence == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return log_ratios
    if divergence == "forward_kl":
        return 1 - torch.exp(-log_ratios)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratios)
    if divergence == "alpha_divergence":
        exponent = torch.clamp(((alpha - 1.0) * log_ratios).float(), max=80.0)
        return ((torch.exp(exponent) - 1.0) / (alpha - 1.0)).to(log_ratios.dtype)
    raise ValueError(f"Unknown f_divergence_type {divergence!r}.")


# ---------------------------------------------------------------------- the reference model
def reference_logps(
    trainer: Any, model: nn.Module, rows: dict[str, torch.Tensor], completion_mask: torch.Tensor, ld_alpha: float | None
) -> torch.Tensor:
    """log π_ref of each pair's completions, [B, 2], without gradient: the frozen `ref_model`, or the base model with
    the adapter disabled (or TRL's "ref" adapter when one was loaded)."""
    with torch.no_grad():
        if trainer.ref_model is not None:
            logits = trainer.ref_model(**rows, use_cache=False).logits
        else:
            if not is_peft_model(model):
                raise ValueError(
                    "DPO needs the reference model's log-probabilities: pass ref_model, train a PEFT "
                    "adapter (the base model is the reference), or set precompute_ref_log_probs=True."
                )
            from trl.trainer.utils import use_adapter

            adapter = "ref" if "ref" in model.peft_config else None
            with use_adapter(model, adapter_name=adapter):
                logits = model(**rows, use_cache=False).logits
        token_logps = completion_token_logps(logits, rows["input_ids"], completion_mask)
    return sequence_logps(token_logps, completion_mask, ld_alpha)


def wpo_weights(logits: torch.Tensor, token_logps: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """WPO's weight of each pair (`use_weighting`): Π over its two rows of exp(mean_t (log p_t − log Σ_v p_v²)),
    without gradient, over each row's own completion tokens."""
    with torch.no_grad():
        log_probs = logits[:, :-1].float().log_softmax(-1)
        log_sum_sq = torch.logsumexp(2 * log_probs, dim=-1)
        shifted = completion_mask[:, 1:]
        aligned = (token_logps - log_sum_sq) * shifted
        weights = torch.exp(aligned.sum(-1) / shifted.sum(-1).clamp(min=1))
    return weights.view(-1, PAIR_ROWS).prod(-1)


# ---------------------------------------------------------------------- the family
class DPOFamily(TrainerFamily):
    name = "trl.DPOTrainer"
    own_classes = ("trl.trainer.dpo_trainer.DPOTrainer", "trl.trainer.base_trainer._BaseTrainer")
    accepts_per_example_loss = False
    compatible_overrides = {
        "training_step": "DPOTrainer.training_step only wraps Trainer.training_step in its activation-offloading "
        "context, a no-op here (activation_offloading is refused)",
        "compute_loss": "the private training loss is each preference pair's own loss "
        "(hf_private.integrations.trl_dpo); DPOTrainer.compute_loss serves evaluation only",
        "log": "it adds DPO metrics computed by DPOTrainer.compute_loss, which training never calls",
        "_save_checkpoint": "it writes the model card (hf_private's) before Trainer's checkpoint",
        "prediction_step": "evaluation only",
        "evaluate": "evaluation only (it prepares a dataset passed to evaluate as training data is prepared)",
    }
    refused_settings = (
        RefusedSetting(
            "loss_type",
            lambda args, model: not set(_loss_types(args)) <= set(PAIR_LOSSES),
            "; ".join(f"'{name}': {why}" for name, why in BATCH_COUPLED_LOSSES.items())
            + f". The loss types with a per-pair loss here: {', '.join(PAIR_LOSSES)}.",
        ),
        RefusedSetting(
            "padding_free",
            lambda args, model: bool(getattr(args, "padding_free", False)),
            f"padding_free flattens the pairs' chosen and rejected rows into one, which the pair loss cannot "
            f"restack into pairs; {PACKING_ISSUE}. Set padding_free=False.",
        ),
        *KERNEL_AND_BATCH_SETTINGS,
    )
    refused_keywords = (
        PEFT_CONFIG,
        RefusedKeyword(
            "train_dataset",
            lambda dataset, dp_config: _has_images(dataset),
            "a vision-language preference dataset ('image' or 'images' in its rows) is collated by TRL's vision "
            "collator, whose image tensors have no per-pair grouping here. Train on text preference pairs.",
        ),
    )

    labels_entry = None  # the pair loss reads each row's completion_mask, not labels

    #: precomputed by `precompute_ref_log_probs` for each pair, separately for each set: the held-out check compares
    #: the pairs themselves
    derived_columns = ("ref_chosen_logps", "ref_rejected_logps")

    def unit(self, train_dataset: Any) -> str:
        return "preference pair"

    def per_unit_loss(self, args: Any) -> None:
        return None  # the pair loss reads whole chunks (unit_losses), not (model, outputs, labels)

    def training_collator(self, collate_fn: Callable[[list], Mapping[str, Any]]) -> Callable:
        return PairCollator(collate_fn)

    def rows_per_unit(self, model: nn.Module, inputs: Mapping[str, Any]) -> int:
        input_ids = inputs.get("input_ids")
        if not torch.is_tensor(input_ids) or input_ids.dim() != 3 or input_ids.shape[1] != PAIR_ROWS:
            shape = tuple(input_ids.shape) if torch.is_tensor(input_ids) else None
            raise ValueError(
                f"A private DPO chunk holds each pair as [B, 2, T] input_ids (chosen, rejected); got "
                f"{shape}. Use DPOTrainer's own data collator (DataCollatorForPreference)."
            )
        return PAIR_ROWS

    def unit_losses(self, trainer: Any, model: nn.Module, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, Any]:
        """ℓ_pair for every pair of the chunk, [B], and the policy's outputs over its 2B rows (chosen b, rejected b
        consecutive)."""
        args = trainer.args
        self.rows_per_unit(model, inputs)
        rows = {key: inputs[key].flatten(0, 1) for key in ("input_ids", "attention_mask") if key in inputs}
        completion_mask = inputs["completion_mask"].flatten(0, 1)
        if "ref_chosen_logps" in inputs:
            ref_logps = torch.stack([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]], dim=1).float()
        else:
            ref_logps = reference_logps(trainer, model, rows, completion_mask, args.ld_alpha)
        outputs = model(**rows, use_cache=False)
        token_logps = completion_token_logps(outputs.logits, rows["input_ids"], completion_mask)
        logps = sequence_logps(token_logps, completion_mask, args.ld_alpha)
        log_ratios = logps - ref_logps
        chosen_tokens = completion_mask[:, 1:].reshape(-1, PAIR_ROWS, completion_mask.shape[-1] - 1)[:, 0]
        chosen_logps = token_logps.view(-1, PAIR_ROWS, token_logps.shape[-1])[:, 0]
        terms = PairTerms(
            log_ratios=log_ratios,
            scores=divergence_scores(log_ratios, args.f_divergence_type, args.f_alpha_divergence_coef),
            logps=logps,
            ref_logps=ref_logps,
            completion_tokens=completion_mask.view(-1, PAIR_ROWS, completion_mask.shape[-1]).sum(-1).clamp(min=1),
            chosen_nll=-chosen_logps.sum(-1) / chosen_tokens.sum(-1).clamp(min=1),
        )
        weights = args.loss_weights or [1.0] * len(_loss_types(args))
        losses = sum(
            weight * PAIR_LOSSES[name](terms, args.beta, args.label_smoothing, args.discopop_tau)
            for name, weight in zip(_loss_types(args), weights, strict=True)
        )
        if args.use_weighting:
            losses = losses * wpo_weights(outputs.logits, token_logps, completion_mask)
        return losses, outputs


def _has_images(dataset: Any) -> bool:
    try:
        first = next(iter(dataset))
    except (TypeError, StopIteration):
        return False
    return isinstance(first, Mapping) and ("image" in first or "images" in first)


def _loss_types(args: Any) -> list[str]:
    loss_type = getattr(args, "loss_type", ["sigmoid"])
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


FAMILY = DPOFamily()
