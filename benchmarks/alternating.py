"""Arms timed in alternating rounds on one fixed batch, in one process (so per step is per example and machine load
hits every arm alike), with each arm's peak memory of one steady step; shared by the method benchmarks."""

from __future__ import annotations

import statistics
import time
from typing import Any, Protocol

import torch

from benchmarks.memory import peak_bytes, reset_peak


class Arm(Protocol):
    def step(self, chunks: list[dict[str, torch.Tensor]]) -> None: ...


def compare(arms: dict[str, Arm], chunks: list[dict[str, torch.Tensor]], reference: str, steps: int,
            rounds: int) -> dict[str, dict[str, Any]]:
    """Per arm: median step time, peak memory (VmHWM after a reset, in this process), and both as ratios to
    `reference`. Every arm first takes one warm-up step (optimizer state)."""
    device = torch.device("cpu")
    peaks = {}
    for label, arm in arms.items():
        arm.step(chunks)
        reset_peak(device)
        arm.step(chunks)
        peaks[label] = peak_bytes(device)
    times: dict[str, list[float]] = {label: [] for label in arms}
    for _ in range(rounds):
        for label, arm in arms.items():
            for _ in range(steps):
                start = time.perf_counter()
                arm.step(chunks)
                times[label].append(time.perf_counter() - start)
    base = statistics.median(times[reference])
    return {label: {"median_step_s": statistics.median(t), "time_ratio": statistics.median(t) / base,
                    "peak_bytes": peaks[label], "memory_ratio": peaks[label] / peaks[reference]}
            for label, t in times.items()}


def print_arms(arms: dict[str, dict[str, Any]]) -> None:
    for label, arm in arms.items():
        print(f"  {label:<24} {arm['median_step_s']:.3f} s/step  {arm['time_ratio']:.3f}x time  "
              f"{arm['memory_ratio']:.3f}x memory")
