"""RGP building blocks (Yu et al., *Large Scale Private Learning via Low-rank Reparametrization*, ICML 2021;
methods_spec §4.2, §4.6, §6.3): pure torch, no privacy logic. The caller clips and noises the carrier gradients.

A weight W ∈ ℝ^{out×in} is reparametrized as W = LR + W̃.stop_gradient() with gradient carriers L ∈ ℝ^{out×k}
(orthonormal columns) and R ∈ ℝ^{k×in} (orthonormal rows). The forward pass is unchanged, and backprop gives
∂L = (∂W)Rᵀ = Σ_t g_t ⊗ (R x_t) and ∂R = Lᵀ(∂W) = Σ_t (Lᵀ g_t) ⊗ x_t. `RGPLinear` holds L and R as two real
`nn.Linear` modules (`left`, `right`), so the per-example gradient engine computes their per-example gradients with
its ordinary Linear rule. W itself never receives an autograd gradient: after clipping and noise the caller rebuilds
one with `full_weight_gradient` and applies it to W.

* `gradient_carriers` / `set_carriers`: one power iteration on the current weight (the reference code's
  `weight_decomposition`). The weight is public or a DP output, so this is post-processing. The start vectors come
  from a plain `torch.Generator` that the caller seeds once (from OS entropy) and never reseeds. It must not be the
  secret DP noise stream, and not the global RNG either.
* `full_weight_gradient`: the paper's reconstruction (∂L)R + L(∂R) − LLᵀ(∂L)R, the orthogonal projection onto the
  matrices whose columns lie in col-span(L) or whose rows lie in row-span(R). The reference code's `+` sign is wrong;
  see the function's docstring.
* `wrap_rgp` / `unwrap_rgp`: replace `nn.Linear` / GPT-2 `Conv1D` layers in place and put them back.

Layouts: every function here works with W laid out [out, in] (`nn.Linear`). GPT-2's `Conv1D` stores its weight as
[in, out]. `RGPLinear.weight_out_in()` gives the [out, in] view and `RGPLinear.to_weight_layout` maps an [out, in]
tensor back to the module's own layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

__all__ = ["RGPLinear", "full_weight_gradient", "gradient_carriers", "set_carriers", "unwrap_rgp", "wrap_rgp"]

_WRAPPABLE = (nn.Linear, Conv1D)


def _wrappable(module: nn.Module) -> TypeGuard[nn.Linear | Conv1D]:
    """Exactly nn.Linear or Conv1D: a subclass may override forward and change the math."""
    return type(module) in _WRAPPABLE


def _check_rank(rank: int, out_features: int, in_features: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(out_features, in_features):
        raise ValueError(
            f"RGP rank k={rank!r} must be an integer with 1 <= k <= min(out_features, in_features) = "
            f"{min(out_features, in_features)} for a weight of {out_features}×{in_features} ([out, in]): L needs k "
            f"orthonormal columns in ℝ^{out_features} and R needs k orthonormal rows in ℝ^{in_features}."
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 at least (fp16/bf16 → fp32, fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


class RGPLinear(nn.Module):
    """An `nn.Linear` or GPT-2 `Conv1D` reparametrized for RGP: the same output, with gradients only for L and R.

    It keeps the wrapped layer's own `weight` and `bias` Parameters (the same objects, in their original layout) under
    the same names, so the wrapped model's state_dict still has `<name>.weight` / `<name>.bias`. It adds
    `<name>.left.weight` (L, [out, k]) and `<name>.right.weight` (R, [k, in]) for the carriers. `left` and `right`
    are plain `nn.Linear(k, out)` / `nn.Linear(in, k)` without bias. While the layer is wrapped, `weight` and `bias`
    are frozen (`requires_grad=False`); `unwrap` restores their earlier flags. The carriers start at zero, so
    `set_carriers` must run before the first training step.

    Forward: y = W x + b + L(Rx) − stop_gradient(L, R)(Rx). This is W̃x + LRx with W̃ = W − stop_gradient(LR),
    written without materialising W̃, an extra [out, in] tensor per layer that autograd would keep until backward.
    The last two terms are the same matmuls on the same values, so they cancel exactly and y equals the wrapped
    layer's output. The input gradient is Wᵀg, and the only parameter gradients are ∂L = (∂W)Rᵀ and ∂R = Lᵀ(∂W).
    W enters only through a detached view, so it never gets an autograd gradient even if someone unfreezes it. Under
    `torch.no_grad()` the carrier terms are skipped.
    """

    weight: Tensor  # the wrapped layer's own Parameter objects
    bias: Tensor | None
    left: nn.Linear
    right: nn.Linear
    _base: nn.Linear | Conv1D

    def __init__(self, base: nn.Module, rank: int) -> None:
        super().__init__()
        if not _wrappable(base):
            raise TypeError(
                f"RGPLinear wraps exactly nn.Linear or transformers' Conv1D, got {type(base).__name__} (a subclass "
                "may override forward and change the math)."
            )
        self.is_conv1d = type(base) is Conv1D
        weight = base.weight
        in_features, out_features = weight.shape if self.is_conv1d else weight.shape[::-1]
        _check_rank(rank, out_features, in_features)
        self.in_features, self.out_features, self.rank = int(in_features), int(out_features), rank
        self._base_requires_grad = (weight.requires_grad, base.bias.requires_grad if base.bias is not None else None)
        self.weight = weight
        self.register_parameter("bias", base.bias)
        # skip_init: no random init, which would draw from (and advance) the global torch RNG.
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.left = nn.utils.skip_init(nn.Linear, rank, out_features, bias=False, **factory)
        self.right = nn.utils.skip_init(nn.Linear, in_features, rank, bias=False, **factory)
        with torch.no_grad():
            self.left.weight.zero_()
            self.right.weight.zero_()
        object.__setattr__(self, "_base", base)  # not a submodule: its parameters are ours, no second state_dict key
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def extra_repr(self) -> str:
        kind = "Conv1D" if self.is_conv1d else "Linear"
        return (
            f"{kind}, in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"bias={self.bias is not None}"
        )

    # ------------------------------------------------------------------ layouts
    def weight_out_in(self) -> Tensor:
        """W laid out [out, in] (a view of the wrapped layer's own weight; transposed for Conv1D)."""
        return self.weight.t() if self.is_conv1d else self.weight

    def to_weight_layout(self, tensor_out_in: Tensor) -> Tensor:
        """An [out, in] tensor (e.g. `full_weight_gradient`'s result) in this layer's weight layout ([in, out] for
        Conv1D)."""
        if tuple(tensor_out_in.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"Expected a tensor of shape [out, in] = {[self.out_features, self.in_features]}, got "
                f"{list(tensor_out_in.shape)}."
            )
        return tensor_out_in.t() if self.is_conv1d else tensor_out_in

    def weight_gradient(self, grad_left: Tensor, grad_right: Tensor) -> Tensor:
        """`full_weight_gradient` with this layer's current carriers, in this layer's weight layout."""
        return self.to_weight_layout(
            full_weight_gradient(grad_left, grad_right, self.left.weight.detach(), self.right.weight.detach())
        )

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.detach()
        if self.is_conv1d:  # exactly Conv1D.forward, so the output is bitwise the wrapped layer's
            bias = self.bias if self.bias is not None else weight.new_zeros(self.out_features)
            out = torch.addmm(bias, x.reshape(-1, x.size(-1)), weight).view(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, weight, self.bias)
        if not torch.is_grad_enabled():
            return out
        carried = self.left(self.right(x))  # the engine hooks these two modules: per-example ∂L, ∂R
        stopped = F.linear(F.linear(x, self.right.weight.detach()), self.left.weight.detach())
        return out + (carried - stopped)

    # ------------------------------------------------------------------ unwrap
    def unwrap(self) -> nn.Module:
        """The wrapped layer, with this wrapper's current `weight`/`bias` Parameters and their earlier flags."""
        base = self._base
        base.weight = self.weight
        if self.bias is not None:
            base.bias = self.bias
        weight_flag, bias_flag = self._base_requires_grad
        base.weight.requires_grad_(weight_flag)
        if base.bias is not None and bias_flag is not None:
            base.bias.requires_grad_(bias_flag)
        base.train(self.training)
        return base


# ---------------------------------------------------------------------- carriers
@torch.no_grad()
def gradient_carriers(weight_out_in: Tensor, rank: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """One power iteration on W [out, in] (the reference code's `weight_decomposition`).

    R0 ~ N(0, 1)^{in×k} drawn from `generator`, L = orth(W R0), R = orth(Wᵀ L)ᵀ (orthonormalised by reduced QR, which
    gives orthonormal columns even when W is rank-deficient). Returns (L [out, k] with orthonormal columns,
    R [k, in] with orthonormal rows), in float32 or in W's dtype if wider, on W's device.

    `generator` must be a plain `torch.Generator`. The start vectors are not privacy-relevant, but they must not come
    from the secret DP noise stream (hf_private's `SecretRandom` is refused) or from the global RNG. The caller seeds
    one generator once, from OS entropy, and keeps drawing from it; reseeding it every step would repeat the start
    vectors. The draw happens on the generator's device and is then moved to W's device.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"gradient_carriers needs a torch.Generator of its own (seeded once), got {type(generator).__name__}: the "
            "power iteration's start vectors must come neither from the secret DP noise stream nor the global RNG."
        )
    if weight_out_in.dim() != 2:
        raise ValueError(f"Expected a 2-D weight [out, in], got shape {list(weight_out_in.shape)}.")
    out_features, in_features = weight_out_in.shape
    _check_rank(rank, out_features, in_features)
    dtype = _compute_dtype(weight_out_in.dtype)
    weight = weight_out_in.detach().to(dtype)
    start = torch.randn(in_features, rank, generator=generator, device=generator.device, dtype=dtype)
    left, _ = torch.linalg.qr(weight @ start.to(weight.device))  # [out, k]
    right, _ = torch.linalg.qr(weight.t() @ left)  # [in, k]
    return left, right.t().contiguous()


@torch.no_grad()
def set_carriers(module: RGPLinear, generator: torch.Generator) -> None:
    """Recompute L, R from the module's current weight (`gradient_carriers`) and write them into `module.left.weight`
    and `module.right.weight` in place. The Parameter objects, which the optimizer and masks hold, stay the same.
    Their `.grad` is left alone; a gradient taken with the old carriers means nothing for the new ones."""
    left, right = gradient_carriers(module.weight_out_in(), module.rank, generator)
    module.left.weight.copy_(left)
    module.right.weight.copy_(right)


# ---------------------------------------------------------------------- reconstruction
def full_weight_gradient(grad_left: Tensor | None, grad_right: Tensor | None, left: Tensor, right: Tensor) -> Tensor:
    """∂W ≈ (∂L)R + L(∂R) − LLᵀ(∂L)R, laid out [out, in] (the paper's reconstruction, Yu et al. 2021).

    Shapes: grad_left and left [out, k], grad_right and right [k, in]; L has orthonormal columns, R orthonormal rows.
    The result is in float32, or wider if an input is. `RGPLinear.to_weight_layout` gives a Conv1D's [in, out].
    The gradients are the carriers' `.grad`, typed optional as torch types it: a missing one is a ValueError.

    Why the minus sign: when the factor gradients come from a true ∂W (∂L = ∂W Rᵀ, ∂R = Lᵀ ∂W), the formula gives
    ∂W RᵀR + LLᵀ ∂W − LLᵀ ∂W RᵀR = ∂W − (I − LLᵀ) ∂W (I − RᵀR). That is the orthogonal projection of ∂W onto
    {col-span ⊆ span L} + {row-span ⊆ span R}, the matrices an update LR' + L'R can reach. The block LLᵀ ∂W RᵀR
    appears in both (∂L)R and L(∂R), and the minus term removes the second copy. The reference code
    (`dayu11/Differentially-Private-Deep-Learning`, `m1 + L(Lᵀ((∂L)R))`) adds it instead, which counts that block three
    times. The result is no projection: it is not idempotent, and it triples a gradient that lies in both spans, so
    its norm can exceed ‖∂W‖. That changes the update, not the privacy (it is post-processing). We follow the paper.
    Computed as [∂L, L] @ [R; ∂R − (Lᵀ∂L)R], a single [out, in] product.
    """
    if grad_left is None or grad_right is None or left is None or right is None:
        raise ValueError("full_weight_gradient needs the two carrier gradients and the two carriers (got None).")
    out_features, rank = left.shape
    if (
        tuple(grad_left.shape) != (out_features, rank)
        or right.shape[0] != rank
        or (tuple(grad_right.shape) != tuple(right.shape))
    ):
        raise ValueError(
            f"Shapes must be grad_left, left [out, k] and grad_right, right [k, in]; got grad_left "
            f"{list(grad_left.shape)}, grad_right {list(grad_right.shape)}, left {list(left.shape)}, right "
            f"{list(right.shape)}."
        )
    dtype = _compute_dtype(
        torch.promote_types(
            torch.promote_types(grad_left.dtype, grad_right.dtype), torch.promote_types(left.dtype, right.dtype)
        )
    )
    grad_left, grad_right, left, right = (t.detach().to(dtype) for t in (grad_left, grad_right, left, right))
    return torch.cat([grad_left, left], 1) @ torch.cat([right, grad_right - (left.t() @ grad_left) @ right], 0)


# ---------------------------------------------------------------------- model surgery
def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith(f".{target}")


def wrap_rgp(
    model: nn.Module, target_modules: Sequence[str], rank: int, *, generator: torch.Generator | None = None
) -> dict[str, RGPLinear]:
    """Replace the targeted `nn.Linear` / `Conv1D` layers of `model` in place by `RGPLinear`s; return {name: wrapper}.

    Matching works like PEFT's list form of `target_modules`: an entry matches a module whose full dotted name
    equals it or ends with "." + entry. So `"bert.encoder.layer.0.attention.self.query"` selects one layer and
    `"query"` selects every `...query`. Every entry must match something, and every matched module must be exactly
    an `nn.Linear` or `Conv1D`; otherwise the call raises and leaves the model untouched. The returned dict is keyed
    by full module name, in `named_modules` order. A layer registered under several names gets one wrapper at all of
    them, keyed by its first name. `rank` is checked for every layer before anything is replaced.

    The wrapped weights and biases become frozen, and the carriers start at zero. Pass `generator` to set the
    carriers at once (`set_carriers`); otherwise call `set_carriers` before training.
    """
    if isinstance(target_modules, str) or not isinstance(target_modules, Sequence):
        raise TypeError(
            "target_modules must be a list of module names or name suffixes, e.g. ['query', 'value'], "
            f"got {target_modules!r}."
        )
    targets = [str(t) for t in target_modules]
    if not targets or any(not t for t in targets):
        raise ValueError(f"target_modules must be a non-empty list of non-empty names, got {targets!r}.")
    paths: dict[int, list[str]] = {}  # module id → every name it is registered under
    modules: dict[int, nn.Module] = {}
    chosen: dict[int, str] = {}  # module id → its first matching name
    matched: set[str] = set()
    every = list(model.named_modules(remove_duplicate=False))
    carriers = [f"{name}." for name, m in every if isinstance(m, RGPLinear)]
    for name, module in every:
        paths.setdefault(id(module), []).append(name)
        modules[id(module)] = module
        hits = {t for t in targets if _matches(name, t)}
        if hits and not any(name.startswith(prefix) for prefix in carriers):
            matched |= hits
            chosen.setdefault(id(module), name)
    unmatched = [t for t in targets if t not in matched]
    if unmatched:
        raise ValueError(f"target_modules {unmatched} match no module of {type(model).__name__}.")
    for key, name in chosen.items():
        module = modules[key]
        if isinstance(module, RGPLinear):
            raise ValueError(f"{name} is already an RGPLinear (wrap_rgp was applied twice).")
        if not _wrappable(module):
            raise TypeError(f"{name} is a {type(module).__name__}; RGP wraps exactly nn.Linear or Conv1D layers.")
        shape = module.weight.shape
        _check_rank(rank, *(shape[::-1] if type(module) is Conv1D else shape))
    wrapped: dict[str, RGPLinear] = {}
    for key, name in chosen.items():  # named_modules order
        wrapper = RGPLinear(modules[key], rank)
        for path in paths[key]:
            _replace(model, path, wrapper)
        if generator is not None:
            set_carriers(wrapper, generator)
        wrapped[name] = wrapper
    return wrapped


def unwrap_rgp(model: nn.Module, wrapped: Mapping[str, RGPLinear] | None = None) -> None:
    """Put the original layers back in place of the RGPLinears in `wrapped` (default: every RGPLinear in `model`).

    The restored layers are the original module objects, holding the wrapper's current `weight`/`bias` Parameters,
    so updates made while the layer was wrapped are kept. Their `requires_grad` flags go back to what they were before
    wrapping. The carriers are dropped, and the state_dict is again the plain model's.
    """
    wrappers = (
        list(wrapped.values())
        if wrapped is not None
        else [m for _, m in model.named_modules() if isinstance(m, RGPLinear)]
    )
    targets = {id(w) for w in wrappers}
    places = [(name, m) for name, m in model.named_modules(remove_duplicate=False) if id(m) in targets]
    missing = [w for w in wrappers if not any(m is w for _, m in places)]
    if missing:
        raise ValueError(f"{len(missing)} of the given RGPLinear layers are not part of this model.")
    originals = {id(w): w.unwrap() for w in wrappers}
    for name, module in places:
        _replace(model, name, originals[id(module)])


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)
