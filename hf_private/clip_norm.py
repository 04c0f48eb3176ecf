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

`ClipNormCheck` catches the opposite mistake during training: a C so far above the norms (max_grad_norm=1e4) that
nothing is clipped and the noise σ·C drowns the whole summed gradient; such a run trains to the end and learns nothing.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .demos.sentiment import sentiment_texts
from .engine import PerExampleGradientEngine
from .engine.reducers import FlatL2ClipReducer
from .integrations.losses import default_per_example_loss
from .logs import get_logger
from .methods import MethodConfig
from .optimizer import NoisyOptimizer

__all__ = ["ClipNormCheck", "gradient_norms_at_init", "median_gradient_norm", "public_calibration_texts"]

logger = get_logger(__name__)

# At most this share of the first batch's units clipped reads as "nearly none".
NEARLY_NONE_CLIPPED = 0.05


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
        squares = (g.double().pow(2).sum() for g in grads if g is not None)
        norms.append(torch.sqrt(functools.reduce(operator.add, squares)))
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


class ClipNormCheck:
    """Warns once, after the first logical batch that held units, when C is far above their gradient norms: at most
    `NEARLY_NONE_CLIPPED` of them clipped, and the noise σ·C on each coordinate larger than the whole summed gradient
    could be (Σ_b min(‖g_b‖, C), every unit's gradient aligned; this process's mean times the expected batch).
    Such a run trains to the end and learns nothing. A `PrivacyRun` instrument: it reads the norms each training
    engine clipped (`add_norm_hook`) and decides at the optimizer's step end.

    The norms are the private batch's, without noise. The warning prints their median to two significant digits,
    which, like the training loss, is not covered by ε (docs/privacy/not-protected.md); it prints nothing when C is
    sensible.
    """

    def __init__(self, unit: str = "example") -> None:
        self.unit = unit
        self._norms: list[torch.Tensor] = []
        self._handles: list = []
        self.done = False

    def attach_engine(self, engine: PerExampleGradientEngine) -> None:
        if not self.done:
            self._handles.append(engine.add_norm_hook(lambda norms: self._observe(engine, norms)))

    def attach_optimizer(self, optimizer: NoisyOptimizer) -> None:
        if not self.done:
            self._handles.append(optimizer.add_step_end_hook(lambda: self._check(optimizer)))

    def _observe(self, engine: PerExampleGradientEngine, norms: torch.Tensor) -> None:
        if isinstance(engine.reducer, FlatL2ClipReducer):  # norms in the clip's own sense, compared with C
            self._norms.append(norms.float().cpu())

    def _check(self, optimizer: NoisyOptimizer) -> None:
        norms = torch.cat(self._norms) if self._norms else torch.zeros(0)
        self._norms = []
        norms = norms[torch.isfinite(norms)]
        if norms.numel() == 0:  # an empty Poisson batch: the next one decides
            return
        self.done = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        c, sigma, batch = optimizer.max_grad_norm, optimizer.noise_multiplier, optimizer.expected_batch_size
        clipped = int((norms > c).sum())
        signal = float(norms.clamp(max=c).mean()) * batch
        if clipped <= NEARLY_NONE_CLIPPED * norms.numel() and sigma * c > signal:
            logger.warning(
                "max_grad_norm C=%.4g is far above the per-%s gradient norms: in the first logical batch %d of %d "
                "%ss were clipped, their median norm was %.2g, and the noise σ·C=%.3g on every coordinate exceeds "
                "the whole summed gradient (at most %.3g for an expected batch of %d, every gradient aligned), so "
                "training will learn little or nothing. Set C near the median gradient norm, measured at "
                "initialisation on public inputs with hf_private.median_gradient_norm (never on the private data). "
                "The median above was measured on the private batch without noise: like the training loss, this "
                "line is not covered by ε.",
                c,
                self.unit,
                clipped,
                norms.numel(),
                self.unit,
                float(norms.median()),
                sigma * c,
                signal,
                batch,
            )
