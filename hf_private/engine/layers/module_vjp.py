"""The generic rule: any module's own per-example gradient, as a vector–Jacobian product of its forward alone.

For a module whose trainable parameters have no dedicated rule (a norm variant, a router, a small custom layer),
each example's gradient is the VJP of the module's own forward, replayed on that example's slice of the input the
forward hook saved, with the output gradient the backward hands the hook: `torch.func.vmap` over the examples of
`torch.func.grad`. The replay is exact only when the forward is a function of the example alone, so:

* vmap runs with `randomness="error"`: a forward that draws random numbers (dropout in train mode) cannot be
  replayed and is refused, never replayed with other draws;
* an input or output without the chunk's rows as its first dimension is never sliced (a broadcast tensor reaches
  every example whole), and a module that mixes examples is exposed by the engine's autograd sum check and the
  trainer's independence probe (one example alone), as for every rule;
* data-dependent control flow that vmap cannot batch is refused with vmap's own reason.

Each example's gradient is instantiated ([B, *parameter] per parameter), so the rule is for small modules: a module
whose trainable parameters hold more than `MAX_PARAMETERS` elements is refused (freeze it, or train it with LoRA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..terms import SampleTerm
from .base import LayerHandler, UnsupportedLayerError

#: the largest module (trainable elements) whose per-example gradients the generic rule instantiates
MAX_PARAMETERS = 1 << 22


class ModuleVJPHandler(LayerHandler):
    """The generic rule for one module, with the names of its trainable parameters."""

    rule = "generic (per-example VJP of the module's forward)"

    def __init__(self, params: tuple[str, ...]) -> None:
        self.params = params
        self.input_params = params  # every parameter's gradient needs the inputs

    def check(self, module: nn.Module, trainable: set[str]) -> None:
        own = dict(module.named_parameters(recurse=False))
        size = sum(own[name].numel() for name in trainable)
        if size > MAX_PARAMETERS:
            raise UnsupportedLayerError(
                f"{type(module).__name__} has no dedicated per-example gradient rule, and its trainable parameters "
                f"{sorted(trainable)} hold {size:,} elements: the generic rule would hold a copy per example (at most "
                f"{MAX_PARAMETERS:,}). Freeze them (requires_grad=False) or train the model with LoRA."
            )

    def on_forward(self, module, args, kwargs, output, rows, save_input):
        if not isinstance(output, torch.Tensor):
            raise UnsupportedLayerError(
                f"{type(module).__name__} returns a {type(output).__name__}, not a tensor: the generic per-example "
                "gradient rule replays modules with one output tensor. Freeze its parameters (requires_grad=False) or "
                "train the model with LoRA."
            )
        if output.dim() == 0 or output.shape[0] != rows:
            raise UnsupportedLayerError(
                f"{type(module).__name__}'s output has shape {tuple(output.shape)} in a chunk of {rows} rows: its rows "
                "are not the chunk's (a module that sees flattened tokens, as an unregistered mixture-of-experts "
                "layer does, or a batch-wide tensor), so the generic per-example gradient rule cannot replay it one "
                "example at a time. Freeze its parameters (requires_grad=False) or train the model with LoRA."
            )
        return (args, kwargs), output

    def terms(self, module, saved, grad_output, trainable):
        args, kwargs = saved
        rows = grad_output.shape[0]
        leaves, spec = tree_flatten((args, kwargs))
        sliced = [i for i, leaf in enumerate(leaves) if _has_rows(leaf, rows)]
        names = sorted(trainable)
        params = {name: module._parameters[name].detach() for name in names}

        def example_loss(params: dict[str, torch.Tensor], inputs: list[torch.Tensor], out_grad: torch.Tensor):
            example = list(leaves)
            for i, tensor in zip(sliced, inputs):
                example[i] = tensor.unsqueeze(0)
            ex_args, ex_kwargs = tree_unflatten(example, spec)
            out = functional_call(module, params, tuple(ex_args), ex_kwargs)
            return (out * out_grad.unsqueeze(0).to(out.dtype)).sum()

        per_example = vmap(grad(example_loss), in_dims=(None, 0, 0), randomness="error")
        try:
            grads = per_example(params, [leaves[i] for i in sliced], grad_output)
        except RuntimeError as error:
            raise UnsupportedLayerError(
                f"{type(module).__name__} has no dedicated per-example gradient rule and its forward cannot be "
                f"replayed one example at a time ({_first_line(error)}): a forward that draws random numbers "
                "(dropout in train mode) or branches on the data cannot be. Freeze its parameters "
                "(requires_grad=False) or train the model with LoRA."
            ) from error
        return {name: SampleTerm(grads[name]) for name in names}


def _has_rows(leaf: Any, rows: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
