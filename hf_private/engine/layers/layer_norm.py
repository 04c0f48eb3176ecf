"""`nn.LayerNorm`: gain gradient Σ_t G_t ⊙ x̂_t, bias gradient Σ_t G_t, both cheap to instantiate."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..terms import SampleTerm, in_compute_dtype
from .base import LayerHandler
from .registry import register_layer


@register_layer(nn.LayerNorm)
class LayerNormHandler(LayerHandler):
    rule = "layer norm"
    params = ("weight", "bias")
    input_params = ("weight",)

    def terms(self, module, saved, grad_output, trainable):
        batch, dims = grad_output.shape[0], tuple(module.normalized_shape)
        grads = grad_output.reshape(batch, -1, *dims)
        out = {}
        if "weight" in trainable:
            normalized = F.layer_norm(in_compute_dtype(saved, grad_output), dims, None, None, module.eps)
            normalized = normalized.reshape(batch, -1, *dims)
            out["weight"] = SampleTerm((grads * normalized).sum(1))
        if "bias" in trainable:
            out["bias"] = SampleTerm(grads.sum(1))
        return out
