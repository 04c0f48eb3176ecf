"""White-box gradient (Dirac) canaries: the white-box score of runs whose input embedding does not train.

A gradient canary is a training example like any other (its own new token repeated, so the sampler, the unit count
and the accountant treat it as one unit), except that whenever Poisson sampling draws it, the engine replaces its
gradient by an inserted one: `INSERTED_NORM` × C (the C the run declares for that step, which adaptive clipping
moves every step; never the engine's own, which a broken clip may have lost) along one trainable coordinate of its
own, with a sign, both drawn from the auditor's secret seed. The replacement happens before the method's masks and
the clip (a chunk transform, `PerExampleGradientEngine.add_chunk_transform`), so the inserted gradient meets exactly
what any unit's would: a sound run clips it to C and noises it; a run that skips the clip releases all of it.

The score reads that coordinate of every step's released noisy gradient (the optimizer's input, after the method's
gradient transforms) and sums it less its median step, signed (`GradientCanaryInserter.scores`): the whole sequence
of released gradients is what the accountant's ε covers, and the released weights are a function of it. For plain SGD
the plain sum is the final weight's movement along the canary (scaled); reading the gradients keeps it so under Adam and
under RGP, whose weights mix the carriers' coordinates. Only these canaries' coordinates are read, so the score costs
nothing per step beyond a gather.

Each step's read is divided by that step's C first, so that under adaptive clipping every step counts the canary at
one unit and its noise at the same effective multiplier. Under correlated noise (BandMF: the noise is w = C⁻¹z for the
banded strategy C) the sequence of reads is whitened, multiplied by the strategy, so that its per-step noise is the
independent z again before it is scored (`per_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..engine import ChunkTerms, ChunkUnits, PerExampleGradientEngine
from ..engine.terms import OuterTerm, SampleTerm, accumulation_dtype, zero_examples
from ..models.peft import unwrap_peft

if TYPE_CHECKING:
    from ..optimizer import NoisyOptimizer

#: The inserted gradient's norm in units of C, far beyond any real example's: a sound run clips it to C; a run that
#: does not clip releases 10⁶ C, which stands out of the data's own unclipped gradients in any coordinate (DP-FP's
#: head reads a noised representation: its unclipped gradients drown 10³ C).
INSERTED_NORM = 1e6


@dataclass(frozen=True)
class GradientCanaries:
    """Which trainable coordinate each canary's inserted gradient points along, and with which sign.

    Canary i is the example made of token `first_token + i`; its coordinate is `flat_index[i]` of the trainable
    parameter named `parameter_names[parameter[i]]`. Every canary has a coordinate of its own.
    """

    first_token: int
    parameter_names: tuple[str, ...]
    parameter: torch.Tensor  # [m] long: index into parameter_names
    flat_index: torch.Tensor  # [m] long: coordinate within that parameter
    sign: torch.Tensor  # [m] float: ±1

    @property
    def count(self) -> int:
        return self.parameter.numel()


def draw_gradient_canaries(
    parameters: list[tuple[str, nn.Parameter]], count: int, first_token: int, generator: torch.Generator
) -> GradientCanaries:
    """`count` distinct coordinates, uniform over every trainable coordinate, and random signs, from the auditor's
    secret `generator` (like the canaries' inclusion: nothing about them is public)."""
    sizes = torch.tensor([p.numel() for _, p in parameters])
    total = int(sizes.sum())
    if count > total:
        raise ValueError(
            f"The audit asks for {count} gradient canaries, but the run trains {total} coordinates: "
            "use fewer canaries (each needs a coordinate of its own)."
        )
    distinct: dict[int, None] = {}  # in order of drawing: a uniform subset without a permutation of every coordinate
    while len(distinct) < count:
        distinct.update(dict.fromkeys(torch.randint(total, (count,), generator=generator).tolist()))
    chosen = torch.tensor(list(distinct)[:count], dtype=torch.long)
    ends = sizes.cumsum(0)
    parameter = torch.searchsorted(ends, chosen, right=True)
    flat_index = chosen - (ends - sizes)[parameter]
    sign = torch.randint(2, (count,), generator=generator).float().mul_(2).sub_(1)
    return GradientCanaries(first_token, tuple(name for name, _ in parameters), parameter, flat_index, sign)


class GradientCanaryInserter:
    """Inserts the canaries' gradients into a run and reads their released coordinates (an `Instrument` of the
    run: `PrivacyRun.add_instrument` attaches it to every training engine and optimizer)."""

    def __init__(self, model: nn.Module, canaries: GradientCanaries, clip: Callable[[], float]) -> None:
        """`clip()`: the C the run declares for the step under way (its noise is scaled to it)."""
        self.canaries = canaries
        self.clip = clip
        self._step = torch.zeros(canaries.count, dtype=torch.float64)  # this step's released coordinates
        self.released: list[torch.Tensor] = []  # every step's, in order
        self.clips: list[float] = []  # the C each step was clipped and noised at
        self.strategy: list[float] = [1.0]  # the banded strategy's first column (the identity: independent noise)
        self._rows: list[torch.Tensor] = []  # the canary (or −1) of each row of the chunk's training forwards
        self._parameters: dict[str, nn.Parameter] = {}
        self._optimizers: list[NoisyOptimizer] = []
        unwrap_peft(model).get_input_embeddings().register_forward_pre_hook(self._note_rows)

    # ------------------------------------------------------------------ which rows are canaries
    def _note_rows(self, module: nn.Module, args: tuple) -> None:
        """Each training forward's rows, by their tokens: canary i's example is its token alone."""
        if not (module.training and torch.is_grad_enabled()):  # scoring, evaluation, the independence probe
            return
        ids = args[0].detach()
        offset = ids - self.canaries.first_token
        is_canary = (offset >= 0) & (offset < self.canaries.count)
        canary = torch.where(is_canary, offset, self.canaries.count).amin(dim=1)
        mixed = (is_canary & (offset != canary.unsqueeze(1))).any(dim=1)
        if bool(mixed.any()):
            raise ValueError(
                "A row holds the tokens of two gradient canaries: the audit needs one example a row (no packing)."
            )
        self._rows.append(torch.where(canary < self.canaries.count, canary, -1).cpu())

    def _canary_of_units(self, units: ChunkUnits) -> torch.Tensor:
        rows = torch.cat(self._rows) if self._rows else torch.empty(0, dtype=torch.long)
        self._rows = []
        if units.packed:
            raise ValueError(
                "Gradient canaries need one example a row: audit without packing (no padding-free "
                "collator, no packed dataset)."
            )
        expected = sum(units.unit_rows)
        if rows.numel() < expected:
            raise RuntimeError(
                f"The gradient canaries saw {rows.numel()} rows in training forwards since the last "
                f"chunk, the engine {expected}: they cannot tell which units are canaries."
            )
        # The chunk's own forward comes last; a training-mode forward before it that no training engine reduced (a
        # method's measurement with an engine of its own) leaves rows that are not the chunk's.
        per_unit = torch.split(rows[rows.numel() - expected :], list(units.unit_rows))
        canary = torch.tensor([int(unit.max()) for unit in per_unit], dtype=torch.long)
        for unit, index in zip(per_unit, canary.tolist()):
            if index >= 0 and unit.numel() != 1:
                raise ValueError(
                    "A gradient canary shares its unit with other rows: each canary must be a unit of one example."
                )
        return canary

    # ------------------------------------------------------------------ engine: the inserted gradients
    def attach_engine(self, engine: PerExampleGradientEngine) -> None:
        trained = dict(engine.parameters)
        holding = {self.canaries.parameter_names[slot] for slot in self.canaries.parameter.unique().tolist()}
        missing = sorted(holding - trained.keys())
        if missing:
            raise ValueError(
                f"The gradient canaries' parameters {missing[:3]} are not trained by this engine: the "
                "audit needs a trainable set that stays the same for the whole run."
            )
        self._parameters = {name: trained[name] for name in holding}
        engine.add_chunk_transform(lambda chunk, units: self._insert(chunk, units, INSERTED_NORM * self.clip()))

    def _insert(self, chunk: ChunkTerms, units: ChunkUnits, norm: float) -> ChunkTerms:
        """Every canary unit's gradient replaced by its inserted one (of `norm`): zero in every data term, a Dirac term
        added."""
        canary = self._canary_of_units(units)
        drawn = canary >= 0
        if not bool(drawn.any()):
            return chunk
        terms = {p: [zero_examples(t, ~drawn.to(_device(t))) for t in ts] for p, ts in chunk.terms.items()}
        which = self.canaries.parameter[canary.clamp(min=0)]
        for slot in torch.unique(which[drawn]).tolist():
            param = self._parameters[self.canaries.parameter_names[slot]]
            mine = drawn & (which == slot)
            terms.setdefault(param, []).append(self._dirac_term(param, canary, mine, norm))
        return ChunkTerms(examples=chunk.examples, terms=terms)

    def _dirac_term(self, param: nn.Parameter, canary: torch.Tensor, mine: torch.Tensor, norm: float):
        """±norm at each of these units' coordinates of `param`, zero for every other unit: factored for a matrix (one
        position, a row vector and a column vector, as a Linear weight's term), explicit for a vector."""
        dtype, device = accumulation_dtype(param), param.device
        units = canary.numel()
        index = torch.nonzero(mine).flatten()
        flat = self.canaries.flat_index[canary[index]]
        value = (self.canaries.sign[canary[index]] * norm).to(device=device, dtype=dtype)
        index = index.to(param.device)
        if param.dim() == 1:
            grad = torch.zeros(units, param.numel(), dtype=dtype, device=device)
            grad[index, flat.to(param.device)] = value
            return SampleTerm(grad)
        rows, columns = param.shape[0], param.numel() // param.shape[0]
        left = torch.zeros(units, 1, rows, dtype=dtype, device=device)
        right = torch.zeros(units, 1, columns, dtype=dtype, device=device)
        left[index, 0, (flat // columns).to(param.device)] = value
        right[index, 0, (flat % columns).to(param.device)] = 1.0
        return OuterTerm(left=left, right=right)

    # ------------------------------------------------------------------ optimizer: the released coordinates
    def attach_optimizer(self, optimizer: NoisyOptimizer) -> None:
        if any(optimizer is seen for seen in self._optimizers):
            return
        self._optimizers.append(optimizer)
        for slot, name in enumerate(self.canaries.parameter_names):
            mine = torch.nonzero(self.canaries.parameter == slot).flatten()
            if mine.numel():
                optimizer.add_gradient_transform(self._parameters[name], self._reader(mine))
        optimizer.add_pre_step_hook(lambda: self._end_of_step(optimizer))

    def _reader(self, mine: torch.Tensor):
        coordinates = self.canaries.flat_index[mine]

        def read(gradient: torch.Tensor) -> None:
            self._step[mine] = gradient.detach().reshape(-1)[coordinates.to(gradient.device)].double().cpu()

        return read

    def _end_of_step(self, optimizer: NoisyOptimizer) -> None:
        self.released.append(self._step.clone())
        self.clips.append(float(self.clip()))
        if optimizer.banded_noise is not None:
            self.strategy = list(optimizer.banded_noise.coefficients)

    def per_step(self) -> torch.Tensor:
        """[steps, canaries]: each step's released coordinates in units of its C, whitened by the strategy.

        With w = C⁻¹z, applying C along the steps turns the noise back into z, independent from step to step (for
        DP-SGD C = I and this is the identity): (C y)_t = Σ_j c_j y_{t−j}. A canary's unit in a step it is sampled
        reappears in the b − 1 steps after it weighted by c_j, which the sum in `scores` collects.
        """
        steps = torch.stack(self.released) / torch.tensor(self.clips, dtype=torch.float64).unsqueeze(1)
        whitened = torch.zeros_like(steps)
        for j, c in enumerate(self.strategy[: steps.shape[0]]):
            whitened[j:] += c * steps[: steps.shape[0] - j]
        return whitened

    def scores(self) -> torch.Tensor:
        """Each canary's released coordinate summed over the steps less its median step, signed.

        The data's own gradient moves a coordinate by about the same amount every step, whether the canary is in or
        not; with a random sign that drift is noise on the score, larger than the canary's C where few coordinates
        train (BiTFiT on a small model). The canary adds its C only in the steps that sample it, a few in all, so
        the median step estimates the drift and subtracting it leaves the canary (a post-processing of the released
        gradients, like any score).
        """
        if not self.released:
            return torch.zeros(self.canaries.count)
        steps = self.per_step()
        centred = steps.sum(0) - steps.shape[0] * steps.median(0).values
        return (centred * self.canaries.sign.double()).float()


def _device(term) -> torch.device:
    return (term.grad if isinstance(term, SampleTerm) else term.right).device
