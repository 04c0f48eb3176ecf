"""Mixture of experts (Mixtral, Qwen3-MoE, OLMoE): the top-k router and the fused expert weights.

Their sparse MoE block flattens the chunk's [B, T, H] hidden states to N = B·T token rows before the router and the
experts see them, so both rules reshape tokens back to the chunk's rows (refusing a token count that is not a
multiple of them, and packed rows, whose examples cannot be told apart in the flattened tokens):

* **router** (`*TopKRouter`, weight [E, H]): logits = x Wᵀ, a linear layer on tokens. The rule watches the logits
  (the first output): the routing weights derive from them inside the forward, so their gradient is the total.
* **experts** (`*Experts`, `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]): each (token, expert) pair the router
  chose computes w·W_down[e] (act(gate)·up) with [gate, up] = W_gate_up[e] x. An expert's per-example gradient is a
  linear layer's over the example's tokens routed to it. While a chunk is recorded the rule computes the experts'
  output itself, expert by expert on the pairs sorted by expert, in the dtype the module's kernel ("eager",
  "grouped_mm", "batched_mm") computes in, and watches the gate/up output and each pair's expert output: the step's
  own backward gives their gradients, the factors per pair (gate_up_proj: ∂L/∂[gate, up] ⊗ x; down_proj: w·G ⊗
  act(gate)·up), which `terms.routed_outer_term` keeps or forms into [B, E, P, D] gradients, whichever is smaller.
  The rule is given only to modules whose own forward and the rule's both equal that math on random inputs (checked
  once when the engine is built).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """Per-example gradients of fused expert weights, one factor pair per routed (token, expert) pair.

    The rule computes the experts' output itself while a chunk is recorded (`owns_forward`), expert by expert on the
    pairs sorted by expert, so that it can watch the two tensors whose gradients are the factors: the gate/up
    projection's output and each pair's expert output. The backward the step runs anyway then hands them over, and
    nothing is replayed."""

    rule = "mixture-of-experts experts (routed, factored)"
    packed_refusal = _PACKED_REFUSAL
    params = ("gate_up_proj", "down_proj")
    input_params = ("gate_up_proj", "down_proj")
    owns_forward = True

    def __init__(self) -> None:
        self._pairs: dict[int, _RoutedPairs] = {}  # module id → its last forward's pairs, until `on_forward`

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
                f"{type(module).__name__} has an expert layout the mixture-of-experts rule does not compute ({odd}; it "
                f"computes {layout}). Freeze the experts (requires_grad=False) or train the model with LoRA on the "
                "attention projections."
            )
        if not _forward_matches_rule(module):
            raise UnsupportedLayerError(
                f"{type(module).__name__}'s forward does not compute Σ_k w_k·down[e_k](act(gate)·up) with "
                "[gate, up] = gate_up[e_k] x on random inputs, so the mixture-of-experts rule would be wrong for it. "
                "Freeze the experts (requires_grad=False) or train the model with LoRA on the attention projections."
            )

    def forward(self, module, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        hidden, index, weights = [*args, *(kwargs[n] for n in names[len(args) :])][:3]
        output, pairs = _routed_forward(module, hidden, index, weights)
        if torch.is_grad_enabled():
            self._pairs[id(module)] = pairs
        return output

    def on_forward(self, module, args, kwargs, output, rows, save_input):
        pairs = self._pairs.pop(id(module))
        _chunk_tokens(module, pairs.tokens, rows)
        expert_output_grad = _ExpertOutputGrad()
        pairs.expert_output.register_hook(expert_output_grad.keep)
        # the tensors go through the engine's stash (recomputed when checkpointed); the box holds no activation
        saved = (pairs.token, pairs.expert, pairs.x, pairs.hidden_act, expert_output_grad, pairs.tokens, rows)
        return (saved if save_input else None), pairs.gate_up

    def terms(self, module, saved, grad_output, trainable):
        token, expert, x, hidden_act, expert_output_grad, tokens, rows = saved
        factors = {
            "gate_up_proj": (grad_output, x),  # ∂L/∂[gate, up] ⊗ x
            "down_proj": (expert_output_grad.take(), hidden_act),  # w·G ⊗ act(gate)·up
        }
        pair_example = token // _chunk_tokens(module, tokens, rows)
        out: dict[str, Term] = {}
        for name in ("gate_up_proj", "down_proj"):
            if name in trainable:
                left, right = factors[name]
                out[name] = routed_outer_term(
                    left=left,
                    right=right.to(left.dtype),
                    example=pair_example,
                    expert=expert,
                    examples=rows,
                    experts=module.num_experts,
                )
        return out


@dataclass
class _RoutedPairs:
    """One recorded forward's (token, expert) pairs, sorted by expert, and the tensors the rule watches in it; handed
    from the rule's forward to its `on_forward`, and dropped there."""

    tokens: int  # the token rows the block flattened the chunk to
    token: torch.Tensor  # each pair's token row
    expert: torch.Tensor  # each pair's expert
    x: torch.Tensor  # each pair's input
    gate_up: torch.Tensor  # [gate, up] = gate_up[e] x: watched, its gradient is the gate_up factor
    hidden_act: torch.Tensor  # act(gate)·up, the down projection's input
    expert_output: torch.Tensor  # down[e] act(gate)·up, before the routing weight: its gradient is w·G


class _ExpertOutputGrad:
    """w·G per pair, from the expert output's gradient hook until the gate/up output's (computed after it) reaches
    the rule."""

    def __init__(self) -> None:
        self._grad: torch.Tensor | None = None

    def keep(self, grad: torch.Tensor) -> None:
        self._grad = grad

    def take(self) -> torch.Tensor:
        grad, self._grad = self._grad, None
        if grad is None:
            raise RuntimeError("The experts' output gradient did not reach the mixture-of-experts rule first.")
        return grad


def _per_expert_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x's rows (sorted by expert, `counts` each) times their expert's weight [E, out, in], transposed."""
    return torch.cat([rows @ weight[e].t() for e, rows in enumerate(x.split(counts))])


def _routed_forward(
    module: Any, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, _RoutedPairs]:
    """Σ_k w_k·down[e_k](act(gate)·up), [gate, up] = gate_up[e_k] x, computed per expert on its pairs in the dtype the
    module's own kernel computes in, with the tensors the rule watches kept."""
    dtype = _forward_compute_dtype(module, hidden)
    top_k = index.shape[1]
    expert, order = torch.sort(index.reshape(-1), stable=True)  # by expert, then token: examples stay in order
    token = order // top_k
    counts = torch.bincount(expert, minlength=module.num_experts).tolist()
    with torch.autocast(hidden.device.type, enabled=False):
        x = hidden[token].to(dtype)
        if torch.is_grad_enabled() and not x.requires_grad:  # nothing upstream trains: the factors still need it
            x = x.detach().requires_grad_(True)
        gate_up = _per_expert_linear(x, module.gate_up_proj.to(dtype), counts)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden_act = module.act_fn(gate) * up
        expert_output = _per_expert_linear(hidden_act, module.down_proj.to(dtype), counts)
        weighted = expert_output * weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(order)
        unsorted[order] = torch.arange(order.numel(), device=order.device)
        output = weighted[unsorted].view(hidden.shape[0], top_k, -1).sum(dim=1)  # the token's pairs in top-k order
    pairs = _RoutedPairs(hidden.shape[0], token, expert, x.detach(), gate_up, hidden_act.detach(), expert_output)
    return output.to(hidden.dtype), pairs


def _reference_output(module: Any, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
    """The experts' output token by token, the reference both forwards are checked against."""
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


def _forward_matches_rule(module: Any) -> bool:
    """Whether the module's own forward and the rule's (`_routed_forward`) both compute the reference math."""
    weight = module.gate_up_proj
    top_k = min(2, module.num_experts)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(_PROBE_TOKENS, weight.shape[2], generator=generator).to(weight)
        index = torch.rand(_PROBE_TOKENS, module.num_experts, generator=generator).argsort(1)[:, :top_k]
        weights = torch.rand(_PROBE_TOKENS, top_k, generator=generator).to(weight)
        try:
            own = module(hidden, index.to(weight.device), weights)
        except Exception:  # a forward that needs more, or whose kernel refuses this dtype: not what the rule computes
            return False
        rule, _ = _routed_forward(module, hidden, index.to(weight.device), weights)
        expected = _reference_output(module, hidden, index, weights)
        scale = expected.abs().max().clamp(min=1.0)
        return all(
            isinstance(actual, torch.Tensor)
            and actual.shape == expected.shape
            and bool(((actual - expected).abs().max() <= _PROBE_TOLERANCE * scale).item())
            for actual in (own, rule)
        )


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
