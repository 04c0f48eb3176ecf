"""Optimizer proxy: the only path from private data to the weights.

Trainer calls `step()` once per logical batch. The proxy takes the engine's clipped sums, all-reduces them
across processes, adds N(0, σ²C²) exactly once (on rank 0, before the reduction), divides by the expected
logical batch q·N, hands the result to the real optimizer as `.grad`, and tells the ledger a step happened.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .engine import PerExampleGradientEngine
from .privacy import GaussianNoise

_BUCKET_BYTES = 64 << 20


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sum every tensor over all processes, in place, in flat buckets of about 64 MB.

    One collective per bucket rather than per tensor: a gloo all-reduce costs milliseconds of latency each,
    which for a few hundred parameter tensors would dominate the step.
    """
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in [*tensors, None]:
        if bucket and (tensor is None or tensor.dtype != bucket[0].dtype or size >= _BUCKET_BYTES):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))
            bucket, size = [], 0
        if tensor is not None:
            bucket.append(tensor)
            size += tensor.numel() * tensor.element_size()


class NoisyOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer; proxies its state so LR schedulers, checkpoints and Accelerate see the real one."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: PerExampleGradientEngine,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        noise: GaussianNoise,
        may_step: Callable[[], bool],
        on_step: Callable[[], None],
    ) -> None:
        # No Optimizer.__init__: param_groups/state/defaults must stay the inner optimizer's own objects.
        self.optimizer = optimizer
        self.engine = engine
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.expected_batch_size = float(expected_batch_size)
        self.noise = noise
        self.may_step = may_step
        self.on_step = on_step

    # ------------------------------------------------------------------ proxying
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"NoisyOptimizer(σ={self.noise_multiplier:.4g}, C={self.max_grad_norm:g}, {self.optimizer!r})"

    # ------------------------------------------------------------------ the private step
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("NoisyOptimizer.step does not take a closure: gradients come from the DP engine.")
        if not self.may_step():
            self.engine.reset()  # budget exhausted: nothing computed from this batch is released
            return None
        sums = self.engine.pop_clipped_sums()
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        params = [p for _, p in self.engine.parameters]
        totals = [
            sums[p] if p in sums else torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32),
                                                  device=p.device)
            for p in params
        ]
        if not distributed or dist.get_rank() == 0:  # exactly once, before the reduction
            self.noise.add_(totals, self.noise_multiplier * self.max_grad_norm)
        if distributed:
            all_reduce_sum(totals)
        for param, total in zip(params, totals):
            param.grad = total.div_(self.expected_batch_size).to(param.dtype)
        self.optimizer.step()
        self.on_step()
        return None
