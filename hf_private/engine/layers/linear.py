"""`nn.Linear`: weight gradient Σ_t G_t A_tᵀ (kept factored), bias gradient Σ_t G_t."""

from __future__ import annotations

import torch
from torch import nn

from ..terms import OuterTerm, SampleTerm, in_compute_dtype, outer_product_term
from .base import LayerHandler, as_sequence
from .registry import register_layer


@register_layer(nn.Linear)
class LinearHandler(LayerHandler):
    rule = "linear (factored)"
    params = ("weight", "bias")
    input_params = ("weight",)

    def weight_term(self, grads: torch.Tensor, inputs: torch.Tensor) -> OuterTerm | SampleTerm:
        return outer_product_term(left=grads, right=inputs)  # weight is [out, in]

    def terms(self, module, saved, grad_output, trainable):
        batch = grad_output.shape[0]
        grads = as_sequence(grad_output, batch)
        out = {}
        if "weight" in trainable:
            out["weight"] = self.weight_term(grads, as_sequence(in_compute_dtype(saved, grad_output), batch))
        if "bias" in trainable:
            out["bias"] = SampleTerm(grads.sum(1))
        return out
