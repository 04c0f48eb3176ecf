"""GPT-2's `Conv1D` (y = x W + b, W stored as [in, out]): the Linear rule with the factors swapped."""

from __future__ import annotations

from transformers.pytorch_utils import Conv1D

from ..terms import outer_product_term
from .linear import LinearHandler
from .registry import register_layer


@register_layer(Conv1D)
class Conv1DHandler(LinearHandler):
    rule = "Conv1D (factored)"

    def weight_term(self, grads, inputs):
        return outer_product_term(left=inputs, right=grads)  # weight is [in, out]
