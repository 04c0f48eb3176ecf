"""A warning when a classifier's held-out predictions collapse to one class, with the likely causes.

A private run that learnt nothing usually does not fail: its loss moves a little, and it predicts the majority class
for every input, which reads as an accuracy near the class prior. This counts the argmax of each held-out evaluation
batch (the logits `evaluate()` computes anyway) and the labels, and warns when one class takes at least
COLLAPSED_SHARE of the predictions, at least PRIOR_MARGIN more than its share of the labels (a model that follows an
imbalanced label prior is not collapsed). Sets that overlap the training data are never
counted: only held-out data is looked at, as by the evaluation itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..logs import get_logger
from ..models.heads import MEAN_POOLED_HEADS
from ..models.peft import unwrap_peft

logger = get_logger(__name__)

COLLAPSED_SHARE = 0.9  # one class's share of the predictions from which they count as collapsed...
PRIOR_MARGIN = 0.2  # ...when it is also this far above that class's share of the labels
MIN_EXAMPLES = 20  # below this a share says too little to warn about
FULL_FINE_TUNING = 0.5  # a trained share of the model's values above which "too few examples" is a likely cause


@dataclass(frozen=True)
class RunSettings:
    """What the causes name: the run's clip norm, learning rate, training set and trained values."""

    max_grad_norm: float
    learning_rate: float
    examples: int
    trained_values: int
    model_values: int
    steps: int


class HeldOutPredictions:
    """Class counts of a classifier's predictions and labels over one held-out `evaluate()` (see `counting`)."""

    def __init__(self) -> None:
        self.predicted: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None
        self._active = False
        self._warned: set[str] = set()

    @contextmanager
    def counting(self, held_out: bool) -> Iterator[None]:
        """Count the batches `add` sees inside the block, when the set is held out (else count nothing)."""
        self.predicted = self.labels = None
        self._active = held_out
        try:
            yield
        finally:
            self._active = False

    def add(self, model: nn.Module, outputs, labels: torch.Tensor | None) -> None:
        """One evaluation batch: its single-label classification logits [B, K] and integer labels [B]; anything else
        (regression, multi-label, tokens, multiple choice) is not counted."""
        logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
        if not self._active or logits is None or labels is None or not _single_label(model, logits, labels):
            return
        classes = logits.shape[-1]
        labels = labels.detach().long()
        kept = (labels >= 0) & (labels < classes)
        predicted = torch.bincount(logits.detach()[kept].argmax(-1), minlength=classes)
        seen = torch.bincount(labels[kept], minlength=classes)
        self.predicted = predicted if self.predicted is None else self.predicted + predicted
        self.labels = seen if self.labels is None else self.labels + seen

    def warn_if_collapsed(
        self,
        name: str,
        model: nn.Module,
        facts: RunSettings,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> bool:
        """Log the WARNING once per evaluation set name (INFO after) when the counts collapsed; whether they did.
        `reduce` sums a tensor over processes (distributed evaluation, where each counts its own shard)."""
        if self.predicted is None or self.labels is None or facts.steps == 0:  # not counted, or nothing trained yet
            return False
        predicted, labels = self.predicted, self.labels
        if reduce is not None:
            predicted, labels = reduce(predicted), reduce(labels)
        total = int(predicted.sum())
        top = int(predicted.argmax())
        share = int(predicted[top]) / max(total, 1)
        label_share = int(labels[top]) / max(total, 1)
        if total < MIN_EXAMPLES or share < COLLAPSED_SHARE or share - label_share < PRIOR_MARGIN:
            return False
        if name in self._warned:
            logger.info("Held-out predictions on %r are still collapsed to class %d (%.1f%%).", name, top, 100 * share)
            return True
        self._warned.add(name)
        logger.warning(collapse_message(name, top, share, total, label_share, model, facts))
        return True


def _single_label(model: nn.Module, logits, labels) -> bool:
    if not torch.is_tensor(logits) or logits.dim() != 2 or logits.shape[-1] < 2 or not torch.is_tensor(labels):
        return False
    if labels.dim() != 1 or labels.shape[0] != logits.shape[0] or labels.is_floating_point():
        return False
    base = unwrap_peft(model)
    problem = getattr(getattr(base, "config", None), "problem_type", None)
    return problem in (None, "single_label_classification") and not type(base).__name__.endswith("ForMultipleChoice")


def collapse_message(
    name: str, top: int, share: float, total: int, label_share: float, model: nn.Module, facts: RunSettings
) -> str:
    """The warning: what collapsed, then each likely cause with what to do about it."""
    causes = [
        f"the clip norm C={facts.max_grad_norm:g} far below the per-example gradient norms, so every example is "
        "clipped alike and the class prior wins: measure them with hf_private.median_gradient_norm on public inputs "
        "and set C near the median",
        f"the learning rate ({facts.learning_rate:g}): with Adam every noise-dominated coordinate moves about lr per "
        "step, so the more values train the smaller it must be (5e-4 for full fine-tuning, 5e-3 for biases, LoRA or "
        "a head), while too small a rate leaves a new head where it started",
    ]
    base = unwrap_peft(model)
    if type(base).__name__.endswith("ForSequenceClassification") and not isinstance(base, MEAN_POOLED_HEADS):
        causes.append(
            f"the head: {type(base).__name__} classifies the CLS token, a poor feature when the checkpoint is a "
            "mean-pooling sentence encoder (sentence-transformers checkpoints such as all-MiniLM-L6-v2): then use "
            "hf_private.MeanPooledBertForSequenceClassification.from_pretrained(path) (or "
            "hf_private.sentence_classifier(path), which reads the checkpoint's pooling)"
        )
    if facts.trained_values >= FULL_FINE_TUNING * facts.model_values:
        causes.append(
            f"too few examples for the noised coordinates: {facts.trained_values:,} trained values get noise at "
            f"every step, from {facts.examples:,} training examples; train fewer values (DP-LoRA, DP-BiTFiT) or use "
            "more data"
        )
    listed = "; ".join(f"({i}) {cause}" for i, cause in enumerate(causes, 1))
    return (
        f"Held-out predictions on {name!r} collapsed to class {top}: {100 * share:.1f}% of {total} predictions "
        f"after {facts.steps} training steps, while class {top} is {100 * label_share:.1f}% of the labels. The "
        f"model learnt little beyond the class prior. Likely causes: {listed}."
    )
