"""DP-FROST's partitions (methods_spec §2.1): one per module that owns parameters (a weight matrix with its bias, an
embedding table, a norm's gain and bias, the head's layers); a tensor tied between modules belongs to the first."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Partition:
    name: str  # the owning module's name ("" for parameters of the model itself)
    parameter_names: tuple[str, ...]
    size: int  # |P|: its number of values


def model_partitions(model: nn.Module) -> list[Partition]:
    """Every parameter of `model` in exactly one partition, in module order."""
    seen: set[nn.Parameter] = set()
    partitions = []
    for module_name, module in model.named_modules():
        names, size = [], 0
        for param_name, param in module.named_parameters(recurse=False):
            if param in seen:
                continue
            seen.add(param)
            names.append(f"{module_name}.{param_name}" if module_name else param_name)
            size += param.numel()
        if names:
            partitions.append(Partition(module_name, tuple(names), size))
    return partitions
