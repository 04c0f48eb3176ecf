"""Optimizer proxy: the only path from private data to the weights.

Trainer calls `step()` once per logical batch. The step is made of named parts, each a method a subclass may
override (as Opacus' DPOptimizer.pre_step):

1. `clipped_sums`: the engine's clipped sums, one fp32-or-wider tensor per trainable parameter (zeros where none);
2. `add_noise`: N(0, σ²C²) on every coordinate, exactly once (on rank 0, before the reduction);
3. `all_reduce`: the noisy sums summed over processes (so the result is Σ clipped + one noise draw);
4. `to_gradients`: divided by the expected logical batch q·N and cast to the parameter's dtype, as `.grad`;
5. `transform_gradients`: a method's per-parameter gradient transforms (e.g. zero masked coordinates of the noisy
   gradient): post-processing of the released value, the same on every process;
6. the pre-step hooks: a method may move released gradients between parameters (RGP: the noisy carrier gradients
   become the full weight's gradient), again post-processing, the same on every process;
7. the inner optimizer's step, then `on_step` (the ledger records the step), then the step-end hooks (e.g.
   RGP's re-decomposition), once per logical batch on every process.

Sharded parameters (FSDP2's `fully_shard`: DTensors, dim 0 split across processes) take steps 2-3 the other way round:
the engine has already reduce-scattered each chunk's clipped sums to the shards (`FlatL2ClipReducer`), and each
process noises only the coordinates it owns, with the values one process would draw for them
(`GaussianNoise.add_shards_`): again Σ clipped + one noise draw per coordinate, and each process's `.grad` is its
shard of it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .engine import PerExampleGradientEngine
from .engine.sharding import dim0_shard, is_sharded
from .privacy import GaussianNoise
from .privacy.band_inv_mf import BandedInverseNoise
from .privacy.band_mf import BandedNoise
from .privacy.sharded_noise import TensorShard

_BUCKET_BYTES = 64 << 20

#: the noisy, scaled gradient of one parameter (its `.grad`) → its replacement, or None after changing it in place
GradientTransform = Callable[[torch.Tensor], "torch.Tensor | None"]


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


def noise_once_then_sum(
    tensors: list[torch.Tensor],
    add_noise: Callable[[list[torch.Tensor]], None],
    all_reduce: Callable[[list[torch.Tensor]], None] = all_reduce_sum,
) -> None:
    """`add_noise` on exactly one process (rank 0, before the reduction), then the sum over processes: the result is
    Σ of every process's part plus one noise draw, never one per process. The DP-SGD step and a method's own releases
    (`MethodRun.release`) both go through here."""
    if adds_noise_here():
        add_noise(tensors)
    if _distributed():
        all_reduce(tensors)


def _zero_sum(param: nn.Parameter) -> torch.Tensor:
    """The clipped sum of a parameter no example reached: zeros, in its dtype promoted to at least float32."""
    return torch.zeros(param.shape, dtype=torch.promote_types(param.dtype, torch.float32), device=param.device)


def _zero_shard(param: nn.Parameter) -> torch.Tensor:
    """This process's rows of a sharded parameter's clipped sum when no example reached it (`_zero_sum`'s dtype)."""
    start, end, _ = dim0_shard(param)
    return _zero_sum(param).new_zeros((end - start, *param.shape[1:]))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def adds_noise_here() -> bool:
    """Whether this process is the one that `noise_once_then_sum` has add the noise: rank 0, or the only one."""
    return not _distributed() or dist.get_rank() == 0


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
        gradient_transforms: Mapping[nn.Parameter, GradientTransform] | None = None,
        step_end_hooks: Iterable[Callable[[], None]] = (),
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
        self._gradient_transforms: dict[nn.Parameter, OrderedDict[int, GradientTransform]] = {}
        self._pre_step_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._step_end_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        #: BandMF's correlated noise (`privacy.band_mf.BandedNoise`) or the banded-inverse one
        #: (`privacy.band_inv_mf.BandedInverseNoise`), set by the run; None: DP-SGD's independent noise
        self.banded_noise: BandedNoise | BandedInverseNoise | None = None
        for param, transform in (gradient_transforms or {}).items():
            self.add_gradient_transform(param, transform)
        for hook in step_end_hooks:
            self.add_step_end_hook(hook)

    # ------------------------------------------------------------------ method hooks
    def add_gradient_transform(self, parameter: nn.Parameter, transform: GradientTransform) -> RemovableHandle:
        """Apply `transform` to `parameter`'s noisy gradient (its `.grad`, already divided by q·N) before the inner
        step; e.g. `lambda g: g.masked_fill_(mask, 0)` keeps masked coordinates unchanged by a plain SGD/Adam step
        (weight decay still moves them: decoupled decay acts on the weight, not the gradient).

        It sees only released (noised) values, so it costs no privacy; it must be deterministic, since every process
        applies it to the same all-reduced gradient. Several transforms apply in the order added.
        """
        if not any(parameter is p for _, p in self.engine.parameters):
            raise ValueError(
                f"add_gradient_transform: a parameter of shape {tuple(parameter.shape)} is not one the engine trains."
            )
        transforms = self._gradient_transforms.setdefault(parameter, OrderedDict())
        handle = RemovableHandle(transforms)
        transforms[handle.id] = transform
        return handle

    def add_pre_step_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call `hook()` once per logical batch, after the gradient transforms and before the inner step: it sees the
        released `.grad` of every trainable parameter and may turn them into gradients of other parameters of the
        inner optimizer (RGP: carrier gradients into the full weight's, carriers' own set to None)."""
        handle = RemovableHandle(self._pre_step_hooks)
        self._pre_step_hooks[handle.id] = hook
        return handle

    def add_step_end_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call `hook()` once per logical batch, after the inner step and the ledger's record (not when the budget
        stops the step). It may change trainable tensors only through released values and public data."""
        handle = RemovableHandle(self._step_end_hooks)
        self._step_end_hooks[handle.id] = hook
        return handle

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
        params = [p for _, p in self.engine.parameters]
        if is_sharded(params):
            if self.banded_noise is not None:
                raise NotImplementedError(
                    "Correlated noise (noise_mechanism='band-mf' or 'band-inv-mf') is not supported with FSDP2-sharded "
                    "parameters yet: train with DDP or a single process."
                )
            self._refuse_hooks_when_sharded()
            totals = self.sharded_sums(params)
            self.add_sharded_noise(params, totals)
        else:
            totals = self.clipped_sums(params)
            noise_once_then_sum(totals, self.add_noise, self.all_reduce)
        self.to_gradients(params, totals)
        self.transform_gradients(params)
        for hook in list(self._pre_step_hooks.values()):
            hook()
        self.optimizer.step()
        self.on_step()
        self.step_end()
        return None

    def clipped_sums(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """This process's clipped sums, popped from the engine; zeros (fp32 or wider) for a parameter with none."""
        sums = self.engine.pop_clipped_sums()
        return [sums[p] if p in sums else _zero_sum(p) for p in params]

    def sharded_sums(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Each parameter's clipped sum over every process, this process's shard of it: the engine reduce-scatters
        each chunk's sums as it reduces them (`FlatL2ClipReducer`); zeros where a step ran no chunk anywhere."""
        sums = self.engine.pop_clipped_sums()
        return [sums[p] if p in sums else _zero_shard(p) for p in params]

    def add_sharded_noise(self, params: list[nn.Parameter], shards: list[torch.Tensor]) -> None:
        """shards += N(0, (σC)²) on the coordinates this process owns, the values one process would draw for them
        (`GaussianNoise.add_shards_`); every process does so for its own shards."""
        if self.noise_multiplier > 0:
            parts = []
            for param, shard in zip(params, shards):
                start = dim0_shard(param)[0] * math.prod(param.shape[1:])  # rows of a contiguous tensor
                parts.append(TensorShard(shard, start, param.numel()))
            self.noise.add_shards_(parts, self.noise_multiplier * self.max_grad_norm)

    def _refuse_hooks_when_sharded(self) -> None:
        """A gradient transform or pre-step hook sees whole gradients; a sharded process holds a shard. Step-end hooks
        run after the step on each process (the clip-norm check reads only the norms); a method whose step-end hook
        needs whole weights (RGP, adaptive clipping's update) is refused when a sharded trainer is built."""
        hooked = [
            kind
            for kind, hooks in (
                ("gradient transforms", self._gradient_transforms),
                ("pre-step hooks", self._pre_step_hooks),
            )
            if hooks
        ]
        if hooked:
            raise NotImplementedError(
                f"This run registers {' and '.join(hooked)} (a method's masks or RGP), which are not supported with "
                "FSDP2-sharded parameters yet: train with DDP, or with a method that registers none (DP-SGD, LoRA)."
            )

    def add_noise(self, totals: list[torch.Tensor]) -> None:
        """totals += N(0, (σC)²) per coordinate, from the secret noise source, in place (nothing for σ = 0: a stage
        that claims no guarantee, whose steps the ledger records as such)."""
        if self.noise_multiplier > 0 and (self.banded_noise is None or self.banded_noise.bands == 1):  # b = 1: DP-SGD
            self.noise.add_(totals, self.noise_multiplier * self.max_grad_norm)
        elif self.noise_multiplier > 0 and isinstance(self.banded_noise, BandedInverseNoise):  # draws it itself
            self.banded_noise.add_(totals, self.noise_multiplier * self.max_grad_norm)
        elif self.noise_multiplier > 0 and isinstance(self.banded_noise, BandedNoise):  # BandMF: z_t, then C⁻¹z
            noise = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in totals]
            self.noise.add_(noise, self.noise_multiplier * self.max_grad_norm)
            self.banded_noise.correlate_(noise)
            for total, w in zip(totals, noise):
                total.add_(w)

    def prepare_noise(self) -> None:
        """Start drawing this logical batch's noise in the background (`GaussianNoise.prepare`), where `add_noise`
        will add it, so the step does not wait for it. Called once the batch's trainable set and σ are known."""
        params = [p for _, p in self.engine.parameters]
        inverse = isinstance(self.banded_noise, BandedInverseNoise) and self.banded_noise.bands > 1  # draws its own
        if self.noise_multiplier > 0 and adds_noise_here() and not is_sharded(params) and not inverse:
            self.noise.prepare(
                [p.numel() for _, p in self.engine.parameters], self.noise_multiplier * self.max_grad_norm
            )

    def all_reduce(self, totals: list[torch.Tensor]) -> None:
        all_reduce_sum(totals)

    def to_gradients(self, params: list[nn.Parameter], totals: list[torch.Tensor]) -> None:
        """param.grad = total / (q·N), in the parameter's dtype (a sharded parameter's: its shard, as a DTensor)."""
        for param, total in zip(params, totals):
            grad = total.div_(self.expected_batch_size).to(param.dtype)
            if isinstance(param, DTensor):
                grad = DTensor.from_local(
                    grad, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
                )
            param.grad = grad

    def transform_gradients(self, params: list[nn.Parameter]) -> None:
        for param in params:
            for transform in self._gradient_transforms.get(param, {}).values():
                if param.grad is None:  # to_gradients gave every parameter one; a transform may not take it away
                    raise ValueError(
                        f"A gradient transform of a parameter of shape {tuple(param.shape)} left it "
                        "without a gradient: a transform returns a tensor or None (changed in place)."
                    )
                result = transform(param.grad)
                if result is not None:
                    if result.shape != param.shape:
                        raise ValueError(
                            f"A gradient transform returned shape {tuple(result.shape)} for a parameter "
                            f"of shape {tuple(param.shape)}."
                        )
                    param.grad = result.to(param.dtype)

    def step_end(self) -> None:
        for hook in list(self._step_end_hooks.values()):
            hook()


def noisy_optimizer(optimizer) -> NoisyOptimizer | None:
    """The NoisyOptimizer `optimizer` is or wraps (Accelerate's AcceleratedOptimizer keeps it as `.optimizer`)."""
    for current in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(current, NoisyOptimizer):
            return current
    return None
