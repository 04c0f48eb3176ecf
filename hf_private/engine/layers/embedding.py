"""`nn.Embedding`: each example's gradient touches only the rows of its own token ids.

Position and token-type ids are often broadcast ([1, T] for the whole batch); their output gradient would
then be summed over examples before any hook sees it, so the output is expanded to the batch first.
"""

from __future__ import annotations

from torch import nn

from ..terms import IndexTerm
from .base import LayerHandler, UnsupportedLayerError, as_sequence
from .registry import register_layer


@register_layer(nn.Embedding)
class EmbeddingHandler(LayerHandler):
    rule = "embedding rows"
    params = ("weight",)
    input_params = ("weight",)

    def check(self, module, trainable):
        if module.max_norm is not None:
            raise UnsupportedLayerError(
                "nn.Embedding(max_norm=...) renormalises its weight in place during forward; "
                "set max_norm=None to train it privately."
            )
        if module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                "nn.Embedding(scale_grad_by_freq=True) scales gradients by batch-wide token counts, which "
                "couples examples; set scale_grad_by_freq=False."
            )

    def on_forward(self, module, args, kwargs, output, rows, save_input):
        ids = args[0]
        if ids.dim() >= 1 and ids.shape[0] == 1 and rows > 1:
            ids = ids.expand(rows, *ids.shape[1:])
            output = output.expand(rows, *output.shape[1:])
        return ids, output

    def terms(self, module, saved, grad_output, trainable):
        batch = grad_output.shape[0]
        ids = saved.reshape(batch, -1)
        grads = as_sequence(grad_output, batch)
        if module.padding_idx is not None:
            grads = grads * (ids != module.padding_idx).unsqueeze(-1).to(grads.dtype)
        return {"weight": IndexTerm(index=ids, right=grads, num_rows=module.num_embeddings)}
