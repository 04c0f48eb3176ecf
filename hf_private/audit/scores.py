"""How a trained model is scored on each token canary: white-box (its embedding row's movement) and black-box (its
loss). Gradient canaries' white-box score is read during training (`gradient_canaries`).

The scores read a trainer's model, collator and per-example loss (any object with those attributes); they never
train, so the library does not depend on the trainer class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..models.support import with_decoder_inputs
from .canaries import input_embedding

WHITE_BOX = "white-box"
WHITE_BOX_GRADIENT = "white-box-gradient"
BLACK_BOX = "black-box"
SCORE_HELP = {
    WHITE_BOX: "movement of the canary's own embedding row along its initial descent direction",
    WHITE_BOX_GRADIENT: "the canary's secret coordinate in every step's released noisy gradient, summed and signed "
    "(a gradient of norm 10⁶·C inserted when the canary is sampled)",
    BLACK_BOX: "decrease of the canary's loss from the initial to the trained model",
}


def _batches(trainer, rows: list[dict[str, Any]], batch_size: int = 64):
    for start in range(0, len(rows), batch_size):
        batch = trainer.data_collator(rows[start : start + batch_size])
        batch = {k: v.to(trainer.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        labels = batch.pop("labels")
        batch.pop("label", None)
        yield with_decoder_inputs(trainer.model, batch, labels), labels  # a seq2seq decoder reads its own target


def _in_eval_mode(function):
    def wrapper(trainer, *args, **kwargs):
        was_training = trainer.model.training
        trainer.model.eval()
        try:
            return function(trainer, *args, **kwargs)
        finally:
            trainer.model.train(was_training)

    return wrapper


@_in_eval_mode
@torch.no_grad()
def canary_losses(trainer, rows: list[dict[str, Any]]) -> torch.Tensor:
    """Per-canary loss under the trainer's own collator and per-example loss (the black-box view)."""
    model = trainer.model
    return torch.cat(
        [
            trainer.per_example_loss(model, model(**batch), labels).float().cpu()
            for batch, labels in _batches(trainer, rows)
        ]
    )


@_in_eval_mode
def canary_descent_directions(trainer, rows: list[dict[str, Any]], token_ids: Sequence[int]) -> torch.Tensor:
    """−∇ of each canary's loss w.r.t. its own embedding row at the initial (public) weights, unit length.

    Only canary i uses token i, so one gradient of the summed loss holds every canary's own row gradient. The
    white-box score projects the row's movement on this direction: with the noise spread over d coordinates,
    a projection keeps the signal and 1/d of the noise variance.
    """
    model = trainer.model
    weight = input_embedding(model).weight
    total = torch.zeros_like(weight, dtype=torch.float32)
    for batch, labels in _batches(trainer, rows):
        loss = trainer.per_example_loss(model, model(**batch), labels).sum()
        total += torch.autograd.grad(loss, weight)[0].float()
    directions = -total[list(token_ids)].cpu()
    return directions / directions.norm(dim=1, keepdim=True).clamp(min=1e-30)


def canary_rows(model: nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """A float copy of the canaries' own embedding rows: the white-box score compares them before and after."""
    return input_embedding(model).weight.detach()[list(token_ids)].float().cpu().clone()
