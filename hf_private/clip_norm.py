"""Choosing the clip norm C from the model, on public inputs: the median per-example gradient norm at initialisation.

Far below the typical per-example norm every example is clipped to the same length, fitted or not: the loss's
own weighting (a confidently right example pushes less than a wrong one) is gone, and on a class-imbalanced task the
model drifts to the majority class while its loss rises. On SST-2 with all-MiniLM-L6-v2 at ε = 8 (benchmarks/
utility.py, 20,000 sentences, B 256, 78 steps, held-out accuracy), DP-BiTFiT at C = 0.1 (35x below the median norm)
ended at 80.5% with its loss rising 0.80 -> 1.04, at C = 3.5 (the median) at 82.1% with its loss falling 0.65 ->
0.52; full DP fine-tuning at C = 0.1 had its loss at 2.0 by step 43, at C = 6 (the median) it fell 0.66 -> 0.41.
The norms depend on the model and its new head (on that model, with the benchmark's mean-pooled head: full 6.0,
BiTFiT 3.5, LoRA 3.4; with the stock CLS-pooler head, on `public_calibration_texts(32)`: 2.59, 1.21, 1.16), so no
single C fits every model: `median_gradient_norm` measures them.

Measure on public inputs only (the default below: generated sentences that contain nothing of anyone's data).
Measuring on the private training set would make C depend on it, which the accounted ε does not cover.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .demo import sentiment_texts
from .losses import default_per_example_loss
from .methods import MethodConfig

__all__ = ["gradient_norms_at_init", "median_gradient_norm", "public_calibration_texts"]


def public_calibration_texts(n: int = 32, seed: int = 0) -> list[str]:
    """Generated English sentences (the demo's reviews): inputs that carry no private information."""
    return sentiment_texts(n, seed)[0]


def gradient_norms_at_init(
    model: nn.Module,
    dp_config: MethodConfig,
    examples: Sequence[dict[str, Any]],
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> torch.Tensor:
    """Each example's gradient norm over what `dp_config`'s method trains, on a copy of `model` (left untouched),
    as PrivateTrainer would clip it (default per-example loss, dropout off)."""
    method = dp_config.build_method()
    probe = method.wrap_model(copy.deepcopy(model))
    method.prepare_model(probe)
    probe.eval()
    params = [p for p in probe.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The method trains no parameter of this model, so there is no gradient norm to measure.")
    device = params[0].device
    norms = []
    for example in examples:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collate([example]).items()}
        labels = batch.pop("labels", batch.pop("label", None))
        if labels is None:
            raise ValueError("Each example needs a 'labels' (or 'label') entry to compute its loss.")
        loss = default_per_example_loss(probe, probe(**batch), labels).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        norms.append(torch.sqrt(sum(g.double().pow(2).sum() for g in grads if g is not None)))
    return torch.stack(norms).float().cpu()


def median_gradient_norm(
    model: nn.Module,
    dp_config: MethodConfig,
    examples: Sequence[dict[str, Any]],
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> float:
    """The median of `gradient_norms_at_init`: a clip norm at which about half the examples are clipped at the
    start (Abadi et al.'s rule of thumb)."""
    if not examples:
        raise ValueError("No examples to measure the gradient norms on.")
    return float(gradient_norms_at_init(model, dp_config, examples, collate).median())
