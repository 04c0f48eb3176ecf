"""Fast rules matched by what a module computes, not by its class name: norm gains and scaled embeddings.

Transformers adds a norm class or an embedding subclass with most model families (Qwen3's q/k norms, Gemma's
`x̂·(1 + w)` RMSNorm and `√d`-scaled embedding, Cohere's LayerNorm without bias). Keyed on class names a table
always lags; here a module without a dedicated rule is *probed* once, when the engine is built, on random inputs
and random parameter values, and given a fast rule only if its forward provably has that rule's form:

* **elementwise gain** (every RMSNorm and LayerNorm variant): out(w, b) = out(0, 0) + w ⊙ n(x) + b for a 1-D gain
  `weight` (and an optional 1-D `bias`). The gain's per-example gradient is Σ_t G_t ⊙ n(x_t), where n(x) is read
  off the module itself, out(1, 0) − out(0, 0), so its own dtypes and statistics (fp32 variance, `1 + w`,
  centring or not) hold exactly.
* **scaled embedding** (an `nn.Embedding` subclass): out = s · F.embedding(ids, w) for one scalar s (Gemma's
  `embed_scale`); the embedding rule with the output gradient scaled by s.

Anything else falls to the generic rule (`module_vjp.py`). The probe checks the form on random values, so a module
that merely looks like a norm (a gain used inside a matmul, a data-dependent scale) is never matched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from ..terms import SampleTerm
from .base import LayerHandler
from .embedding import EmbeddingHandler

_PROBE_SHAPE = (2, 3)  # examples × tokens of the probe input
# a wrong form misses by O(1) on random values; float64 modules often compute in float32 (their norms' statistics)
_PROBE_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4}
_PROBE_TOLERANCE_LOW_PRECISION = 3e-2


class ElementwiseGainHandler(LayerHandler):
    """A norm layer matched by its form: gain gradient Σ_t G_t ⊙ n(x_t), bias gradient Σ_t G_t."""

    rule = "norm gain (matched by probe)"

    def __init__(self, params: tuple[str, ...], unit_gain: float | None) -> None:
        self.params = params
        self.input_params = ("weight",) if "weight" in params else ()
        #: the gain g with out(g, 0) = n(x), when the probe found one (out = (c + w) ⊙ n(x): g = 1 − c, one forward
        #: in the backward instead of two); None: n(x) = out(1, 0) − out(0, 0)
        self.unit_gain = unit_gain

    def terms(self, module, saved, grad_output, trainable):
        batch = grad_output.shape[0]
        shape = tuple(module._parameters["weight"].shape)
        grads = grad_output.reshape(batch, -1, *shape)
        out = {}
        if "weight" in trainable:
            normalized = _normalized(module, saved, self.unit_gain).to(grad_output.dtype).reshape(batch, -1, *shape)
            out["weight"] = SampleTerm((grads * normalized).sum(1))
        if "bias" in trainable:
            out["bias"] = SampleTerm(grads.sum(1))
        return out


class ScaledEmbeddingHandler(EmbeddingHandler):
    """An embedding whose output is its rows times a constant `scale`: each row's gradient is scale × G."""

    rule = "scaled embedding (matched by probe)"

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def terms(self, module, saved, grad_output, trainable):
        return super().terms(module, saved, grad_output * self.scale, trainable)


def matched_handler(module: nn.Module, trainable: set[str]) -> LayerHandler | None:
    """A fast rule whose form the module's forward was shown to have, or None. FSDP2-sharded weights (DTensors) are
    not probed: a probe mixes them with plain tensors; the generic rule, checked against autograd, applies."""
    if any(isinstance(p, DTensor) for p in module._parameters.values()):
        return None
    if isinstance(module, nn.Embedding):
        return _match_scaled_embedding(module, trainable)
    return _match_gain(module, trainable)


def _match_gain(module: nn.Module, trainable: set[str]) -> ElementwiseGainHandler | None:
    own = {name: p for name, p in module._parameters.items() if p is not None}
    weight = own.get("weight")
    if weight is None or weight.dim() != 1 or not trainable <= {"weight", "bias"} or set(own) - {"weight", "bias"}:
        return None
    bias = own.get("bias")
    if bias is not None and bias.shape != weight.shape:
        return None
    with torch.no_grad():
        x = torch.randn(*_PROBE_SHAPE, weight.shape[0], dtype=weight.dtype, device=weight.device)
        gain, shift = torch.randn_like(weight), torch.randn_like(weight)
        try:
            base = _call(module, x, 0.0, 0.0 if bias is not None else None)
            normalized = _call(module, x, 1.0, 0.0 if bias is not None else None) - base
            with_gain = _call(module, x, gain, 0.0 if bias is not None else None)
            shifted = _call(module, x, gain, shift) if bias is not None else with_gain + shift
        except Exception:  # a forward that is not f(x) alone, or not shape-preserving: not a norm
            return None
        if normalized.shape != x.shape or not bool(normalized.abs().gt(0).any()):
            return None
        if not _close(with_gain, base + gain * normalized) or not _close(shifted, with_gain + shift):
            return None
        unit_gain = 1.0 if _close(base, torch.zeros_like(base)) else 0.0 if _close(base, normalized) else None
    return ElementwiseGainHandler(tuple(sorted(trainable)), unit_gain)


def _match_scaled_embedding(module: nn.Embedding, trainable: set[str]) -> ScaledEmbeddingHandler | None:
    if trainable != {"weight"} or set(n for n, p in module._parameters.items() if p is not None) != {"weight"}:
        return None
    weight = module.weight
    with torch.no_grad():
        ids = torch.randint(0, module.num_embeddings, _PROBE_SHAPE, device=weight.device)
        rows = torch.randn_like(weight)
        try:
            out = functional_call(module, {"weight": rows}, (ids,))
        except Exception:  # a forward that needs more than the ids (positions, offsets): not a plain lookup
            return None
        looked_up = F.embedding(ids, rows, module.padding_idx)
        if not isinstance(out, torch.Tensor) or out.shape != looked_up.shape:
            return None
        scale = float((out * looked_up).sum() / looked_up.pow(2).sum())
        if not _close(out, scale * looked_up):
            return None
    return ScaledEmbeddingHandler(scale)


def _normalized(module: nn.Module, x: torch.Tensor, unit_gain: float | None) -> torch.Tensor:
    """n(x) = out(1, 0) − out(0, 0): the module's own normalisation, as its forward computes it (one forward when the
    probe found the gain that gives n(x) alone)."""
    zero = 0.0 if module._parameters.get("bias") is not None else None
    with torch.no_grad():
        if unit_gain is not None:
            return _call(module, x, unit_gain, zero)
        return _call(module, x, 1.0, zero) - _call(module, x, 0.0, zero)


def _call(module: nn.Module, x: torch.Tensor, gain, bias) -> torch.Tensor:
    weight = module._parameters["weight"]
    assert weight is not None
    params = {"weight": torch.as_tensor(gain, dtype=weight.dtype, device=weight.device).expand(weight.shape)}
    if bias is not None:
        params["bias"] = torch.as_tensor(bias, dtype=weight.dtype, device=weight.device).expand(weight.shape)
    out = functional_call(module, params, (x,))
    if not isinstance(out, torch.Tensor):
        raise TypeError("not a tensor")
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    tolerance = _PROBE_TOLERANCE.get(actual.dtype, _PROBE_TOLERANCE_LOW_PRECISION)
    scale = expected.abs().max().clamp(min=1.0)
    return bool(((actual - expected).abs().max() <= tolerance * scale).item())
