"""One private step of a tiny Llama under FSDP2 (`fully_shard` on each decoder layer and the root), or unsharded in
one process, through the engine and `NoisyOptimizer` (SGD, lr = 1): what tests/test_fsdp2_core.py compares.

`spawn_sharded` starts `WORLD` gloo processes on the CPU; each takes its consecutive share of `EXAMPLES` as one chunk
and runs every case of `CASES` in turn, each on a fresh model; rank 0 writes the full parameters after each case.
`one_step` is the same step in the calling process, unsharded, on all the examples at once. Every sharded step goes
through the engine's own first-chunk check against autograd, on FSDP2's reduced shards. `spawn_refusal` runs a model
that the check must refuse (a weight also used outside its module's forward) and reports what each rank raised.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError, reducers
from hf_private.optimizer import NoisyOptimizer
from hf_private.privacy import GaussianNoise
from tests.support import tiny
from tests.support.launch import free_port

WORLD = 2
NOISE_SEED = 4242
MAX_GRAD_NORM = 0.5  # well under the examples' norms (about 20): every example is clipped
NOISE_MULTIPLIER = 0.7
_LENGTH = 6
SPAWN_TIMEOUT_S = 120.0  # a rank left waiting in a collective fails the test instead of hanging it


def examples(neighbour: bool = False) -> torch.Tensor:
    """Six token rows, the fifth an unlike one (rank 1's second); `neighbour`: without it (add/remove adjacency, as
    Poisson sampling is accounted), so rank 1 holds one example fewer."""
    rows = torch.randint(4, tiny.VOCAB_SIZE, (6, _LENGTH), generator=torch.Generator().manual_seed(0))
    rows[4] = torch.tensor([5, 63, 5, 63, 5, 63])
    return torch.cat([rows[:4], rows[5:]]) if neighbour else rows


def _draw_from_coordinate_zero(self: GaussianNoise, shards, std: float) -> None:
    """Mutation: every process noises its shard as if it began at coordinate 0 (noise per rank, not per coordinate)."""
    self.add_([shard.values for shard in shards], std)


def _averaged(reduce_scatter: Callable) -> Callable:
    """Mutation: the shards get the mean over processes (FSDP's own default reduction) instead of the sum."""
    return lambda total, param: reduce_scatter(total, param).div_(dist.get_world_size())


#: case → (noise multiplier, the neighbouring dataset, mutation); "summed-by-fsdp" is no mutation of the release: FSDP2
#: then sums autograd's gradients instead of averaging them, which the engine's check must read back from its state
CASES: dict[str, tuple[float, bool, str | None]] = {
    "noisy": (NOISE_MULTIPLIER, False, None),
    "clipped": (0.0, False, None),
    "clipped-summed-by-fsdp": (0.0, False, "summed-by-fsdp"),
    "clipped-neighbour": (0.0, True, None),
    "noisy-noise-per-rank": (NOISE_MULTIPLIER, False, "noise-per-rank"),
    "clipped-averaged": (0.0, False, "averaged"),
    "unclipped": (0.0, False, "unclipped"),
    "unclipped-neighbour": (0.0, True, "unclipped"),
}


def one_step(noise_multiplier: float, neighbour: bool, mutation: str | None, shard: bool) -> dict:
    """One private step on this process's examples; the full parameters after it (gathered from the shards)."""
    model = tiny.llama()
    if shard:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        if mutation == "summed-by-fsdp":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    engine = PerExampleGradientEngine(model, MAX_GRAD_NORM if mutation != "unclipped" else 1e9)
    engine.attach()
    world, rank = (dist.get_world_size(), dist.get_rank()) if shard else (1, 0)
    rows = examples(neighbour).chunk(world)[rank]
    with engine.recording(len(rows)):
        logits = model(input_ids=rows).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="sum")
        loss.backward()
    engine.finish_backward()
    verified = engine.verified  # the check against autograd ran on this chunk and passed
    noisy = NoisyOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        engine,
        noise_multiplier=noise_multiplier,
        max_grad_norm=engine.max_grad_norm,
        expected_batch_size=float(len(examples())),
        noise=GaussianNoise("cpu", test_seed=NOISE_SEED),
        may_step=lambda: True,
        on_step=lambda: None,
    )
    noisy.prepare_noise()
    noisy.step()
    engine.detach()
    params = dict(model.named_parameters())
    return {
        "after": {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in params.items()},
        "sharded": {n: isinstance(p, DTensor) and p.to_local().shape != p.shape for n, p in params.items()},
        "verified": verified,
    }


def _case(name: str, shard: bool) -> dict:
    noise_multiplier, neighbour, mutation = CASES[name]
    saved = GaussianNoise.add_shards_, reducers.reduce_scatter_to_shard
    try:
        if mutation == "noise-per-rank":
            GaussianNoise.add_shards_ = _draw_from_coordinate_zero  # type: ignore[method-assign]
        if mutation == "averaged":
            reducers.reduce_scatter_to_shard = _averaged(saved[1])
        return one_step(noise_multiplier, neighbour, mutation, shard)
    finally:
        GaussianNoise.add_shards_, reducers.reduce_scatter_to_shard = saved  # type: ignore[method-assign]


class PartlyHidden(torch.nn.Module):
    """Weights the engine's checks must refuse: `proj`'s rows 0-1 (rank 0's shard) used once more outside its
    forward, where no hook sees them, so only rank 0's own numbers show it; `unhooked`'s weight used only outside it,
    so it gets a gradient and no per-example terms."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.proj = torch.nn.Linear(4, 4)
        self.unhooked = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use == "partly-hidden":
            return self.proj(x) + x[:, :2] @ self.proj.weight[:2] + self.unhooked(x)
        return self.proj(x) + x @ self.unhooked.weight.T


def _refused_here(use: str) -> str:
    """What finish_backward raised on this rank for `PartlyHidden(use)` sharded ("" if nothing)."""
    torch.manual_seed(0)  # the same weights on every rank, as FSDP2 expects
    model = PartlyHidden(use)
    fully_shard(model)
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    rows = torch.randn(2 * WORLD, 4, generator=torch.Generator().manual_seed(1)).chunk(WORLD)[dist.get_rank()]
    with engine.recording(len(rows)):
        model(rows).pow(2).sum().backward()
    try:
        engine.finish_backward()
    except UnsupportedLayerError as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _worker(rank: int, port: int, out: str, job: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        if job == "cases":
            results = {name: _case(name, shard=True) for name in CASES}
            if rank == 0:
                torch.save(results, Path(out) / "sharded.pt")
        else:
            (Path(out) / f"refusal-{rank}.txt").write_text(_refused_here(job))
    finally:
        dist.destroy_process_group()


def _spawn(out: Path, job: str) -> None:
    """Run `job` on `WORLD` gloo processes; fail (rather than wait) if they have not all ended within the timeout."""
    context = mp.spawn(_worker, args=(free_port(), str(out), job), nprocs=WORLD, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{WORLD} processes ran {job!r} past {SPAWN_TIMEOUT_S} s: one is stuck in a collective.")


def spawn_sharded(out: Path) -> dict:
    """Every case, sharded over `WORLD` processes: case → {"after": full parameters, "sharded": name → bool,
    "verified": whether the engine's check against autograd passed}."""
    _spawn(out, "cases")
    return torch.load(out / "sharded.pt", weights_only=False)


def spawn_refusal(out: Path, use: str) -> list[str]:
    """What each rank's finish_backward raised for `PartlyHidden(use)` sharded over `WORLD` processes ("" for
    nothing)."""
    _spawn(out, use)
    return [(out / f"refusal-{rank}.txt").read_text() for rank in range(WORLD)]


def unsharded(name: str) -> dict:
    """One case in this process, unsharded, all examples in one chunk."""
    return _case(name, shard=False)
