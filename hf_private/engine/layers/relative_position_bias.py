"""T5's relative attention bias: an embedding looked up with [query, key] position buckets that every example shares.

The bias `compute_bias(q, k)` is [1, heads, q, k]: it is added to every example's attention scores by broadcasting,
so autograd sums its gradient over the batch before any hook on the embedding could see it. Each example's gradient
is still well defined: row `k` of example b's gradient is the sum of ∂ℓ_b/∂scores_b over that example's (head,
query, key) cells whose bucket is k. To obtain ∂ℓ_b/∂scores_b the rule sits on the attention module that owns the
embedding (its first layer's self-attention), not on the embedding:

* before that module's forward, the bias is computed by the module's own `compute_bias` and passed in already
  expanded to the chunk's rows ([rows, heads, q, k], a view: no copy). T5 uses a `position_bias` it is given, returns
  it, and every later layer of the stack reuses it, so all uses reach this one tensor;
* its gradient, summed over every layer that used it, arrives per example; the per-example bucket sums are a
  [rows, buckets, heads] gradient (small: buckets × heads values per example).

The buckets are the ids the module itself looks up (read off its embedding's input), never recomputed here. A call
this rule does not expect (a bias already given, a cache holding past tokens) is refused, never replayed.
"""

from __future__ import annotations

import torch
from transformers.models.mt5.modeling_mt5 import MT5Attention
from transformers.models.t5.modeling_t5 import T5Attention

from ..terms import SampleTerm
from .base import LayerHandler, UnsupportedLayerError
from .registry import register_layer

_BIAS = "relative_attention_bias"


@register_layer(T5Attention, MT5Attention)
class RelativePositionBiasHandler(LayerHandler):
    """The relative attention bias of a T5 attention module, claimed by that module (its child embedding's weight)."""

    rule = "relative position bias (per-example bucket sums)"
    params = (f"{_BIAS}.weight",)
    input_params = params  # the bucket ids are read whenever the bias trains

    def check(self, module, trainable):
        if not getattr(module, "has_relative_attention_bias", False):
            raise UnsupportedLayerError(f"{type(module).__name__} has no {_BIAS} to train.")

    def before_forward(self, module, args, kwargs, rows):
        """Hand the module its own bias, expanded to the chunk's rows, so that its gradient stays per example."""
        if kwargs.get("position_bias") is not None or len(args) != 1 or kwargs.get("key_value_states") is not None:
            raise UnsupportedLayerError(
                f"{type(module).__name__} was called with a position bias, positional arguments or key/value states "
                f"of its own: its {_BIAS} is only supported in T5's self-attention, where the module computes the "
                f"bias itself. Freeze {_BIAS} (requires_grad=False) or train the model with LoRA."
            )
        cache = kwargs.get("cache")
        past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
        if past:
            raise UnsupportedLayerError(
                f"{type(module).__name__} was called with {past} cached tokens while recording a training chunk: "
                "per-example gradients are computed for a forward pass over whole examples, without a cache."
            )
        length = args[0].shape[1]
        bias = module.compute_bias(length, length, device=args[0].device)
        if not bias.requires_grad:  # the parameters are frozen while a chunk is recorded: start the graph here
            bias = bias.detach().requires_grad_(True)
        return args, {**kwargs, "position_bias": bias.expand(rows, -1, -1, -1)}

    def on_forward(self, module, args, kwargs, output, rows, save_input):
        bias = kwargs["position_bias"]
        if output[1] is not bias:
            raise UnsupportedLayerError(
                f"{type(module).__name__} did not use the position bias it was given: the per-example gradient of its "
                f"{_BIAS} cannot be read. Freeze {_BIAS} (requires_grad=False) or train the model with LoRA."
            )
        return _bucket_ids(module, *bias.shape[-2:]), bias

    def terms(self, module, saved, grad_output, trainable):
        rows, heads = grad_output.shape[:2]
        dtype = torch.promote_types(grad_output.dtype, torch.float32)  # many cells per bucket: sum in ≥ fp32
        cells = grad_output.to(dtype).permute(0, 2, 3, 1).reshape(rows, -1, heads)  # [rows, q·k, heads]
        sums = cells.new_zeros(rows, getattr(module, _BIAS).num_embeddings, heads)
        return {f"{_BIAS}.weight": SampleTerm(sums.index_add_(1, saved.reshape(-1), cells))}


def _bucket_ids(module: T5Attention | MT5Attention, query_length: int, key_length: int) -> torch.Tensor:
    """The [q, k] bucket ids the module's `compute_bias` looks up, read off its embedding's input."""
    seen: list[torch.Tensor] = []
    embedding = module.relative_attention_bias
    handle = embedding.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0]))
    try:
        with torch.no_grad():
            module.compute_bias(query_length, key_length, device=embedding.weight.device)
    finally:
        handle.remove()
    return seen[0]
