"""BART's learned positional embedding: an `nn.Embedding` subclass that looks up positions, not the ids it is given.

`BartLearnedPositionalEmbedding.forward(input_ids, cache_length, position_ids)` reads only the shape of `input_ids`
and looks up `position + offset` (offset 2). The encoder's positions are expanded to the batch; the decoder passes
`position_ids` of one row ([1, T]), so the output is broadcast over the examples and its gradient summed over them
unless the output is expanded to the chunk's rows first (as the embedding rule does for [1, T] ids). Each example's
gradient is the embedding rule's on the positions the forward looked up, rebuilt here from the same arguments.
MBart, PLBart and MVP carry a copy of the same class.
"""

from __future__ import annotations

import torch
from transformers.models.bart.modeling_bart import BartLearnedPositionalEmbedding
from transformers.models.mbart.modeling_mbart import MBartLearnedPositionalEmbedding
from transformers.models.mvp.modeling_mvp import MvpLearnedPositionalEmbedding
from transformers.models.plbart.modeling_plbart import PLBartLearnedPositionalEmbedding

from .embedding import EmbeddingHandler
from .registry import register_layer


@register_layer(
    BartLearnedPositionalEmbedding,
    MBartLearnedPositionalEmbedding,
    MvpLearnedPositionalEmbedding,
    PLBartLearnedPositionalEmbedding,
)
class LearnedPositionsHandler(EmbeddingHandler):
    rule = "learned positions (offset lookup)"

    def on_forward(self, module, args, kwargs, output, rows, save_input):
        positions = _looked_up_positions(*args, **kwargs) + module.offset
        return super().on_forward(module, (positions,), {}, output, rows, save_input)


def _looked_up_positions(
    input_ids: torch.Tensor, cache_length: int = 0, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The positions `forward` looks up (before its offset), from its own arguments: [B, T] counted from the cache's
    length, or the given [T] as [1, T]."""
    if position_ids is None:
        batch, length = input_ids.shape[:2]
        return torch.arange(cache_length, cache_length + length, device=input_ids.device).expand(batch, -1)
    return position_ids.unsqueeze(0)
