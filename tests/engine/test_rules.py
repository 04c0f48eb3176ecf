"""Which rule a module gets (dedicated, matched by probe, generic VJP), and that each is exact or refused.

Every rule is held to a float64 per-example autograd loop (one backward per example). The matched rules must match
only what has their form, and the generic rule must refuse what it cannot replay exactly (random draws), never
replay it with other draws; a module that mixes examples passes the sum check but not the independence probe.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError
from hf_private.engine.independence import check_example_independence
from hf_private.engine.layers import module_vjp, rule_for
from hf_private.engine.layers.matched import ElementwiseGainHandler, ScaledEmbeddingHandler
from hf_private.engine.layers.module_vjp import ModuleVJPHandler

BATCH = 4


class OnePlusGainNorm(nn.Module):
    """Gemma's form: fp32 statistics, x̂·(1 + w), back to the input's dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x):
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (hidden * (1.0 + self.weight.float())).type_as(x)


class CentredNormWithoutBias(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, None, 1e-5)


class GainInsideMatmul(nn.Module):
    """Looks like a norm (one 1-D weight) but is not elementwise in it: must not be matched."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * (x @ self.weight).unsqueeze(-1)


class SquaredGain(nn.Module):
    """Elementwise but not affine in its weight: must not be matched."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.weight.pow(2)


class ScaledEmbedding(nn.Embedding):
    def __init__(self, rows: int, width: int, scale: float) -> None:
        super().__init__(rows, width, padding_idx=0)
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale.to(self.weight.dtype)


class ShiftedEmbedding(nn.Embedding):
    """An embedding subclass that is not a scaled lookup (an offset, as BART's positions): must not be matched."""

    def forward(self, ids):
        return super().forward(ids + 1)


class Tower(nn.Module):
    """Embedding → norm → linear → layer, in float64: the model each rule is checked in."""

    def __init__(self, layer: nn.Module, embedding: nn.Module | None = None, width: int = 6) -> None:
        super().__init__()
        self.embed = embedding if embedding is not None else nn.Embedding(20, width)
        self.layer = layer
        self.head = nn.Linear(width, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.layer(self.embed(ids))))


def _ids(batch: int = BATCH, seq: int = 5) -> torch.Tensor:
    return torch.randint(1, 20, (batch, seq), generator=torch.Generator().manual_seed(3))


def _loss(model, ids):
    return model(ids).pow(2).sum()


def _engine_norms_and_sums(model, ids, clip):
    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    results = []
    for _ in range(2):  # the first chunk is checked against autograd; the second runs without its gradients
        with engine.recording(ids.shape[0]):
            _loss(model, ids).backward()
        norms = engine.finish_backward()
        sums = engine.pop_clipped_sums()
        results.append((norms, torch.cat([sums[p].flatten() for p in model.parameters() if p.requires_grad])))
    engine.detach()
    return engine, results


def _oracle(model, ids):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for b in range(ids.shape[0]):
        model.zero_grad()
        _loss(model, ids[b : b + 1]).backward()
        grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    model.zero_grad()
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in per)) for per in grads])
    clip = 0.5 * float(norms.min())
    sums = [
        sum(min(1.0, clip / (float(n) + 1e-6)) * per[i] for n, per in zip(norms, grads)) for i in range(len(params))
    ]
    return norms, torch.cat([s.flatten() for s in sums]), clip


def _assert_matches_oracle(model, ids=None, rtol=1e-9):
    ids = _ids() if ids is None else ids
    ref_norms, ref_sums, clip = _oracle(model, ids)
    engine, results = _engine_norms_and_sums(model, ids, clip)
    for norms, sums in results:
        assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= rtol
        assert ((sums - ref_sums).norm() / ref_sums.norm()).item() <= rtol
    return engine


def _rule(engine, module) -> object:
    return next(layer.handler for layer in engine.layers if layer.module is module)


@pytest.mark.parametrize("norm, rtol", [(OnePlusGainNorm, 1e-7), (CentredNormWithoutBias, 1e-9)])
def test_norm_variants_get_the_matched_gain_rule_and_match_the_loop(norm, rtol):
    """(OnePlusGainNorm computes in float32 whatever its input, as Gemma's does: float32's rounding.)"""
    torch.manual_seed(0)
    model = Tower(norm(6)).double()
    engine = _assert_matches_oracle(model, rtol=rtol)
    assert isinstance(_rule(engine, model.layer), ElementwiseGainHandler)


@pytest.mark.parametrize("layer", [GainInsideMatmul, SquaredGain])
def test_what_only_looks_like_a_norm_takes_the_generic_rule_and_still_matches_the_loop(layer):
    torch.manual_seed(0)
    model = Tower(layer(6)).double()
    engine = _assert_matches_oracle(model)
    assert isinstance(_rule(engine, model.layer), ModuleVJPHandler)


def test_a_scaled_embedding_gets_the_embedding_rule_with_its_scale():
    torch.manual_seed(0)
    model = Tower(nn.Identity(), ScaledEmbedding(20, 6, scale=6**0.5)).double()
    ids = _ids()
    ids[1, 3:] = 0  # padding_idx rows get no gradient
    engine = _assert_matches_oracle(model, ids)
    handler = _rule(engine, model.embed)
    assert isinstance(handler, ScaledEmbeddingHandler) and handler.scale == pytest.approx(6**0.5)


def test_an_embedding_subclass_that_is_not_a_scaled_lookup_takes_the_generic_rule():
    torch.manual_seed(0)
    model = Tower(nn.Identity(), ShiftedEmbedding(21, 6)).double()
    engine = _assert_matches_oracle(model)
    assert isinstance(_rule(engine, model.embed), ModuleVJPHandler)


def test_a_conv_weight_takes_the_generic_rule_whole_and_matches_the_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.GELU(), nn.Flatten(), nn.Linear(3 * 16, 2)).double()
    x = torch.randn(BATCH, 2, 6, 6, dtype=torch.float64)
    params = list(model.parameters())
    expected = []
    for b in range(BATCH):
        model.zero_grad()
        model(x[b : b + 1]).pow(2).sum().backward()
        expected.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in params)))
    model.zero_grad()
    engine = PerExampleGradientEngine(model, 1e-3)
    engine.attach()
    with engine.recording(BATCH):
        model(x).pow(2).sum().backward()
    assert torch.allclose(engine.finish_backward(), torch.stack(expected), rtol=1e-10)
    assert isinstance(_rule(engine, model[0]), ModuleVJPHandler)
    assert any(
        line.startswith("Per-example gradient rule generic") and "Conv2d ×1" in line for line in engine.rule_lines()
    )


def test_rule_lines_count_each_rule_once_with_its_module_types():
    model = Tower(OnePlusGainNorm(6))
    lines = PerExampleGradientEngine(model, 1.0).rule_lines()
    assert sorted(lines) == sorted(
        [
            "Per-example gradient rule embedding rows: 1 module(s) (Embedding ×1)",
            "Per-example gradient rule norm gain (matched by probe): 1 module(s) (OnePlusGainNorm ×1)",
            "Per-example gradient rule linear (factored): 1 module(s) (Linear ×1)",
        ]
    )


class DropoutGain(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return nn.functional.dropout(x, 0.5, self.training) * self.weight


def test_the_generic_rule_refuses_a_forward_that_draws_random_numbers():
    model = Tower(DropoutGain(6)).train()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with pytest.raises(
        UnsupportedLayerError, match=r"DropoutGain has no dedicated.*cannot be replayed one example at a time"
    ):
        with engine.recording(BATCH):
            _loss(model, _ids()).backward()


def test_the_generic_rule_refuses_a_module_too_large_to_hold_per_example(monkeypatch):
    monkeypatch.setattr(module_vjp, "MAX_PARAMETERS", 5)
    with pytest.raises(UnsupportedLayerError, match=r"layer \(GainInsideMatmul\).*6 elements.*LoRA"):
        PerExampleGradientEngine(Tower(GainInsideMatmul(6)), 1.0)


class Pair(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.weight, x


def test_the_generic_rule_refuses_a_tuple_output_by_name():
    model = nn.Sequential(nn.Linear(6, 6), Pair(6))
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with pytest.raises(UnsupportedLayerError, match="Pair returns a tuple"):
        with engine.recording(BATCH):
            model(torch.randn(BATCH, 6))


class BatchCentredGain(nn.Module):
    """Elementwise-affine in its gain, but centred on the batch mean: it mixes examples."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) * self.weight


def test_a_module_that_mixes_examples_is_refused_by_the_independence_probe():
    """Matched as a gain (its gain is elementwise and affine), its sums add up and the self-check passes, but each
    example's gradient depends on the others: the probe, one example alone, refuses it."""
    torch.manual_seed(0)
    model = Tower(BatchCentredGain(6)).double()
    ids = _ids()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    assert isinstance(_rule(engine, model.layer), ElementwiseGainHandler)
    with engine.recording(BATCH):
        _loss(model, ids).backward()
    engine.finish_backward()
    assert engine.verified
    with pytest.raises(ValueError, match="depends on the other examples"):
        check_example_independence(engine, model, {"ids": ids}, lambda m, batch: _loss(m, batch["ids"]), BATCH)


def test_under_the_generic_rule_a_module_that_mixes_examples_fails_the_self_check(monkeypatch):
    """Replayed one example at a time, its per-example gradients do not add up to autograd's."""
    monkeypatch.setattr("hf_private.engine.layers.rules.matched_handler", lambda module, trainable: None)
    model = Tower(BatchCentredGain(6)).double()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with engine.recording(BATCH):
        _loss(model, _ids()).backward()
    with pytest.raises(UnsupportedLayerError, match="layer.weight: the per-example gradients seen by hooks do not add"):
        engine.finish_backward()


def test_a_dedicated_rule_that_covers_only_part_of_a_module_hands_it_whole_to_another_rule():
    conv = nn.Conv1d(2, 2, 1)
    assert type(rule_for(conv, {"bias"})).__name__ == "ConvBiasHandler"
    assert isinstance(rule_for(conv, {"weight", "bias"}), ModuleVJPHandler)


class ShiftedGainNorm(nn.Module):
    """out = x̂ ⊙ w + 0.5·x̂: affine in w with an offset that is neither 0 nor n(x): two forwards in the backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        normalized = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normalized * (self.weight + 0.5)


@pytest.mark.parametrize(
    "norm, unit_gain", [(CentredNormWithoutBias, 1.0), (OnePlusGainNorm, 0.0), (ShiftedGainNorm, None)]
)
def test_the_gain_rule_reads_the_normalisation_off_one_forward_where_the_probe_found_how(norm, unit_gain):
    torch.manual_seed(0)
    model = Tower(norm(6)).double()
    engine = _assert_matches_oracle(model, rtol=1e-7)
    assert _rule(engine, model.layer).unit_gain == unit_gain


class TokenMixer(nn.Module):
    """Sees the chunk's tokens flattened to rows, as a mixture of experts' layers do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width))

    def forward(self, x):
        return (x.reshape(-1, x.shape[-1]) @ self.weight).reshape(x.shape)


class Flattened(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mixer = TokenMixer(width)

    def forward(self, x):
        return self.mixer(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def test_the_generic_rule_refuses_a_module_whose_rows_are_not_the_chunks():
    """Replayed per row, a module fed flattened tokens would get per-token gradients (and hold one copy per token):
    refused in the forward, naming the module."""
    model = Tower(Flattened(6))
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with pytest.raises(UnsupportedLayerError, match=r"TokenMixer's output has shape \(20, 6\) in a chunk of 4 rows"):
        with engine.recording(BATCH):
            _loss(model, _ids())
