"""The canaries: fresh vocabulary rows, and one training example per row that only it uses.

Everything about a canary (its embedding row, its label) comes from a fixed public seed; only whether it is included
in training is the auditor's secret. Dataset assembly lives here too, so the audit's input is built in one place.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data.users import user_ids
from ..models.peft import unwrap_peft

DESIGN_SEED = 2023  # public: the canaries' embedding rows and labels; only their inclusion is secret


def input_embedding(model: nn.Module) -> nn.Embedding:
    """The model's input embedding layer, where the canaries' tokens live: the audit needs an nn.Embedding."""
    embeddings = unwrap_peft(model).get_input_embeddings()
    if not isinstance(embeddings, nn.Embedding):
        raise ValueError(f"The audit needs an nn.Embedding input layer, got {type(embeddings).__name__}.")
    return embeddings


def add_canary_tokens(model: nn.Module, count: int, generator: torch.Generator) -> list[int]:
    """Append `count` fresh vocabulary rows (ids nothing in the data uses) and return their ids."""
    old = input_embedding(model).num_embeddings
    unwrap_peft(model).resize_token_embeddings(old + count, mean_resizing=False)
    weight = input_embedding(model).weight
    with torch.no_grad():
        scale = weight[:old].float().std().item()
        rows = torch.randn(count, weight.shape[1], generator=generator) * scale
        weight[old:] = rows.to(weight.dtype)
    return list(range(old, old + count))


def build_canaries(
    template: dict[str, Any],
    token_ids: Sequence[int],
    length: int,
    num_labels: int,
    rng: random.Random,
    users: Sequence[Any] = (),
) -> dict[str, list]:
    """Columns for one canary per token: the token repeated `length` times, a random (public) label; at user level
    (`users`: the user column's name first, then one new id per canary) each canary is a user of its own."""
    columns: dict[str, list] = {name: [] for name in template}
    user_column, *new_users = users or (None,)
    for i, token in enumerate(token_ids):
        ids = [token] * length
        for name, value in template.items():
            if name == user_column:
                columns[name].append(new_users[i])
            elif name == "input_ids":
                columns[name].append(ids)
            elif name == "attention_mask":
                columns[name].append([1] * length)
            elif name == "token_type_ids":
                columns[name].append([0] * length)
            elif name in ("label", "labels") and isinstance(value, int | np.integer):
                columns[name].append(rng.randrange(num_labels))
            elif name == "labels" and isinstance(value, list):
                columns[name].append(list(ids))  # language modelling: the canary predicts itself
            else:
                raise ValueError(
                    f"Cannot build a canary for dataset column {name!r}: the audit knows input_ids, attention_mask, "
                    "token_type_ids and an integer label(s) column (or LM labels). Drop other columns first."
                )
    if "input_ids" not in columns:
        raise ValueError("The audit needs a tokenized dataset with an input_ids column.")
    return columns


def canary_dataset(
    train_dataset,
    token_ids: Sequence[int],
    length: int,
    num_labels: int,
    rng: random.Random,
    user_column: str | None = None,
):
    """All canaries as a `datasets.Dataset` with the training set's features, so the two concatenate. At user level
    every canary is a new user (an id no training example has), as the unit the audit tests is a user."""
    from datasets import Dataset

    users: tuple = ()
    if user_column is not None:
        taken = set(user_ids(train_dataset, user_column))  # as the trainer reads them: 0-d tensors are integers
        numbers = {u for u in taken if isinstance(u, int)}
        if numbers == taken:
            start = max(numbers) + 1
            users = (user_column, *range(start, start + len(token_ids)))
        else:
            users = (user_column, *(f"audit-canary-{i}" for i in range(len(token_ids))))
            if taken & set(users[1:]):
                raise ValueError("The training set's users already include audit canary ids (audit-canary-<i>).")
    columns = build_canaries(train_dataset[0], token_ids, length, num_labels, rng, users)
    return Dataset.from_dict(columns, features=train_dataset.features)


def with_canaries(train_dataset, canary_set, included: torch.Tensor):
    """The training set plus the included canaries (the auditor's secret draw), appended after it."""
    from datasets import concatenate_datasets

    chosen = torch.nonzero(included).flatten().tolist()
    return concatenate_datasets([train_dataset, canary_set.select(chosen)]) if chosen else train_dataset
