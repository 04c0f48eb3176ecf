"""GPT-2's `Conv1D` (y = x W + b, W stored as [in, out]): the Linear rule with the factors swapped."""

from __future__ import annotations

from transformers.pytorch_utils import Conv1D

from ..terms import OuterTerm, SampleTerm
from .base import LayerHandler, as_sequence
from .registry import register_layer


@register_layer(Conv1D)
class Conv1DHandler(LayerHandler):
    params = ("weight", "bias")
    input_params = ("weight",)

    def terms(self, module, saved, grad_output, trainable):
        batch = grad_output.shape[0]
        grads = as_sequence(grad_output, batch)
        out = {}
        if "weight" in trainable:
            out["weight"] = OuterTerm(left=as_sequence(saved, batch), right=grads)
        if "bias" in trainable:
            out["bias"] = SampleTerm(grads.sum(1))
        return out
