"""FSDP2's dim-0 layout (`fully_shard`: each trainable parameter a DTensor, dim 0 split across processes), and the
engine's first-chunk check against autograd on it.

The DP-SGD reducer reduce-scatters each chunk's clipped sums to this layout (`reduce_scatter_to_shard`); the engine's
check does the same with its unclipped sums and compares each process's shard with the shard FSDP2 reduced, scaled
back from FSDP2's mean to a sum. Every number a verdict depends on is summed over the processes first, so all of them
raise the same error together: none is left waiting in a collective another one has abandoned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard


def is_sharded(params: Iterable[torch.Tensor]) -> bool:
    """Whether the trainable parameters are FSDP2 shards (DTensors); a mix of sharded and whole ones is refused."""
    params = list(params)
    sharded = [isinstance(p, DTensor) for p in params]
    if any(sharded) and not all(sharded):
        raise NotImplementedError(
            f"{sum(sharded)} of {len(params)} trainable parameters are sharded (DTensor) and the others are not: apply "
            "fully_shard so that it covers every trainable parameter (e.g. to each decoder layer and the root model)."
        )
    return bool(sharded) and all(sharded)


def _sharded(param: torch.Tensor) -> DTensor:
    if not isinstance(param, DTensor):
        raise TypeError(f"A parameter of shape {tuple(param.shape)} is not sharded (not a DTensor).")
    return param


def dim0_shard(param: torch.Tensor) -> tuple[int, int, int]:
    """This process's rows [start, end) of dim 0 of `param` under FSDP2's layout, and the rows each process holds once
    padded (⌈rows / world⌉, as torch.chunk cuts): where a reduce-scatter must cut the full tensor."""
    param = _sharded(param)
    mesh = param.device_mesh
    if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),) or param.dim() == 0:
        raise NotImplementedError(
            f"A parameter of shape {tuple(param.shape)} is laid out as {tuple(param.placements)} on a {mesh.ndim}-D "
            "mesh: only FSDP2's one-dimensional Shard(0) layout is supported (not HSDP or tensor parallelism yet)."
        )
    rows, world = param.shape[0], mesh.size()
    per_rank = -(-rows // world)
    start = min(mesh.get_local_rank() * per_rank, rows)
    end = min(start + per_rank, rows)
    if param.to_local().shape[0] != end - start:
        raise RuntimeError(
            f"A parameter of shape {tuple(param.shape)} holds {param.to_local().shape[0]} rows here where FSDP2's "
            f"layout gives rows [{start}, {end}): its shard is not the one the reduce-scatter would deliver."
        )
    return start, end, per_rank


def reduce_scatter_to_shard(total: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Σ over processes of `total` (this process's full-shape sum for `param`), keeping only this process's rows: one
    reduce-scatter along FSDP2's dim-0 layout, the full tensor zero-padded to ⌈rows / world⌉ rows a process."""
    start, end, per_rank = dim0_shard(param)
    mesh = _sharded(param).device_mesh
    world = mesh.size()
    padded = total
    if per_rank * world != total.shape[0]:
        padded = total.new_zeros((per_rank * world, *total.shape[1:]))
        padded[: total.shape[0]] = total
    shard = total.new_empty((per_rank, *total.shape[1:]))
    dist.reduce_scatter_single(shard, padded.contiguous(), op=dist.ReduceOp.SUM, group=mesh.get_group())
    return shard[: end - start].contiguous()


class ShardedCheck:
    """The collectives of the engine's check against autograd when its parameters are FSDP2 shards: every number a
    verdict depends on is summed over the processes, so that each of them decides alike."""

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor]) -> None:
        mesh = _sharded(params[0]).device_mesh
        self.model = model
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.device = torch.device(mesh.device_type)  # where the process group's collectives run
        self._divide_factors: dict[torch.Tensor, float] | None = None

    def sum_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the processes, in float64 on the CPU."""
        summed = values.double().to(self.device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
        return summed.cpu()

    def anywhere(self, flags: list[bool]) -> list[bool]:
        """Each flag: whether it holds on some process."""
        if not flags:
            return []
        return [bool(count > 0) for count in self.sum_over_processes(torch.tensor(flags)).tolist()]

    def everywhere(self, flag: bool) -> bool:
        """Whether `flag` holds on every process."""
        return not self.anywhere([not flag])[0]

    def shards(self, ours: torch.Tensor, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this process's shard of Σ over processes of `ours`, its shard of autograd's gradient summed likewise).

        FSDP2 reduce-scatters a gradient divided by its parameter group's `gradient_divide_factor` (set by
        `set_gradient_divide_factor`; transformers sets the data-parallel size), by default by the world size (a
        mean): multiplying by that factor gives the sum back."""
        ours = reduce_scatter_to_shard(ours, param)
        if param.grad is None:
            return ours, torch.zeros_like(ours)
        if self._divide_factors is None:
            self._divide_factors = _gradient_divide_factors(self.model)
        factor = self._divide_factors.get(param, self.world)
        return ours, _local(param.grad).to(ours.dtype) * factor

    def summed_norms(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor | float]]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, bool]], torch.Tensor]:
        """From each parameter's (our shard, autograd's shard, low precision here, Σ_rows ‖g_row‖ here): its
        (‖ours − autograd‖, ‖autograd‖ + Σ_rows ‖g_row‖, low precision anywhere) over the whole tensors and every
        process, and ‖autograd's gradient‖ over every parameter: the numbers the one-process check compares."""
        local = torch.tensor(
            [
                [(o - r).double().pow(2).sum().item(), r.double().pow(2).sum().item(), float(s), float(low)]
                for o, r, low, s in pairs
            ],
            dtype=torch.float64,
        ).reshape(len(pairs), 4)
        errors, references, summands, low_precision = self.sum_over_processes(local).unbind(1)
        norms = [
            (e.sqrt(), r.sqrt() + s, bool(low > 0)) for e, r, s, low in zip(errors, references, summands, low_precision)
        ]
        return norms, references.sum().sqrt()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_parts(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's part held by this process (a DTensor's local shard, a plain tensor itself)."""
    return [_local(t) for t in tensors]


def _gradient_divide_factors(model: nn.Module) -> dict[torch.Tensor, float]:
    """Sharded parameter → the factor FSDP2 divides its reduced gradient by, where one was set (None: the world size).

    FSDP2 exposes no getter: the factor lives on each FSDP module's parameter groups (torch 2.13's private state,
    `FSDPParamGroup.gradient_divide_factor`). Where that state is not found the world size is assumed: a factor set
    otherwise then fails the check loudly, never passes it."""
    factors: dict[torch.Tensor, float] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            groups = module._get_fsdp_state()._fsdp_param_groups
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    if group.gradient_divide_factor is not None:
                        factors[fsdp_param.sharded_param] = float(group.gradient_divide_factor)
        except AttributeError:
            continue
    return factors
