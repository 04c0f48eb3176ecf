"""What a layer handler answers: which parameters it knows, what it must save, and its per-example terms."""

from __future__ import annotations

import torch
from torch import nn

from ..terms import Term


class UnsupportedLayerError(TypeError):
    """A trainable parameter lives where per-example gradients cannot be computed exactly."""


class LayerHandler:
    #: parameter names (as in `module._parameters`) whose per-example gradient this handler computes
    params: tuple[str, ...] = ()
    #: parameters whose gradient needs the layer input (so the input is stored only when one is trainable)
    input_params: tuple[str, ...] = ()
    #: the layer's other parameters, which have no rule: named in the supported-layer list so that it says exactly
    #: what of the layer may train (a trainable one is refused)
    refused: tuple[str, ...] = ()

    def check(self, module: nn.Module, trainable: set[str]) -> None:
        """Raise `UnsupportedLayerError` for a configuration whose per-example gradient would be wrong."""

    def needs_input(self, trainable: set[str]) -> bool:
        return any(name in trainable for name in self.input_params)

    def on_forward(
        self, module: nn.Module, args: tuple, output: torch.Tensor, rows: int, save_input: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Return (what to keep for backward, the output tensor to watch). May replace the output.

        `rows`: the chunk's row count (examples × rows per example), to which a broadcast input is expanded.
        """
        return (args[0] if save_input else None), output

    def terms(
        self, module: nn.Module, saved: torch.Tensor | None, grad_output: torch.Tensor, trainable: set[str]
    ) -> dict[str, Term]:
        raise NotImplementedError


def as_sequence(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """View [B, ..., F] as [B, T, F] (T = 1 for [B, F]), refusing tensors without a per-example batch dim."""
    if tensor.dim() < 2 or tensor.shape[0] != batch_size:
        raise UnsupportedLayerError(
            f"Expected a per-example batch dimension of size {batch_size}, got a tensor of shape "
            f"{tuple(tensor.shape)}: this layer mixes examples, so per-example gradients are undefined."
        )
    return tensor.reshape(batch_size, -1, tensor.shape[-1])
