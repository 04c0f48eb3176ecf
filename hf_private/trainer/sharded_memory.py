"""What one process holds of a run's training state: the bytes of its parameters and of its optimizer state, the
memory FSDP2 divides among the processes (a sharded parameter counts only its local shard, as allocated)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class TrainingStateBytes:
    """Bytes this process holds: `parameters` (every weight, trainable or frozen) and `optimizer` (its state, such
    as Adam's two moments), each storage counted once."""

    parameters: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainingStateBytes:
    """The parameter and optimizer-state bytes this process allocates. A DTensor's are its local tensor's storage
    (FSDP2 pads a shard to ⌈rows / processes⌉ rows: the padding counts, it is memory too); a storage two tensors share
    (tied weights) counts once. Gradients are left out: between steps a private run holds none."""
    seen: set[int] = set()
    return TrainingStateBytes(
        parameters=_storage_bytes(model.parameters(), seen),
        optimizer=_storage_bytes(_tensors(optimizer.state.values()), seen),
    )


def _tensors(states: Iterable[dict]) -> Iterable[torch.Tensor]:
    for state in states:
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
