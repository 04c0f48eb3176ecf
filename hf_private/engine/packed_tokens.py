"""A packed row's tokens regathered one example per row, so every layer rule sees an ordinary padded chunk.

An example's gradient on any layer is a sum over its own tokens, so the per-example terms of a packed row (examples
laid end to end, `hf_private.packing`) are the terms of the same examples padded one per row: each layer's input and
output gradient are gathered into [examples, longest example, ...] with zeros after each example's end, which add
nothing to a norm, a cross term or a sum. Only the norm and sum computations see the padding (of the chunk's longest
example); the forward and backward passes see none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .terms import padded_by_unit, unit_slots


class PackedTokens:
    """Where each packed example's tokens lie in the row: `split` turns [1, tokens, ...] into [examples, longest,
    ...], each token a row of its example as `terms.group_rows` groups rows into units."""

    def __init__(self, lengths: Sequence[int] | torch.Tensor) -> None:
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if lengths.dim() != 1 or not bool((lengths > 0).all()):
            raise ValueError(f"Packed examples need one length >= 1 each, got {lengths.tolist()}.")
        self.lengths = lengths
        self.tokens = int(lengths.sum())
        self._sizes = tuple(lengths.tolist())
        self._slots: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # owner and slot of every token

    @property
    def examples(self) -> int:
        return len(self._sizes)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is laid out as the packed row: [1, tokens, ...]."""
        return tensor.dim() >= 2 and tensor.shape[0] == 1 and tensor.shape[1] == self.tokens

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """[1, tokens, ...] → [examples, longest, ...], zero after each example's last token."""
        if tensor.device not in self._slots:
            self._slots[tensor.device] = unit_slots(self._sizes, tensor.device)
        owner, slot = self._slots[tensor.device]
        return padded_by_unit(tensor[0].unsqueeze(1), owner, slot, self.examples, max(self._sizes))
