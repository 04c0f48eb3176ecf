"""Per-example losses for the standard Hugging Face heads.

DP-SGD needs loss = Σ_b ℓ_b with each ℓ_b depending on example b only; the models' own `loss` is a batch
mean (over tokens, for language models), which couples examples through the normaliser.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..data.labels import IGNORE_INDEX
from ..data.packing import PackedLayout
from ..models.peft import unwrap_peft
from ..models.support import is_causal_lm

PerExampleLoss = Callable[[nn.Module, object, torch.Tensor], torch.Tensor]


def check_per_example_losses(losses: object, examples: int) -> torch.Tensor:
    """A user's loss must be one value per example: a mean or a [B, 1] result would not be Σ_b ℓ_b once summed."""
    if torch.is_tensor(losses) and tuple(losses.shape) == (examples,):
        return losses
    got = f"shape {list(losses.shape)}" if torch.is_tensor(losses) else f"a {type(losses).__name__}"
    raise ValueError(
        f"per_example_loss must return a tensor of shape [B] = [{examples}], one loss per example of the chunk; got "
        f"{got}. A batch-mean or scalar loss is not allowed: per-example clipping needs each example's own loss "
        "(reduction='none', then reduce each example's tokens/choices to one value)."
    )


def default_per_example_loss(
    model: nn.Module, outputs, labels: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """ℓ_b: the head's loss for example b alone (`head_losses`) plus, when a mixture of experts returns its router
    logits (`output_router_logits=True`), the example's own load-balancing loss (`router_aux_losses`): the model's
    auxiliary loss is never dropped silently."""
    losses = head_losses(model, outputs, labels, label_smoothing)
    aux = router_aux_losses(model, outputs, labels)
    return losses if aux is None else losses + aux.to(losses.dtype)


def router_aux_losses(model: nn.Module, outputs, labels: torch.Tensor) -> torch.Tensor | None:
    """Each example's load-balancing loss × `router_aux_loss_coef`, or None when the model returns no router logits.

    Transformers' `load_balancing_loss_func` (E · Σ_e f_e · P_e: the share of top-k choices and the mean router
    probability of expert e, over every layer's tokens) couples the examples through the batch's fractions; here it
    is the same formula over the example's own tokens, those its labels train (≠ -100), so that padding, whose
    amount depends on the other examples of the chunk, never counts.
    """
    router_logits = getattr(outputs, "router_logits", None)
    config = getattr(unwrap_peft(model), "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    if not router_logits or config is None or coef is None:
        return None
    if labels.dim() != 2:
        raise ValueError(
            f"{type(unwrap_peft(model)).__name__} returns router logits (output_router_logits=True), whose "
            "load-balancing loss hf_private computes per example over the tokens its labels train; labels of shape "
            f"{tuple(labels.shape)} mark no tokens. Set model.config.output_router_logits = False (the auxiliary loss "
            "is then not trained), or pass PrivateTrainer(per_example_loss=fn) computing each example's own."
        )
    examples, width = labels.shape
    trained = (labels != IGNORE_INDEX).unsqueeze(2).float()  # [B, T, 1]
    chosen_sum = probs_sum = torch.zeros((), device=labels.device)
    for layer in router_logits:
        probs = F.softmax(layer.float(), dim=-1).reshape(examples, width, -1)
        chosen = F.one_hot(probs.topk(config.num_experts_per_tok, dim=-1).indices, probs.shape[-1]).sum(2)
        chosen_sum = chosen_sum + (chosen * trained).sum(1)
        probs_sum = probs_sum + (probs * trained).sum(1)
    tokens = (trained.sum((1, 2)) * len(router_logits)).clamp(min=1).unsqueeze(1)
    return coef * probs.shape[-1] * ((chosen_sum / tokens) * (probs_sum / tokens)).sum(1)


def head_losses(model: nn.Module, outputs, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """ℓ_b as the model's own loss would compute it for example b alone: sequence classification/regression,
    multi-label (mean over labels), token classification, causal LM and encoder-decoder LM (mean over the example's
    tokens; an encoder-decoder's logits are already aligned with its labels, its decoder inputs being the labels
    shifted right: `models.support.with_decoder_inputs`). Label padding (-100) is never a token of the example.

    `label_smoothing` is TrainingArguments.label_smoothing_factor, applied per example as Trainer's LabelSmoother
    applies it to the batch (for the cross-entropy heads; it has no meaning for regression or multi-label).
    """
    logits = outputs.logits
    config = getattr(unwrap_peft(model), "config", None)
    if logits.dim() == 2:
        problem = getattr(config, "problem_type", None)
        if logits.shape[-1] == 1 or problem == "regression":
            _no_smoothing(label_smoothing, "regression")
            return (logits.squeeze(-1).float() - labels.float()).pow(2).reshape(logits.shape[0], -1).mean(1)
        if problem == "multi_label_classification":
            _no_smoothing(label_smoothing, "multi-label classification")
            return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none").mean(1)
        return F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=label_smoothing)
    if logits.dim() == 3 and labels.dim() == 2:
        if is_causal_lm(model):
            labels = labels[:, 1:]  # position t predicts token t + 1; the last position predicts nothing
            tokens = token_losses(logits, F.pad(labels, (0, 1), value=IGNORE_INDEX), label_smoothing)[:, :-1]
        else:
            tokens = token_losses(logits, labels, label_smoothing)
        counts = (labels != IGNORE_INDEX).sum(1).clamp(min=1)
        return tokens.sum(1) / counts
    raise ValueError(
        f"Cannot derive a per-example loss from logits of shape {tuple(logits.shape)} and labels of shape "
        f"{tuple(labels.shape)}. Pass PrivateTrainer(per_example_loss=fn) with fn(model, outputs, labels) -> [B]."
    )


def token_losses(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Each position's cross-entropy, [B, T], from logits [B, T, V] and targets [B, T] (-100: not trained, loss 0).

    The logits are read as one [B·T, V] matrix, as the models' own causal-LM loss reads them, so the step holds one
    logits-sized tensor beside the logits (the log-probabilities autograd saves): slicing off the last position
    first would copy the logits of a batch, and the class axis in the middle ([B, V, T]) makes `nll_loss` copy the
    log-probabilities (issue 48: a third `[T, V]` tensor in the forward)."""
    rows = logits.float().reshape(-1, logits.shape[-1])
    losses = F.cross_entropy(
        rows, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none", label_smoothing=label_smoothing
    )
    return losses.view(targets.shape)


def packed_causal_lm_losses(
    logits: torch.Tensor, labels: torch.Tensor, layout: PackedLayout, label_smoothing: float = 0.0
) -> torch.Tensor:
    """ℓ_b of each example packed end to end in rows (`hf_private.data.packing`): its mean over its own trained tokens,
    as `default_per_example_loss` gives it padded. A target that starts an example (or a row's padding) is never
    predicted from the previous example's last token (packing collators set its label to -100; it is ignored here
    whatever it is)."""
    shape = (layout.rows, layout.width)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != shape or tuple(labels.shape) != shape:
        raise ValueError(
            f"A packed chunk of {layout.rows} row(s) of {layout.width} tokens needs logits "
            f"[{layout.rows}, {layout.width}, vocab] and labels [{layout.rows}, {layout.width}]; got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    owner = layout.owner(logits.device)
    predicted = owner[:, 1:]
    targets = labels[:, 1:].masked_fill((predicted != owner[:, :-1]) | (predicted < 0), IGNORE_INDEX)
    padded = F.pad(targets, (0, 1), value=IGNORE_INDEX)  # the last position of a row predicts nothing
    tokens = token_losses(logits, padded, label_smoothing)[:, :-1].flatten()
    targets = targets.flatten()
    trained = (targets != IGNORE_INDEX).to(tokens.dtype)
    example = predicted.flatten().clamp(min=0)  # padding is never trained: its index does not matter
    sums = tokens.new_zeros(layout.examples).index_add(0, example, tokens * trained)
    counts = tokens.new_zeros(layout.examples).index_add(0, example, trained)
    return sums / counts.clamp(min=1)


def check_packed_head(model: nn.Module, outputs, labels: torch.Tensor, examples: int) -> None:
    """A model other than a causal LM takes packed batches only if it gives one output per packed example itself
    (hf_private's mean-pooled heads: a block-diagonal mask and a mean per sentence)."""
    logits = getattr(outputs, "logits", None)
    if torch.is_tensor(logits) and logits.shape[0] == examples and labels.shape[0] == examples:
        return
    raise ValueError(
        f"Packed batches are supported for causal LMs and hf_private's mean-pooled classifiers "
        f"(MeanPooledBertForSequenceClassification, MeanPooledRobertaForSequenceClassification with "
        f"PackedClassificationCollator), not {type(unwrap_peft(model)).__name__}: an encoder's bidirectional "
        "attention would let packed examples see each other, and a stock head reads one token per row. Pad each "
        "example to a row of its own (DataCollatorWithPadding)."
    )


def _no_smoothing(label_smoothing: float, problem: str) -> None:
    if label_smoothing:
        raise ValueError(
            f"label_smoothing_factor={label_smoothing} has no meaning for {problem} (it smooths a softmax over "
            "classes); set it to 0."
        )
