"""LoRA on a mixture of experts' parameters: PEFT's `ParamWrapper` around the router and the fused experts.

`LoraConfig(target_parameters=[...])`, and `target_modules="all-linear"` on Mixtral, Qwen3-MoE and OLMoE, wrap the
router's `weight` [E, H] and the experts' `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (two parameters of one
module: a ParamWrapper inside a ParamWrapper). While the base module runs, each wrapper adds ΔW = s·B·A to its
parameter (a parametrization), so lora_A and lora_B are never called as modules and no hook of theirs sees a
gradient. This rule is the outermost wrapper's: it claims every adapter factor of the chain, records the base
module's inputs (the router's tokens; the experts' tokens, chosen experts and routing weights), and replays the base
with the weights the forward used (W + ΔW):

* **router**: logits = x (W + s·B A)ᵀ. With G = ∂L/∂logits per token, ∂A = Σ_t (s·G_t B) ⊗ x_t and
  ∂B = Σ_t G_t ⊗ (s·A x_t): two linear-layer terms, factored as the router's own.
* **experts**: the replay (`_routed_factors`) gives one factor pair (left ⊗ right) per routed (token, expert) pair, so
  expert e's adapter gradients are ∂A_e = Σ (s·B_eᵀ left) ⊗ right and ∂B_e = Σ left ⊗ (s·A_e right) over the example's
  pairs routed to e. They are instantiated per example (`SampleTerm`, [B, E·r, in] and [B, out, r·E]): E·r·(in + out)
  values per example, fewer than the routed factors T·k·(r + in) whenever E·r < T·k (every model's shape at a useful
  sequence length), and PEFT's interleaved lora_B (expert e's column i at i·E + e) needs no term type of its own.

PEFT's layout (lora_A: [E·r, in], expert e's rows e·r …; lora_B: [out, r·E]) is checked against PEFT's own ΔW on
random factors when the engine is built: a misread layout would be wrong only once B ≠ 0, after the first-chunk check.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from ..terms import SampleTerm, Term, in_compute_dtype, outer_product_term
from .base import LayerHandler, UnsupportedLayerError
from .moe import _PACKED_REFUSAL, FusedExpertsHandler, TopKRouterHandler, _chunk_tokens, _forward_compute_dtype
from .registry import handler_for, register_layer

_WHAT_TO_DO = (
    "Target the attention projections only (LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'])), "
    "or train the router and experts fully (full DP trains them per example)."
)


def wrapper_chain(wrapper: nn.Module) -> tuple[list[tuple[str, Any]], nn.Module]:
    """The nested ParamWrappers from the outermost, each with its name prefix inside it, and the base module."""
    chain, prefix, module = [], "", wrapper
    while isinstance(module, ParamWrapper):
        chain.append((prefix, module))
        prefix, module = f"{prefix}base_layer.", module.base_layer
    return chain, module


def _used_adapters(wrapper: Any) -> list[str]:
    """The adapters whose ΔW the wrapper's forward adds (none when disabled or merged into the weight)."""
    if wrapper.disable_adapters or wrapper.merged:
        return []
    return [name for name in wrapper.active_adapters if name in wrapper.lora_A]


def _factor_names(prefix: str, adapter: str) -> tuple[str, str]:
    return f"{prefix}lora_A.{adapter}.weight", f"{prefix}lora_B.{adapter}.weight"


def adapter_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B [E, out, r], A [E, r, in]) with expert e's ΔW_e = s·B[e] A[e], as PEFT lays them out (E = 1: a 2-D weight)."""
    return lora_b.reshape(lora_b.shape[0], -1, experts).permute(2, 0, 1), lora_a.reshape(experts, -1, lora_a.shape[1])


def _as_lora_a(grad: torch.Tensor) -> torch.Tensor:
    """Per-example ∂A [B, E, r, in] in lora_A's layout [B, E·r, in]."""
    return grad.flatten(1, 2)


def _as_lora_b(grad: torch.Tensor) -> torch.Tensor:
    """Per-example ∂B [B, E, out, r] in lora_B's layout [B, out, r·E] (expert e's column i at i·E + e)."""
    return grad.permute(0, 2, 3, 1).flatten(2)


def _effective_weight(wrapper: Any) -> torch.Tensor:
    """The wrapped parameter as the forward used it: W + Σ ΔW over the adapters the wrapper adds."""
    with torch.no_grad():
        weight = wrapper.get_param().detach()
        for adapter in _used_adapters(wrapper):
            weight = weight + wrapper.get_delta_weight(adapter)
    return weight


def _layout_matches_peft(wrapper: Any) -> bool:
    """PEFT's own ΔW of random factors equals s·B[e] A[e] as `adapter_factors` reads them (its `get_delta_weight`, and
    `get_delta_factors`, the forward's path for one adapter on experts, where this PEFT has it)."""
    adapter = next(iter(wrapper.lora_A))
    generator = torch.Generator().manual_seed(0)
    lora_a, lora_b = (
        torch.randn(factor[adapter].weight.shape, generator=generator, dtype=torch.float64)
        for factor in (wrapper.lora_A, wrapper.lora_B)
    )
    probe = SimpleNamespace(  # PEFT's methods run on random factors, never on the model's own
        lora_A={adapter: SimpleNamespace(weight=lora_a)},
        lora_B={adapter: SimpleNamespace(weight=lora_b)},
        scaling={adapter: 1.0},
        num_experts=wrapper.num_experts,
        fan_in_fan_out=wrapper.fan_in_fan_out,
        _did_swap_in_out_features=wrapper._did_swap_in_out_features,
        get_param=lambda: torch.empty(0, dtype=torch.float64),
    )
    b_factor, a_factor = adapter_factors(lora_a, lora_b, wrapper.num_experts)
    ours = torch.bmm(b_factor, a_factor).reshape(wrapper.get_param().shape)
    try:
        deltas = [type(wrapper).get_delta_weight(probe, adapter)]
        if wrapper.num_experts > 1 and hasattr(type(wrapper), "get_delta_factors"):
            lhs, rhs, scale = type(wrapper).get_delta_factors(probe, adapter)
            deltas.append(scale * torch.bmm(lhs, rhs))
    except Exception:  # a PEFT whose internals differ: not the layout this rule reads
        return False
    return all(delta.shape == ours.shape and torch.allclose(delta, ours, atol=1e-10) for delta in deltas)


def parameter_wrapper_refusal(wrapper: nn.Module) -> str | None:
    """Why the LoRA adapters of a ParamWrapper chain (given its outermost wrapper) get no exact per-example gradient,
    or None when this rule computes them."""
    chain, base = wrapper_chain(wrapper)
    base_rule = handler_for(base)
    names = sorted(w.parameter_name for _, w in chain)
    where = f"{type(base).__name__}.{'/'.join(names)}"
    if isinstance(base_rule, TopKRouterHandler):
        supported = names == ["weight"]
    else:
        supported = isinstance(base_rule, FusedExpertsHandler) and set(names) <= {"gate_up_proj", "down_proj"}
    if not supported or len(set(names)) != len(names):
        return (
            f"a LoRA adapter on the parameter {where} (PEFT's ParamWrapper) has an exact per-example gradient only "
            "on a mixture of experts' router weight and fused expert tensors (Mixtral, Qwen3-MoE, OLMoE): its B·A is "
            f"added to the weight inside the base module, out of sight of the engine's hooks. {_WHAT_TO_DO}"
        )
    claimed = {id(p) for p in claimed_factors(wrapper).values()}
    other = sorted(n for n, p in wrapper.named_parameters() if p.requires_grad and id(p) not in claimed)
    if other:
        return (
            f"{where} carries LoRA adapters and also trains {other}: only the adapters' factors are computed per "
            "example under a ParamWrapper. Freeze the others (requires_grad=False), as PEFT does."
        )
    for _, w in chain:
        for adapter in w.lora_A:
            dropout = w.lora_dropout[adapter] if adapter in w.lora_dropout else None
            if dropout is not None and not isinstance(dropout, nn.Identity):
                return f"{where}'s adapter {adapter!r} has lora_dropout: set lora_dropout=0 for LoRA on parameters."
            if w.lora_bias.get(adapter) or w.use_dora.get(adapter):
                return f"{where}'s adapter {adapter!r} uses lora_bias or DoRA, which this rule does not compute."
        if w.get_param().dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return f"{where} is stored in {w.get_param().dtype}, to which PEFT adds B·A in a wider type: not replayed."
        if not _layout_matches_peft(w):
            return (
                f"the installed PEFT lays out {where}'s lora_A / lora_B otherwise than this rule reads them (lora_A: "
                "[experts·r, in], lora_B: [out, r·experts]), so their per-example gradients would be wrong. "
                f"{_WHAT_TO_DO}"
            )
    return None


def claimed_factors(wrapper: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable lora_A / lora_B weights of every adapter in the chain, by name inside the outermost wrapper."""
    out: dict[str, nn.Parameter] = {}
    for prefix, w in wrapper_chain(wrapper)[0]:
        for adapter in w.lora_A:
            for name, factor in zip(_factor_names(prefix, adapter), (w.lora_A[adapter], w.lora_B[adapter])):
                if factor.weight.requires_grad:
                    out[name] = factor.weight
    return out


class _WithWeights:
    """The base module as the wrapped forward saw it: the wrapped parameters are W + ΔW, all else is its own."""

    def __init__(self, base: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        self._base, self._weights = base, weights

    def __getattr__(self, name: str) -> Any:
        return self._weights[name] if name in self._weights else getattr(self._base, name)


@register_layer(ParamWrapper)
class ParameterLoraHandler(LayerHandler):
    """Per-example gradients of LoRA adapters on a router's weight or fused expert tensors (the outermost wrapper)."""

    rule = "mixture-of-experts LoRA on parameters"
    packed_refusal = _PACKED_REFUSAL

    def claimed(self, module: nn.Module) -> dict[str, nn.Parameter]:
        return claimed_factors(module)

    def needs_input(self, trainable: set[str]) -> bool:
        return bool(trainable)

    def check(self, module, trainable):
        reason = parameter_wrapper_refusal(module)
        if reason is not None:
            raise UnsupportedLayerError(reason)
        base = wrapper_chain(module)[1]
        base_rule = handler_for(base)
        assert base_rule is not None
        base_rule.check(base, set(base_rule.params))  # the base's forward is the math it replays (probed)

    def before_forward(self, module, args, kwargs, rows):
        """A router's logits are one element of its tuple output, which the engine cannot replace: when nothing
        upstream trains (its tokens need no gradient), its tokens become a leaf that does, so that they carry one."""
        base = wrapper_chain(module)[1]
        if not isinstance(handler_for(base), TopKRouterHandler) or not args or args[0].requires_grad:
            return None
        return (args[0].detach().requires_grad_(True), *args[1:]), kwargs

    def on_forward(self, module, args, kwargs, output, rows, save_input):
        base = wrapper_chain(module)[1]
        base_rule = handler_for(base)
        if isinstance(base_rule, TopKRouterHandler):
            return base_rule.on_forward(base, args, kwargs, output, rows, save_input)
        names = ("hidden_states", "top_k_index", "top_k_weights")
        hidden, index, weights = [*args, *(kwargs[n] for n in names[len(args) :])][:3]
        _chunk_tokens(base, hidden.shape[0], rows)
        # an empty [rows, 0] tensor carries the chunk's rows and the dtype the forward's matmuls ran in
        marker = torch.empty(rows, 0, dtype=_forward_compute_dtype(base, hidden))
        return ((hidden, index, weights, marker) if save_input else None), output

    def terms(self, module, saved, grad_output, trainable):
        chain, base = wrapper_chain(module)
        if isinstance(handler_for(base), TopKRouterHandler):
            return _router_terms(chain[0][1], saved, grad_output, trainable)
        return _experts_terms(chain, base, saved, grad_output, trainable)


def _router_terms(wrapper: Any, saved: torch.Tensor, grad_output: torch.Tensor, trainable: set[str]) -> dict:
    grads = grad_output.reshape(*saved.shape[:2], -1)  # G = ∂L/∂logits [rows, T, E]
    tokens = in_compute_dtype(saved, grads)
    out: dict[str, Term] = {}
    for adapter in _used_adapters(wrapper):
        name_a, name_b = _factor_names("", adapter)
        b_factor, a_factor = (f[0].to(grads.dtype) for f in adapter_factors(*_lora_weights(wrapper, adapter), 1))
        scale = wrapper.scaling[adapter]
        if name_a in trainable:
            out[name_a] = outer_product_term(left=scale * grads @ b_factor, right=tokens)
        if name_b in trainable:
            out[name_b] = outer_product_term(left=grads, right=scale * tokens @ a_factor.t())
    return out


def _experts_terms(chain: list, base: Any, saved: Any, grad_output: torch.Tensor, trainable: set[str]) -> dict:
    hidden, index, weights, marker = saved
    rows = marker.shape[0]
    effective = _WithWeights(base, {w.parameter_name: _effective_weight(w) for _, w in chain})
    with torch.autocast(hidden.device.type, enabled=False):  # replayed in the dtype the forward's matmuls ran in
        factors = _routed_factors(effective, hidden, index, weights, grad_output.to(marker.dtype))
    example = factors["token"] // _chunk_tokens(base, hidden.shape[0], rows)
    out: dict[str, Term] = {}
    for prefix, wrapper in chain:
        left, right = factors[wrapper.parameter_name]
        for adapter in _used_adapters(wrapper):
            names = _factor_names(prefix, adapter)
            if not any(name in trainable for name in names):
                continue
            b_factor, a_factor = (
                f.to(left.dtype) for f in adapter_factors(*_lora_weights(wrapper, adapter), base.num_experts)
            )
            grad_a, grad_b = _expert_adapter_grads(
                left, right, example, factors["expert"], rows, b_factor, a_factor, wrapper.scaling[adapter]
            )
            for name, grad in zip(names, (_as_lora_a(grad_a), _as_lora_b(grad_b))):
                if name in trainable:
                    out[name] = SampleTerm(grad)
    return out


def _routed_factors(
    module: Any, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, grad_output: torch.Tensor
) -> dict[str, Any]:
    """Replay each expert on its (token, expert) pairs: the token and expert of every pair, sorted by expert, and the
    factors of both weights' gradients per pair (down_proj: w·G ⊗ h; gate_up_proj: ∂L/∂[gate, up] ⊗ x)."""
    top_k = index.shape[1]
    expert, order = torch.sort(index.reshape(-1), stable=True)  # by expert, then token: examples stay in order
    token = order // top_k
    pair_weight = weights.reshape(-1)[order].to(grad_output.dtype).unsqueeze(1)
    dtype = grad_output.dtype
    x = hidden[token].to(dtype)
    out_grad = grad_output[token] * pair_weight  # w·G: the down projection's output gradient
    gate_up_left = x.new_empty(x.shape[0], module.gate_up_proj.shape[1])
    hidden_act = x.new_empty(x.shape[0], module.down_proj.shape[2])
    start = 0
    for e, count in enumerate(torch.bincount(expert, minlength=module.num_experts).tolist()):
        if not count:
            continue
        pairs = slice(start, start + count)
        start += count
        gate, up = (x[pairs] @ module.gate_up_proj[e].detach().to(dtype).t()).chunk(2, dim=-1)
        with torch.enable_grad():
            gate = gate.detach().requires_grad_(True)
            activated = module.act_fn(gate)
        grad_h = out_grad[pairs] @ module.down_proj[e].detach().to(dtype)
        (grad_gate,) = torch.autograd.grad(activated, gate, grad_h * up)
        grad_gate_up = gate_up_left[pairs]  # written in place: ∂L/∂gate, then ∂L/∂up
        grad_gate_up[:, : grad_gate.shape[1]] = grad_gate
        torch.mul(grad_h, activated.detach(), out=grad_gate_up[:, grad_gate.shape[1] :])
        torch.mul(activated.detach(), up, out=hidden_act[pairs])
    return {
        "token": token,
        "expert": expert,
        "gate_up_proj": (gate_up_left, x),
        "down_proj": (out_grad, hidden_act),
    }


def _lora_weights(wrapper: Any, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    return wrapper.lora_A[adapter].weight.detach(), wrapper.lora_B[adapter].weight.detach()


def _expert_adapter_grads(
    left: torch.Tensor,
    right: torch.Tensor,
    example: torch.Tensor,
    expert: torch.Tensor,
    examples: int,
    b_factor: torch.Tensor,
    a_factor: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example ∂A [B, E, r, in] and ∂B [B, E, out, r] from the pairs' factors (left [S, out], right [S, in]) and
    the adapter's B (`b_factor` [E, out, r]) and A (`a_factor` [E, r, in]):
    expert e's ∂A_e = Σ (s·B_eᵀ left) ⊗ right and ∂B_e = Σ left ⊗ (s·A_e right) over each example's pairs routed
    to e."""
    experts, width_out, rank = b_factor.shape
    grad_a = left.new_zeros(examples, experts, rank, right.shape[1])
    grad_b = left.new_zeros(examples, experts, width_out, rank)
    order = torch.argsort(expert * examples + example)  # by expert, then by example: each expert's pairs one slice
    left, right, example = left[order], right[order], example[order]
    start = 0
    for e, count in enumerate(torch.bincount(expert, minlength=experts).tolist()):
        pairs, start = slice(start, start + count), start + count
        if count:
            grad_a[:, e] = _sum_per_example(scale * left[pairs] @ b_factor[e], right[pairs], example[pairs], examples)
            grad_b[:, e] = _sum_per_example(
                left[pairs], scale * right[pairs] @ a_factor[e].t(), example[pairs], examples
            )
    return grad_a, grad_b


def _sum_per_example(left: torch.Tensor, right: torch.Tensor, example: torch.Tensor, examples: int) -> torch.Tensor:
    """[examples, P, D]: Σ left ⊗ right over each example's pairs (`example` sorted), one batched GEMM over the pairs
    padded per example."""
    sizes = torch.bincount(example, minlength=examples)
    slot = torch.arange(example.numel(), device=example.device) - (torch.cumsum(sizes, 0) - sizes)[example]
    longest = int(sizes.max())
    padded_left = left.new_zeros(examples, longest, left.shape[1])
    padded_right = right.new_zeros(examples, longest, right.shape[1])
    padded_left[example, slot] = left
    padded_right[example, slot] = right
    return torch.bmm(padded_left.transpose(1, 2), padded_right)
