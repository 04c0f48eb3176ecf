"""Mixture of experts (Mixtral, Qwen3-MoE, OLMoE): the top-k router and the fused expert weights.

Their sparse MoE block flattens the chunk's [B, T, H] hidden states to N = B·T token rows before the router and the
experts see them, so both rules reshape tokens back to the chunk's rows (refusing a token count that is not a
multiple of them, and packed rows, whose examples cannot be told apart in the flattened tokens):

* **router** (`*TopKRouter`, weight [E, H]): logits = x Wᵀ, a linear layer on tokens. The rule watches the logits
  (the first output): the routing weights derive from them inside the forward, so their gradient is the total.
* **experts** (`*Experts`, `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]): each (token, expert) pair the router
  chose computes w·W_down[e] (act(gate)·up) with [gate, up] = W_gate_up[e] x. An expert's per-example gradient is a
  linear layer's over the example's tokens routed to it, so the backward hook replays each expert's small graph on
  its pairs from the saved (tokens, chosen experts, routing weights) and hands over the factors per pair
  (down_proj: w·G ⊗ h, gate_up_proj: ∂L/∂[gate, up] ⊗ x) to `terms.routed_outer_term`, which keeps them or forms
  the [B, E, P, D] gradients, whichever is smaller. The replay does not depend on the forward's kernel ("eager",
  "grouped_mm", "batched_mm"), and the rule is given only to modules whose output equals that math on random inputs
  (checked once when the engine is built).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeExperts, OlmoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from ..terms import Term, in_compute_dtype, outer_product_term, routed_outer_term
from .base import LayerHandler, UnsupportedLayerError
from .registry import handler_for, register_layer

_PROBE_TOKENS = 6
# A wrong form misses by O(1) on random values; the forward may route its weights through float32 (Mixtral).
_PROBE_TOLERANCE = 1e-4


def _forward_compute_dtype(module: Any, hidden: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls ran in: autocast's where it reaches them (eager's F.linear, batched_mm's bmm),
    else the weights' (grouped_mm casts its input to them)."""
    device = hidden.device.type
    kernel = getattr(getattr(module, "config", None), "_experts_implementation", "eager")
    if torch.is_autocast_enabled(device) and kernel != "grouped_mm":
        return torch.get_autocast_dtype(device)
    return module.gate_up_proj.dtype


def _chunk_tokens(module: nn.Module, tokens: int, rows: int) -> int:
    """Tokens per row of the chunk: the block flattened [rows, T, H] to rows·T token rows."""
    if rows < 1 or tokens % rows:
        raise UnsupportedLayerError(
            f"{type(module).__name__} saw {tokens} token rows in a chunk of {rows} rows: they are not the chunk's "
            "rows times a sequence length, so its tokens cannot be assigned to examples. Pad each example to a row "
            "of its own (packed rows are not supported for mixture-of-experts layers)."
        )
    return tokens // rows


_PACKED_REFUSAL = (
    "a mixture-of-experts block flattens the chunk's rows to tokens before its router and experts, so the examples "
    "packed end to end in a row cannot be told apart there. Pad each example to a row of its own (no packing) for "
    "mixture-of-experts models."
)


def _first_input(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@register_layer(MixtralTopKRouter, Qwen3MoeTopKRouter, OlmoeTopKRouter)
class TopKRouterHandler(LayerHandler):
    """The router's weight gradient Σ_t G_t x_tᵀ over each example's tokens, G = ∂L/∂logits."""

    rule = "mixture-of-experts router (factored)"
    packed_refusal = _PACKED_REFUSAL
    params = ("weight",)
    input_params = ("weight",)

    def check(self, module, trainable):
        if not _router_logits_are_linear(module):
            raise UnsupportedLayerError(
                f"{type(module).__name__}'s first output is not F.linear(hidden_states, weight) on random inputs, so "
                "the router rule would be wrong for it. Freeze the router (requires_grad=False)."
            )

    def before_forward(self, module, args, kwargs, rows):
        """The logits are one element of the router's tuple output, which the engine cannot replace: when nothing
        upstream trains (the tokens need no gradient), the tokens become a leaf that does, so that the logits carry
        one."""
        hidden = _first_input(args, kwargs)
        if hidden.requires_grad:
            return None
        leaf = hidden.detach().requires_grad_(True)
        return ((leaf, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": leaf})

    def on_forward(self, module, args, kwargs, output, rows, save_input):
        tokens = _first_input(args, kwargs).reshape(-1, module.weight.shape[1])
        per_row = _chunk_tokens(module, tokens.shape[0], rows)
        return tokens.reshape(rows, per_row, -1), output[0]

    def terms(self, module, saved, grad_output, trainable):
        grads = grad_output.reshape(*saved.shape[:2], -1)
        return {"weight": outer_product_term(left=grads, right=in_compute_dtype(saved, grads))}


@register_layer(MixtralExperts, Qwen3MoeExperts, OlmoeExperts)
class FusedExpertsHandler(LayerHandler):
    """Per-example gradients of fused expert weights, one factor pair per routed (token, expert) pair."""

    rule = "mixture-of-experts experts (routed, factored)"
    packed_refusal = _PACKED_REFUSAL
    params = ("gate_up_proj", "down_proj")
    input_params = ("gate_up_proj", "down_proj")

    def check(self, module, trainable):
        layout = {
            "has_gate": True,
            "has_bias": False,
            "is_transposed": False,
            "is_concatenated": True,
            "has_post_expert_norm": False,
            "_is_expert_parallel": False,
        }
        found = {name: getattr(module, name, want) for name, want in layout.items()}
        odd = {name: value for name, value in found.items() if value != layout[name]}
        if odd:
            raise UnsupportedLayerError(
                f"{type(module).__name__} has an expert layout the mixture-of-experts rule does not replay ({odd}; it "
                f"replays {layout}). Freeze the experts (requires_grad=False) or train the model with LoRA on the "
                "attention projections."
            )
        if not _forward_matches_replay(module):
            raise UnsupportedLayerError(
                f"{type(module).__name__}'s forward does not compute Σ_k w_k·down[e_k](act(gate)·up) with "
                "[gate, up] = gate_up[e_k] x on random inputs, so the mixture-of-experts rule would be wrong for it. "
                "Freeze the experts (requires_grad=False) or train the model with LoRA on the attention projections."
            )

    def on_forward(self, module, args, kwargs, output, rows, save_input):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        hidden, index, weights = [*args, *(kwargs[n] for n in names[len(args) :])][:3]
        _chunk_tokens(module, hidden.shape[0], rows)
        # an empty [rows, 0] tensor carries the chunk's rows and the dtype the forward's matmuls ran in
        marker = torch.empty(rows, 0, dtype=_forward_compute_dtype(module, hidden))
        return ((hidden, index, weights, marker) if save_input else None), output

    def terms(self, module, saved, grad_output, trainable):
        hidden, index, weights, marker = saved
        rows = marker.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):  # replayed in the forward's dtype, whatever is on
            factors = _routed_factors(module, hidden, index, weights, grad_output.to(marker.dtype))
        pair_example = factors.pop("token") // _chunk_tokens(module, hidden.shape[0], rows)
        out: dict[str, Term] = {}
        for name in ("gate_up_proj", "down_proj"):
            if name in trainable:
                left, right = factors[name]
                out[name] = routed_outer_term(
                    left=left,
                    right=right,
                    example=pair_example,
                    expert=factors["expert"],
                    examples=rows,
                    experts=module.num_experts,
                )
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


def _replayed_output(module: Any, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
    """The experts' output as the rule assumes it is computed (the probe's reference)."""
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for k in range(index.shape[1]):
            e = int(index[token, k])
            gate, up = (module.gate_up_proj[e] @ hidden[token]).chunk(2)
            out[token] += weights[token, k] * (module.down_proj[e] @ (module.act_fn(gate) * up))
    return out


def _router_logits_are_linear(module: nn.Module) -> bool:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(_PROBE_TOKENS, weight.shape[1], generator=generator).to(weight)
        try:
            output = module(hidden)
        except Exception:  # a router that needs more than the hidden states: not the one this rule knows
            return False
        logits = output[0] if isinstance(output, tuple) and output else None
        expected = torch.nn.functional.linear(hidden, weight)
        if not isinstance(logits, torch.Tensor) or logits.shape != expected.shape:
            return False
        scale = expected.abs().max().clamp(min=1.0)
        return bool(((logits - expected).abs().max() <= _PROBE_TOLERANCE * scale).item())


def _forward_matches_replay(module: Any) -> bool:
    weight = module.gate_up_proj
    top_k = min(2, module.num_experts)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(_PROBE_TOKENS, weight.shape[2], generator=generator).to(weight)
        index = torch.rand(_PROBE_TOKENS, module.num_experts, generator=generator).argsort(1)[:, :top_k]
        weights = torch.rand(_PROBE_TOKENS, top_k, generator=generator).to(weight)
        try:
            actual = module(hidden, index.to(weight.device), weights)
        except Exception:  # a forward that needs more, or whose kernel refuses this dtype: not what we replay
            return False
        expected = _replayed_output(module, hidden, index, weights)
        if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
            return False
        scale = expected.abs().max().clamp(min=1.0)
        return bool(((actual - expected).abs().max() <= _PROBE_TOLERANCE * scale).item())


def refuse_parameter_wrappers(model: nn.Module) -> None:
    """Refuse, naming the module, LoRA adapters on parameters (PEFT's `ParamWrapper`: `target_parameters`, and
    `target_modules="all-linear"` on a mixture of experts) that no rule computes per example: their B·A is added to the
    weight inside the base module, out of sight of any hook but the outermost wrapper's rule (`moe_lora`), whose check
    says what it covers. Checked before any layer, also where only the base weights under a wrapper train."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # a PEFT without LoRA on parameters
        return
    inner = {id(module.base_layer) for module in model.modules() if isinstance(module, ParamWrapper)}
    for name, module in model.named_modules():
        if not isinstance(module, ParamWrapper) or id(module) in inner:
            continue
        rule = handler_for(module)
        if rule is not None and any(p.requires_grad for p in module.parameters()):
            try:
                rule.check(module, set(rule.claimed(module)))
            except UnsupportedLayerError as error:
                raise UnsupportedLayerError(f"{name}: {error}") from None
