"""RGP building blocks (hf_private.methods.sparse_lowrank.rgp): the reparametrized layer, carriers, reconstruction and
model surgery, plus the per-example gradient engine on wrapped models against an fp64 per-example autograd loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_private.engine import PerExampleGradientEngine
from hf_private.methods.sparse_lowrank.rgp import (
    RGPLinear,
    full_weight_gradient,
    gradient_carriers,
    set_carriers,
    unwrap_rgp,
    wrap_rgp,
)
from hf_private.privacy.rng import SecretRandom
from tests.engine.test_engine_oracle import BATCH, _batch, _loss, _oracle
from tests.support import tiny

IN, OUT, RANK = 7, 5, 3


def _layer(kind: str, bias: bool = True) -> nn.Module:
    """A small fp64 Linear [out=5, in=7] or Conv1D (nf=5, nx=7, weight [in, out]) with a non-zero bias."""
    torch.manual_seed(0)
    layer = (nn.Linear(IN, OUT, bias=bias) if kind == "linear" else Conv1D(OUT, IN)).double()
    if layer.bias is not None:
        nn.init.normal_(layer.bias)
    return layer


def _w_out_in(layer: nn.Module) -> torch.Tensor:
    return layer.weight.t() if isinstance(layer, Conv1D) else layer.weight


def _orthonormal(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A [rows, cols] fp64 matrix with orthonormal columns (rows >= cols)."""
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def _projection(grad, left, right):
    """P(∂W) = ∂W − (I − LLᵀ) ∂W (I − RᵀR): the orthogonal projection onto col-span L ∪ row-span R."""
    eye_out, eye_in = torch.eye(left.shape[0], dtype=grad.dtype), torch.eye(right.shape[1], dtype=grad.dtype)
    return grad - (eye_out - left @ left.T) @ grad @ (eye_in - right.T @ right)


def _reference_code_plus_sign(grad_left, grad_right, left, right):
    """dayu11's reconstruction: m1 = (∂L)R + L(∂R); m2 = L(Lᵀ((∂L)R)); m1 + m2."""
    m1 = grad_left @ right + left @ grad_right
    return m1 + left @ (left.T @ (grad_left @ right))


# ---------------------------------------------------------------------- the wrapped layer
@pytest.mark.parametrize("kind,bias", [("linear", True), ("linear", False), ("conv1d", True)])
def test_forward_and_input_gradient_equal_the_original_layer_in_fp64(kind, bias):
    """The wrapped layer's output and input gradient equal the original's (fp64), with or without grad mode."""
    layer = _layer(kind, bias)
    wrapper = RGPLinear(copy.deepcopy(layer), RANK)
    set_carriers(wrapper, torch.Generator().manual_seed(1))
    x = torch.randn(4, 6, IN, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 6, OUT, dtype=torch.float64)
    expected = layer(x)
    (grad_x_expected,) = torch.autograd.grad((expected * upstream).sum(), x)
    out = wrapper(x)
    (grad_x,) = torch.autograd.grad((out * upstream).sum(), x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_x, grad_x_expected, rtol=0, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(wrapper(x), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_gradients_reach_only_the_carriers_as_projections_of_the_weight_gradient(kind):
    """∂L = (∂W)Rᵀ and ∂R = Lᵀ(∂W) for the original layer's ∂W; W and b stay frozen and get no gradient."""
    layer = _layer(kind)
    wrapper = RGPLinear(copy.deepcopy(layer), RANK)
    set_carriers(wrapper, torch.Generator().manual_seed(2))
    assert not wrapper.weight.requires_grad and not wrapper.bias.requires_grad
    x = torch.randn(3, 4, IN, dtype=torch.float64)
    upstream = torch.randn(3, 4, OUT, dtype=torch.float64)
    (layer(x) * upstream).sum().backward()
    (wrapper(x) * upstream).sum().backward()
    grad_w = _w_out_in(layer).grad if kind == "linear" else layer.weight.grad.t()
    left, right = wrapper.left.weight.detach(), wrapper.right.weight.detach()
    torch.testing.assert_close(wrapper.left.weight.grad, grad_w @ right.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wrapper.right.weight.grad, left.T @ grad_w, rtol=1e-12, atol=1e-12)
    assert wrapper.weight.grad is None and wrapper.bias.grad is None


def test_wrapper_keeps_the_original_parameters_and_names():
    """The wrapper holds the very weight/bias Parameters (Conv1D layout kept) under their names, plus left/right."""
    layer = _layer("conv1d")
    weight, bias = layer.weight, layer.bias
    wrapper = RGPLinear(layer, RANK)
    assert wrapper.weight is weight and wrapper.bias is bias and tuple(wrapper.weight.shape) == (IN, OUT)
    assert list(wrapper.state_dict()) == ["weight", "bias", "left.weight", "right.weight"]
    assert tuple(wrapper.left.weight.shape) == (OUT, RANK) and tuple(wrapper.right.weight.shape) == (RANK, IN)
    assert wrapper.weight_out_in().shape == (OUT, IN) and wrapper.weight_out_in().data_ptr() == weight.data_ptr()
    assert wrapper.unwrap() is layer and layer.weight.requires_grad and layer.bias.requires_grad


# ---------------------------------------------------------------------- carriers
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.float32)])
def test_carriers_are_orthonormal_in_at_least_fp32(dtype, out_dtype):
    """L has orthonormal columns and R orthonormal rows, computed in fp32 at least (fp64 kept)."""
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).to(dtype)
    left, right = gradient_carriers(weight, RANK, torch.Generator().manual_seed(1))
    assert left.shape == (OUT, RANK) and right.shape == (RANK, IN) and left.dtype == right.dtype == out_dtype
    eye = torch.eye(RANK, dtype=out_dtype)
    torch.testing.assert_close(left.T @ left, eye, rtol=0, atol=1e-5)
    torch.testing.assert_close(right @ right.T, eye, rtol=0, atol=1e-5)
    zero_left, zero_right = gradient_carriers(torch.zeros(OUT, IN), RANK, torch.Generator().manual_seed(1))
    torch.testing.assert_close(zero_left.T @ zero_left, torch.eye(RANK), rtol=0, atol=1e-5)  # rank-deficient W
    torch.testing.assert_close(zero_right @ zero_right.T, torch.eye(RANK), rtol=0, atol=1e-5)


def test_carriers_are_one_power_iteration_from_the_generator():
    """L = orth(W R0), R = orth(Wᵀ L) with R0 ~ N(0,1)^{in×k} from the given generator, as in the reference code."""
    weight = torch.randn(OUT, IN, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    left, right = gradient_carriers(weight, RANK, torch.Generator().manual_seed(5))
    start = torch.randn(IN, RANK, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    expected_left, _ = torch.linalg.qr(weight @ start)
    expected_right, _ = torch.linalg.qr(weight.T @ expected_left)
    torch.testing.assert_close(left, expected_left, rtol=0, atol=1e-12)
    torch.testing.assert_close(right, expected_right.T, rtol=0, atol=1e-12)


def test_carriers_capture_a_rank_k_weight_exactly():
    """For a W of rank k, the power iteration's spans are W's: LLᵀW = W and WRᵀR = W."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT, RANK, dtype=torch.float64, generator=gen) @ torch.randn(
        RANK, IN, dtype=torch.float64, generator=gen
    )
    left, right = gradient_carriers(weight, RANK, torch.Generator().manual_seed(1))
    torch.testing.assert_close(left @ left.T @ weight, weight, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight @ right.T @ right, weight, rtol=0, atol=1e-12)


def test_carriers_use_only_their_own_generator_which_advances():
    """Same seed → same carriers; successive draws differ (no reseeding); the global RNG is not touched."""
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0))
    model = tiny.bert()  # built first: tiny.bert() seeds the global RNG itself
    state = torch.get_rng_state()
    gen = torch.Generator().manual_seed(7)
    first, second = gradient_carriers(weight, RANK, gen), gradient_carriers(weight, RANK, gen)
    again = gradient_carriers(weight, RANK, torch.Generator().manual_seed(7))
    wrap_rgp(model, ["query"], 2)  # wrapping draws nothing either (no random init of the carriers)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.allclose(first[0] @ first[0].T, second[0] @ second[0].T)  # other start → other span (rank < out)


def test_carrier_arguments_are_checked():
    """rank outside 1..min(out, in), a non-matrix weight and a non-torch.Generator (the secret stream) are refused."""
    weight, gen = torch.randn(OUT, IN), torch.Generator().manual_seed(0)
    for rank in (0, min(OUT, IN) + 1, 2.0):
        with pytest.raises(ValueError, match="rank"):
            gradient_carriers(weight, rank, gen)
    with pytest.raises(ValueError, match="2-D"):
        gradient_carriers(torch.randn(OUT), 1, gen)
    with pytest.raises(TypeError, match="torch.Generator"):
        gradient_carriers(weight, RANK, SecretRandom(test_seed=0))
    with pytest.raises(ValueError, match="rank"):
        RGPLinear(_layer("linear"), OUT + 1)


def test_set_carriers_writes_in_place_and_keeps_the_forward():
    """set_carriers overwrites the same left/right Parameters with gradient_carriers(W) and the output is unchanged."""
    layer = _layer("conv1d")
    wrapper = RGPLinear(copy.deepcopy(layer), RANK)
    left_param, right_param = wrapper.left.weight, wrapper.right.weight
    with torch.no_grad():
        wrapper.weight.add_(0.5)  # a step on W: carriers follow the current weight
        layer.weight.add_(0.5)
    set_carriers(wrapper, torch.Generator().manual_seed(3))
    left, right = gradient_carriers(wrapper.weight_out_in(), RANK, torch.Generator().manual_seed(3))
    assert wrapper.left.weight is left_param and wrapper.right.weight is right_param
    assert torch.equal(left_param.detach(), left) and torch.equal(right_param.detach(), right)
    x = torch.randn(2, 3, IN, dtype=torch.float64)
    torch.testing.assert_close(wrapper(x), layer(x), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------- reconstruction of ∂W
def test_paper_reconstruction_is_the_orthogonal_projection():
    """(∂L)R + L(∂R) − LLᵀ(∂L)R = P(∂W), idempotent, identity on the subspace, residual orthogonal to it."""
    left, right = _orthonormal(OUT, 2, 1), _orthonormal(IN, 2, 2).T
    grad = torch.randn(OUT, IN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def reconstruct(g):
        return full_weight_gradient(g @ right.T, left.T @ g, left, right)

    projected = reconstruct(grad)
    torch.testing.assert_close(projected, _projection(grad, left, right), rtol=0, atol=1e-12)
    torch.testing.assert_close(reconstruct(projected), projected, rtol=0, atol=1e-12)
    inside = left @ torch.randn(2, IN, dtype=torch.float64) + torch.randn(OUT, 2, dtype=torch.float64) @ right
    torch.testing.assert_close(reconstruct(inside), inside, rtol=0, atol=1e-12)
    assert abs(((grad - projected) * projected).sum().item()) < 1e-12
    assert projected.norm() <= grad.norm()


def test_reference_code_plus_sign_is_not_a_projection():
    """The reference code's `+` counts LLᵀ∂WRᵀR three times: not idempotent, and it triples a gradient in both spans."""
    left, right = _orthonormal(OUT, 2, 1), _orthonormal(IN, 2, 2).T
    grad = torch.randn(OUT, IN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def plus(g):
        return _reference_code_plus_sign(g @ right.T, left.T @ g, left, right)

    once = plus(grad)
    torch.testing.assert_close(once - _projection(grad, left, right), 2 * left @ left.T @ grad @ right.T @ right)
    assert (plus(once) - once).norm() > 0.1 * once.norm()  # applying it again changes the result
    both = left @ torch.randn(2, 2, dtype=torch.float64) @ right  # in col-span L and in row-span R
    torch.testing.assert_close(plus(both), 3 * both)  # a projection would leave it unchanged
    assert plus(both).norm() > both.norm()  # no orthogonal projection can increase a norm
    torch.testing.assert_close(full_weight_gradient(both @ right.T, left.T @ both, left, right), both)


def test_weight_gradient_in_the_module_layout():
    """RGPLinear.weight_gradient gives full_weight_gradient in the module's layout ([in, out] for Conv1D)."""
    wrapper = RGPLinear(_layer("conv1d"), RANK)
    set_carriers(wrapper, torch.Generator().manual_seed(0))
    grad_left, grad_right = torch.randn(OUT, RANK, dtype=torch.float64), torch.randn(RANK, IN, dtype=torch.float64)
    out_in = full_weight_gradient(grad_left, grad_right, wrapper.left.weight, wrapper.right.weight)
    assert out_in.shape == (OUT, IN) and not out_in.requires_grad
    assert torch.equal(wrapper.weight_gradient(grad_left, grad_right), out_in.T)
    assert wrapper.weight_gradient(grad_left, grad_right).shape == wrapper.weight.shape
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        wrapper.to_weight_layout(out_in.T)
    with pytest.raises(ValueError, match="Shapes"):
        full_weight_gradient(grad_left.T, grad_right, wrapper.left.weight, wrapper.right.weight)


# ---------------------------------------------------------------------- model surgery
MODELS = {  # name: (factory, causal LM?, targets, trainable head)
    "bert": (tiny.bert, False, ["query", "value", "intermediate.dense", "output.dense"], "classifier"),
    "gpt2": (tiny.gpt2, True, ["c_attn", "c_proj", "c_fc"], None),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_wrap_then_unwrap_restores_the_plain_model(name):
    """Wrapping keeps the outputs and the original state_dict entries; unwrapping gives back the same modules/state."""
    factory, causal, targets, _ = MODELS[name]
    model = factory().double().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    batch = {k: v for k, v in _batch(causal).items() if k != "labels"}
    logits = model(**batch).logits
    wrapped = wrap_rgp(model, targets, 2, generator=torch.Generator().manual_seed(0))
    assert all(type(modules[n]) in (nn.Linear, Conv1D) and isinstance(w, RGPLinear) for n, w in wrapped.items())
    assert len(wrapped) == {"bert": 10, "gpt2": 8}[name]
    assert list(wrapped) == [n for n, m in model.named_modules() if isinstance(m, RGPLinear)]
    state = model.state_dict()
    assert set(state) == set(before) | {f"{n}.{c}.weight" for n in wrapped for c in ("left", "right")}
    assert all(torch.equal(state[k], v) for k, v in before.items())
    assert not any(w.weight.requires_grad or w.bias.requires_grad for w in wrapped.values())
    torch.testing.assert_close(model(**batch).logits, logits, rtol=0, atol=1e-12)
    unwrap_rgp(model, wrapped)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(m is modules[n] for n, m in model.named_modules()) and len(dict(model.named_modules())) == len(modules)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def test_unwrap_keeps_weights_updated_while_wrapped():
    """A step taken on W while wrapped survives unwrapping (same Parameter objects)."""
    model = tiny.bert()
    wrapped = wrap_rgp(model, ["bert.encoder.layer.1.attention.self.value"], 2)
    expected = model.state_dict()["bert.encoder.layer.1.attention.self.value.weight"] + 1.0
    with torch.no_grad():
        wrapped["bert.encoder.layer.1.attention.self.value"].weight.add_(1.0)
    unwrap_rgp(model)  # default: every RGPLinear in the model
    assert type(model.bert.encoder.layer[1].attention.self.value) is nn.Linear
    assert torch.equal(model.state_dict()["bert.encoder.layer.1.attention.self.value.weight"], expected)


def test_target_matching_full_names_and_suffixes():
    """Entries match full dotted names or name suffixes at a dot boundary; bad targets leave the model untouched."""
    model = tiny.bert()
    assert list(wrap_rgp(copy.deepcopy(model), ["bert.encoder.layer.0.attention.self.query"], 2)) == [
        "bert.encoder.layer.0.attention.self.query"
    ]
    assert list(wrap_rgp(copy.deepcopy(model), ["self.key"], 2)) == [
        "bert.encoder.layer.0.attention.self.key",
        "bert.encoder.layer.1.attention.self.key",
    ]
    cases = [
        (["uery"], ValueError, "match no module"),
        (["attention"], TypeError, "BertAttention"),
        (["query", "classifier"], ValueError, "rank"),
        ("query", TypeError, "list"),
    ]
    for targets, error, message in cases:  # classifier is 2×32: rank 3 is too large, and nothing is wrapped
        with pytest.raises(error, match=message):
            wrap_rgp(model, targets, 3)
        assert not any(isinstance(m, RGPLinear) for m in model.modules())
    wrap_rgp(model, ["query"], 2)
    with pytest.raises(ValueError, match="already an RGPLinear"):
        wrap_rgp(model, ["query"], 2)


# ---------------------------------------------------------------------- the per-example gradient engine
@pytest.mark.parametrize("name", list(MODELS))
def test_engine_clips_the_carrier_gradients_like_a_per_example_loop(name):
    """The engine's norms and clipped sums on a wrapped model equal an fp64 per-example loop, and its norms are
    those of each example's projected ∂W (∂W Rᵀ, Lᵀ ∂W) from the unwrapped model (plus the head)."""
    factory, causal, targets, head = MODELS[name]
    model = factory().double().train()
    model.requires_grad_(False)
    if head:
        model.get_submodule(head).requires_grad_(True)
    original = copy.deepcopy(model)
    wrapped = wrap_rgp(model, targets, 2, generator=torch.Generator().manual_seed(0))
    batch = _batch(causal)
    ref_norms, ref_sums, params, clip = _oracle(model, batch)
    assert len(params) == 2 * len(wrapped) + (2 if head else 0)

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    ref = torch.cat([s.flatten() for s in ref_sums])
    for verified in (False, True):  # the self-checked chunk, then ghost differentiation
        assert engine.verified is verified
        with engine.recording(BATCH):
            _loss(model, batch).backward()
        norms = engine.finish_backward()
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
        sums = engine.pop_clipped_sums()
        assert ((torch.cat([sums[p].flatten() for p in params]) - ref).norm() / ref.norm()).item() <= 1e-9
    engine.detach()

    weights = {n: original.get_submodule(n).weight for n in wrapped}
    for p in weights.values():
        p.requires_grad_(True)
    head_params = [p for p in original.parameters() if p.requires_grad and all(p is not w for w in weights.values())]
    for b in range(BATCH):
        original.zero_grad()
        _loss(original, {k: v[b : b + 1] for k, v in batch.items()}).backward()
        squared = sum(p.grad.pow(2).sum() for p in head_params) if head_params else 0.0
        for n, w in wrapped.items():
            grad = weights[n].grad.t() if w.is_conv1d else weights[n].grad
            squared += (grad @ w.right.weight.T).pow(2).sum() + (w.left.weight.T @ grad).pow(2).sum()
        torch.testing.assert_close(torch.sqrt(squared), ref_norms[b], rtol=1e-9, atol=0)
