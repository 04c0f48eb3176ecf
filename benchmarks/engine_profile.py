"""Where a private step's time goes at one sequence length: the phases apart, then the engine's own functions.

    python -m benchmarks.engine_profile --model bert-base --seq-len 512 --batch-size 2 --grad-accum 4

Full fine-tuning of a model built from its config, one logical batch of `--grad-accum` chunks (the speed benchmark's
model, chunks, clip and σ). Printed: medians over `--steps` steps (after one warm-up) of the non-private forward +
backward + optimizer step, and of the private step's phases: forward, backward (autograd's input gradients and the
engine's hooks forming each layer's terms), `finish_backward` (per-example norms and clipped sums), the optimizer step
and, alone, the noise; then each Linear shape's path at this T (ghost factors or an instantiated per-example gradient,
`terms.ghost_norm_is_cheaper`) and a cProfile of the private steps restricted to the engine, cumulative seconds a step.
Why: issue #36 asks where the engine's T = 512 overhead goes before changing it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import Counter

import torch

from benchmarks.speed import (
    CLIP,
    MODELS,
    SIGMA,
    HfPrivate,
    NonPrivate,
    build,
    make_chunks,
    noise_seconds,
    per_example_loss,
)
from hf_private.engine.terms import ghost_norm_is_cheaper


def timed_private_step(arm: HfPrivate, chunks: list[dict]) -> dict[str, float]:
    """One private step with its phases timed apart (the arm's own step, unrolled)."""
    phases = Counter()
    for batch in chunks:
        with arm.engine.recording(arm.batch_size):
            start = time.perf_counter()
            loss = per_example_loss(arm.model, batch).sum()
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
        arm.engine.finish_backward()
        finished = time.perf_counter()
        phases["forward"] += forward - start
        phases["backward (hooks form terms)"] += backward - forward
        phases["finish_backward (norms, clipped sums)"] += finished - backward
    start = time.perf_counter()
    arm.optimizer.step()
    phases["optimizer step (noise included)"] += time.perf_counter() - start
    return dict(phases)


def timed_public_step(arm: NonPrivate, chunks: list[dict]) -> dict[str, float]:
    """One non-private step with the same phases timed apart (the arm's own step, unrolled)."""
    phases = Counter()
    arm.optimizer.zero_grad(set_to_none=True)
    for batch in chunks:
        start = time.perf_counter()
        loss = per_example_loss(arm.model, batch).mean()
        forward = time.perf_counter()
        loss.backward()
        phases["forward"] += forward - start
        phases["backward"] += time.perf_counter() - forward
    start = time.perf_counter()
    arm.optimizer.step()
    phases["optimizer step"] += time.perf_counter() - start
    return dict(phases)


def linear_paths(model: torch.nn.Module, seq_len: int) -> list[tuple[str, int, str]]:
    """(in × out, count, path) of every Linear/Conv1D weight shape at this T."""
    shapes = Counter()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module).__name__ in ("Linear", "Conv1D") and weight is not None and weight.requires_grad:
            out_features, in_features = weight.shape if type(module).__name__ == "Linear" else weight.shape[::-1]
            shapes[(in_features, out_features)] += 1
    return [
        (f"{p} × {d}", count, "ghost" if ghost_norm_is_cheaper(seq_len, p, d) else "instantiated")
        for (p, d), count in sorted(shapes.items())
    ]


def engine_profile(profile: cProfile.Profile, steps: int, top: int = 25) -> list[tuple[str, float, float]]:
    """(function, cumulative s a step, calls a step) of hf_private's engine functions, largest first."""
    stats = pstats.Stats(profile).stats
    rows = [
        (f"{path.split('hf_private/')[-1]}:{name}", cumulative / steps, calls / steps)
        for (path, _, name), (calls, _, _, cumulative, _) in stats.items()
        if "hf_private/engine" in path
    ]
    return sorted(rows, key=lambda row: -row[1])[:top]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-base", choices=sorted(MODELS))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    model = build(args.model, "full", device)
    chunks = make_chunks(model, args.batch_size, args.seq_len, args.grad_accum, device)

    public = NonPrivate(model, args.batch_size)
    timed_public_step(public, chunks)
    public_phases = [timed_public_step(public, chunks) for _ in range(args.steps)]
    public.optimizer.zero_grad(set_to_none=True)

    arm = HfPrivate(model, args.batch_size)
    timed_private_step(arm, chunks)  # warm-up, and the engine's one-time check against autograd
    phases = [timed_private_step(arm, chunks) for _ in range(args.steps)]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        arm.step(chunks)
    profile.disable()

    reference = statistics.median(sum(p.values()) for p in public_phases)
    print(f"{args.model} full, T = {args.seq_len}, {args.batch_size} × {args.grad_accum}, C = {CLIP}, σ = {SIGMA}")
    print(f"non-private step: {reference:.3f} s")
    for name in public_phases[0]:
        print(f"  non-private {name:36s} {statistics.median(p[name] for p in public_phases):7.3f} s")
    total = 0.0
    for name in phases[0]:
        seconds = statistics.median(p[name] for p in phases)
        total += seconds
        print(f"  private {name:40s} {seconds:7.3f} s")
    print(
        f"private step (sum of phase medians): {total:.3f} s = {total / reference:.3f}× non-private; noise alone "
        f"{noise_seconds(model, device):.3f} s"
    )
    print("Linear weights at this T (in × out, count, path):")
    for shape, count, path in linear_paths(model, args.seq_len):
        print(f"  {shape:14s} {count:3d}  {path}")
    print("engine functions, cumulative s a step (calls a step):")
    for name, seconds, calls in engine_profile(profile, args.steps):
        print(f"  {name:60s} {seconds:7.3f}  ({calls:.0f})")


if __name__ == "__main__":
    main()
