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


class PackedTokens:
    """Where each packed example's tokens lie in the row: `split` turns [1, tokens, ...] into [examples, longest,
    ...]."""

    def __init__(self, lengths: Sequence[int] | torch.Tensor) -> None:
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if lengths.dim() != 1 or not bool((lengths > 0).all()):
            raise ValueError(f"Packed examples need one length >= 1 each, got {lengths.tolist()}.")
        self.lengths = lengths
        self.tokens = int(lengths.sum())
        longest = int(lengths.max()) if lengths.numel() else 0
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        steps = torch.arange(longest)
        self._valid = steps < lengths[:, None]  # [examples, longest]: a token of the example, not padding
        self._index = torch.where(self._valid, offsets[:, None] + steps, 0)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def examples(self) -> int:
        return int(self.lengths.numel())

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is laid out as the packed row: [1, tokens, ...]."""
        return tensor.dim() >= 2 and tensor.shape[0] == 1 and tensor.shape[1] == self.tokens

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """[1, tokens, ...] → [examples, longest, ...], zero after each example's last token."""
        if tensor.device not in self._on:
            self._on[tensor.device] = (self._index.to(tensor.device), self._valid.to(tensor.device))
        index, valid = self._on[tensor.device]
        gathered = tensor[0][index]  # a new tensor: zeroed in place after each example's end
        return gathered.masked_fill_(~valid.view(*valid.shape, *([1] * (gathered.dim() - 2))), 0)
