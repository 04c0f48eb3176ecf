"""Unit masks from weights alone (methods_spec §4.3-4.4): the ⌊p·m⌋ rows with the smallest Σ_j|W_ij| and the ⌊p·n⌋
columns with the smallest Σ_i|W_ij| of a weight W [out, in]. Rows align with the left factor's rows (LoRA `lora_B`,
RGP `left`: output features), columns with the right factor's columns (`lora_A`, `right`: input features).

A masked coordinate gets a zero per-example term before the norm (`engine.add_term_transform`), its noisy gradient is
zeroed and its value restored after the inner step, so it never changes (weight decay and Adam state included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ...engine import terms


def smallest_units(importance: torch.Tensor, sparsity: float) -> torch.Tensor:
    """A bool mask, True for the ⌊p·len⌋ entries of `importance` with the smallest values (ties: lower index first)."""
    count = math.floor(sparsity * importance.numel())
    mask = torch.zeros(importance.numel(), dtype=torch.bool, device=importance.device)
    mask[torch.argsort(importance, stable=True)[:count]] = True
    return mask


def unit_masks(weight_out_in: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(row mask [out], column mask [in]) of a weight laid out [out, in]; True = masked."""
    magnitude = weight_out_in.detach().abs().to(torch.float64)
    return smallest_units(magnitude.sum(1), sparsity), smallest_units(magnitude.sum(0), sparsity)


@dataclass
class MaskedFactor:
    """A low-rank factor and the mask of its rows (dim 0, left factors) or columns (dim 1, right factors)."""

    param: nn.Parameter
    dim: int
    mask: torch.Tensor
    keep_values: bool = True  # restore masked values after the step (False: RGP's carriers, recomputed anyway)
    _saved: torch.Tensor | None = field(default=None, repr=False)

    def coordinate_mask(self) -> torch.Tensor:
        return self.mask.view(-1, 1) if self.dim == 0 else self.mask.view(1, -1)

    @property
    def masked_coordinates(self) -> int:
        other = self.param.shape[1 - self.dim]
        return int(self.mask.sum()) * other

    def mask_term(self, term):
        """Every example's gradient with the masked rows/columns zero (before the norm)."""
        return terms.zero_rows(term, self.mask) if self.dim == 0 else terms.zero_columns(term, self.mask)

    def mask_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The noisy gradient with masked coordinates zero; remembers their values for `restore`."""
        where = self.coordinate_mask().expand_as(self.param)
        if self.keep_values:
            self._saved = self.param.detach()[where].clone()
        return grad.masked_fill(where, 0.0)

    def restore(self) -> None:
        """Put the masked coordinates back to their value before the inner step (weight decay, Adam momentum)."""
        if self._saved is not None:
            with torch.no_grad():
                self.param[self.coordinate_mask().expand_as(self.param)] = self._saved
            self._saved = None
