"""A packed chunk's tokens regathered one example per row, so every layer rule sees an ordinary padded chunk.

An example's gradient on any layer is a sum over its own tokens, so the per-example terms of packed rows (examples
laid end to end, `data/packing.py`) are the terms of the same examples padded one per row: each layer's input and
output gradient are gathered into [examples, longest example, ...] with zeros after each example's end, which add
nothing to a norm, a cross term or a sum. A row's own padding (rows of one forward are padded to the longest) belongs
to no example and is left out. The per-example norms see each example padded to the chunk's longest; the clipped sums
of factored terms run over the examples' own tokens (`PackedOuterTerm`), and the forward and backward passes see only
the rows' padding.
"""

from __future__ import annotations

import torch

from ..data.packing import PackedLayout
from .terms import OuterTerm, PackedOuterTerm, Term, padded_by_unit, unit_slots


class PackedTokens:
    """Where each packed example's tokens lie in the rows: `split` turns [rows, width, ...] into [examples, longest,
    ...], each token a row of its example as `terms.group_rows` groups rows into units."""

    def __init__(self, layout: PackedLayout) -> None:
        self.layout = layout
        self._sizes = tuple(layout.lengths.tolist())
        self._slots: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # owner and slot of every token
        self._real: dict[torch.device, torch.Tensor] = {}  # [examples, longest]: each example's own tokens

    @property
    def examples(self) -> int:
        return self.layout.examples

    @property
    def tokens(self) -> int:
        return self.layout.tokens

    @property
    def rows(self) -> int:
        return self.layout.rows

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is laid out as the packed rows: [rows, width, ...]."""
        return self.layout.holds(tensor)

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, width, ...] → [examples, longest, ...], zero after each example's last token."""
        device = tensor.device
        if device not in self._slots:
            self._slots[device] = unit_slots(self._sizes, device)
        if self.layout.rows == 1:  # one row holds no padding: its tokens are the examples'
            tokens = tensor[0]
        else:
            tokens = tensor.flatten(0, 1).index_select(0, self.layout.token_index(device))
        owner, slot = self._slots[device]
        return padded_by_unit(tokens.unsqueeze(1), owner, slot, self.examples, max(self._sizes))

    def marked(self, terms: dict[str, Term]) -> dict[str, Term]:
        """The terms of a split layer, each factored one marked with its examples' own tokens (`PackedOuterTerm`)."""
        longest = max(self._sizes)
        if min(self._sizes) == longest:
            return terms  # no example is padded
        return {
            name: self._marked(term)
            if type(term) is OuterTerm and tuple(term.left.shape[:2]) == (self.examples, longest)
            else term
            for name, term in terms.items()
        }

    def _marked(self, term: OuterTerm) -> PackedOuterTerm:
        device = term.left.device
        if device not in self._real:
            self._real[device] = torch.arange(max(self._sizes), device=device) < self.layout.lengths.to(device)[:, None]
        return PackedOuterTerm(left=term.left, right=term.right, real=self._real[device])
