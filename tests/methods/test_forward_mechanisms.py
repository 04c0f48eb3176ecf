"""A method can release a module's output clipped per example and noised from the secret source (DP-FP's
mechanism), during training only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from scipy import stats

from hf_private.methods import DPMethod, MethodConfig, register_dp_method
from hf_private.methods.base import _METHODS
from hf_private.methods.dpfp.forward_noise import ClippedNoisyOutput
from hf_private.privacy import GaussianNoise, Stage
from tests.support import tiny
from tests.support.helpers import make_trainer

CLIP, SIGMA = 0.3, 2.0


def _pooled(model, hook_outputs):
    return model.bert.pooler.dense.register_forward_hook(lambda m, a, out: hook_outputs.append(out.detach()))


def test_output_is_clipped_per_example_and_noised_with_variance_sigma2_C2():
    mechanism = ClippedNoisyOutput(CLIP, SIGMA, GaussianNoise("cpu", test_seed=3))
    layer = torch.nn.Linear(16, 4096).train()
    handle = mechanism.attach(layer)
    x = torch.randn(8, 16) * 10
    with torch.no_grad():
        raw = torch.nn.functional.linear(x, layer.weight, layer.bias)
        released = layer(x)
    mechanism.noise_multiplier = 0.0
    with torch.no_grad():
        clipped = layer(x)
    assert torch.allclose(clipped.norm(dim=1), torch.full((8,), CLIP), rtol=1e-5)  # every example was above C
    assert torch.allclose(clipped, raw * (CLIP / raw.norm(dim=1, keepdim=True)), rtol=1e-5, atol=1e-7)
    noise = (released - clipped).double().flatten()
    n = noise.numel()
    statistic = (noise.pow(2).sum() / (SIGMA * CLIP) ** 2).item()
    assert stats.chi2.ppf(1e-6, n) < statistic < stats.chi2.ppf(1 - 1e-6, n)
    layer.eval()
    with torch.no_grad():
        assert torch.equal(layer(x), raw)  # evaluation sees the un-noised representation
    handle.remove()


def test_noise_comes_from_the_secret_source_not_torch():
    def draw(seed):
        torch.manual_seed(0)  # torch's generator in the same state for both draws
        mechanism = ClippedNoisyOutput(CLIP, SIGMA, GaussianNoise("cpu", test_seed=seed))
        layer = torch.nn.Linear(4, 64).train()
        torch.nn.init.zeros_(layer.weight), torch.nn.init.zeros_(layer.bias)
        mechanism.attach(layer)
        with torch.no_grad():
            return layer(torch.ones(2, 4))

    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(None), draw(None))  # secret keys: torch.manual_seed does not reproduce the noise


@dataclass
class _NoisyPoolerConfig(MethodConfig):
    method: ClassVar[str] = "test-noisy-pooler"


class _NoisyPoolerMethod(DPMethod):
    def stages(self):
        return [Stage(self.name, sensitivity="pooler output clipped to C, and the gradients")]

    def attach_forward_mechanisms(self, model, noise, plan):
        return [ClippedNoisyOutput(CLIP, SIGMA, noise).attach(model.bert.pooler.dense)]


@pytest.fixture
def noisy_pooler():
    register_dp_method(_NoisyPoolerConfig)(_NoisyPoolerMethod)
    yield _NoisyPoolerConfig
    del _METHODS[_NoisyPoolerConfig.method]


def test_a_method_registers_a_forward_mechanism_through_the_trainer(tmp_path, noisy_pooler):
    trainer = make_trainer(
        tmp_path, model=tiny.bert(), dp=noisy_pooler(noise_multiplier=1.0, noise_seed=0), max_steps=1
    )
    model, seen = trainer.model, []
    handle = _pooled(model, seen)  # registered after the mechanism: sees what the rest of the network sees
    batch = {"input_ids": torch.tensor([[2, 5, 9, 3], [2, 6, 8, 3]])}
    model.train()
    with torch.no_grad():
        model(**batch)
    model.eval()
    with torch.no_grad():
        model(**batch)
    handle.remove()
    noisy, clean = seen  # the tiny model has no dropout: train and eval compute the same raw pooler output
    clipped = clean * (CLIP / clean.norm(dim=1, keepdim=True)).clamp(max=1)
    noise = noisy - clipped
    assert abs(noise.std().item() / (SIGMA * CLIP) - 1) < 0.35 and abs(noise.mean().item()) < 0.3 * SIGMA * CLIP
    trainer.train()  # trains with the mechanism in place
    assert trainer.ledger.total_steps == 1 and math.isfinite(trainer.ledger.epsilon())
