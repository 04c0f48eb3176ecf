"""Arms timed in alternating rounds on one fixed batch, in one process (so per step is per example and machine load
hits every arm alike), with each arm's peak memory of one steady step; shared by the method benchmarks."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Protocol

import torch

from benchmarks.memory import peak_bytes, reset_peak
from benchmarks.speed import CLIP, MODELS, SIGMA, per_example_loss
from hf_private.engine import PerExampleGradientEngine
from hf_private.optimizer import NoisyOptimizer
from hf_private.privacy import PrivacyPlan
from hf_private.privacy.noise import GaussianNoise


class Arm(Protocol):
    def step(self, chunks: list[dict[str, torch.Tensor]]) -> None: ...


def build_with_method(model_name: str, config) -> tuple[torch.nn.Module, Any]:
    """The seeded model (dropout off: identical work in every arm) wrapped and prepared by `config`'s method."""
    torch.manual_seed(0)
    base = MODELS[model_name]()
    for module in base.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    method = config.build_method()
    model = method.wrap_model(base)
    method.prepare_model(model)
    return model.train(), method


class PrivateArm:
    """hf_private's engine and noisy optimizer (σ = SIGMA, C = CLIP) with `method`'s hooks attached: its forward
    mechanisms (given a plan), term transforms and gradient transforms, as PrivateTrainer attaches them."""

    def __init__(self, model, method, batch_size: int, plan: PrivacyPlan | None = None) -> None:
        self.model, self.batch_size = model, batch_size
        device = torch.device("cpu")
        if plan is not None:
            method.attach_forward_mechanisms(model, GaussianNoise(device), plan)
        self.engine = PerExampleGradientEngine(model, CLIP)
        self.engine.attach()
        method.attach_engine(self.engine)
        inner = torch.optim.AdamW([p for _, p in self.engine.parameters], lr=1e-5)
        self.optimizer = NoisyOptimizer(
            inner,
            self.engine,
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            expected_batch_size=batch_size,
            noise=GaussianNoise(device),
            may_step=lambda: True,
            on_step=lambda: None,
        )
        method.attach_optimizer(self.optimizer)

    def step(self, chunks) -> None:
        for batch in chunks:
            with self.engine.recording(self.batch_size):
                per_example_loss(self.model, batch).sum().backward()
            self.engine.finish_backward()
        self.optimizer.step()


def write_result(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def compare(
    arms: dict[str, Arm], chunks: list[dict[str, torch.Tensor]], reference: str, steps: int, rounds: int
) -> dict[str, dict[str, Any]]:
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
    return {
        label: {
            "median_step_s": statistics.median(t),
            "time_ratio": statistics.median(t) / base,
            "peak_bytes": peaks[label],
            "memory_ratio": peaks[label] / peaks[reference],
        }
        for label, t in times.items()
    }


def print_arms(arms: dict[str, dict[str, Any]]) -> None:
    for label, arm in arms.items():
        print(
            f"  {label:<24} {arm['median_step_s']:.3f} s/step  {arm['time_ratio']:.3f}x time  "
            f"{arm['memory_ratio']:.3f}x memory"
        )
