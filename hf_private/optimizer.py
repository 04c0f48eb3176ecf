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
        for param, total in zip(params, totals):
            if distributed:
                dist.all_reduce(total, op=dist.ReduceOp.SUM)
            param.grad = total.div_(self.expected_batch_size).to(param.dtype)
        self.optimizer.step()
        self.on_step()
        return None
