"""`nn.Conv1d/2d/3d` biases (DP-BiTFiT on vision models): Σ over spatial positions of the output gradient.

A trainable conv weight has no dedicated rule: such a layer takes the generic rule (`module_vjp.py`) whole.
"""

from __future__ import annotations

from torch import nn

from ..terms import SampleTerm
from .base import LayerHandler
from .registry import register_layer


@register_layer(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvBiasHandler(LayerHandler):
    rule = "conv bias"
    params = ("bias",)

    def terms(self, module, saved, grad_output, trainable):
        return {"bias": SampleTerm(grad_output.flatten(2).sum(2))}
