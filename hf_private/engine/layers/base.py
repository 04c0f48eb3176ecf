"""What a layer handler answers: which parameters it knows, what it must save, and its per-example terms."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..terms import Term


class UnsupportedLayerError(TypeError):
    """A trainable parameter lives where per-example gradients cannot be computed exactly."""


class LayerHandler:
    #: the rule's name in the plan log ("linear", "embedding", ...): which rule each module uses, counted
    rule: str = "dedicated"
    #: parameter names (as in `module._parameters`) whose per-example gradient this handler computes
    params: tuple[str, ...] = ()
    #: parameters whose gradient needs the layer input (so the input is stored only when one is trainable)
    input_params: tuple[str, ...] = ()
    #: why the rule cannot separate examples packed end to end in rows (its module sees the chunk's tokens flattened,
    #: without the rows' token axis), or None; a packed chunk reaching the module is refused with this reason
    packed_refusal: str | None = None
    #: the rule computes the module's output itself while a chunk is recorded (`forward`), so that it can watch
    #: tensors inside it: its `on_forward` may then watch a tensor that is not the output
    owns_forward: bool = False

    def check(self, module: nn.Module, trainable: set[str]) -> None:
        """Raise `UnsupportedLayerError` for a configuration whose per-example gradient would be wrong."""

    def claimed(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable parameters of the module's descendants this rule computes in their modules' place (they are
        used only inside this module's forward), by name inside the module: by default those of `params` with a dot."""
        return {n: p for n, p in module.named_parameters() if "." in n and n in self.params and p.requires_grad}

    def needs_input(self, trainable: set[str]) -> bool:
        return any(name in trainable for name in self.input_params)

    def before_forward(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any], rows: int
    ) -> tuple[tuple, dict[str, Any]] | None:
        """New (args, kwargs) for the module's forward while a chunk is recorded, or None to leave them.

        For a rule that must give a tensor the chunk's rows before the module first uses it (T5's relative position
        bias, broadcast over the batch inside the forward). The engine installs it only where a rule overrides it.
        """
        return None

    def forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The module's output while a chunk is recorded, for a rule that `owns_forward`: the same function as the
        module's own forward (the rule's check compares them), computed so that the terms need no replay."""
        raise NotImplementedError

    def on_forward(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any, rows: int, save_input: bool
    ) -> tuple[Any, torch.Tensor]:
        """Return (what to keep for backward: a tensor, a structure of tensors or None; the output tensor to watch).

        The watched tensor may replace a tensor output (an expanded broadcast), or be one element of a tuple output
        (a router's logits). `rows`: the chunk's row count (examples × rows per example), to which a broadcast input
        is expanded.
        """
        return (args[0] if save_input else None), output

    def terms(self, module: nn.Module, saved: Any, grad_output: torch.Tensor, trainable: set[str]) -> dict[str, Term]:
        raise NotImplementedError


def as_sequence(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """View [B, ..., F] as [B, T, F] (T = 1 for [B, F]), refusing tensors without a per-example batch dim."""
    if tensor.dim() < 2 or tensor.shape[0] != batch_size:
        raise UnsupportedLayerError(
            f"Expected a per-example batch dimension of size {batch_size}, got a tensor of shape "
            f"{tuple(tensor.shape)}: this layer mixes examples, so per-example gradients are undefined."
        )
    return tensor.reshape(batch_size, -1, tensor.shape[-1])
