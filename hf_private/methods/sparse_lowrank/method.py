"""Sparse + low-rank DP-SGD's behaviour (methods_spec §4.5, implementation-grade version).

Both variants are DP-SGD with one flat per-example clip over every low-rank factor of every adapted layer and the
task head (the printed algorithm's per-layer DP(·) would multiply the sensitivity by √(2·layers)); the masks only
zero rows/columns of the factors' per-example terms before that norm and their noisy gradients after it.

* LoRA: PEFT LoRA on frozen weights; masks from the pre-trained W0 (or the merged weight, `mask_source="current"`);
  the saved adapter is a standard PEFT LoRA adapter.
* RGP: the target weights W train. Each step, carriers L, R come from one power iteration on the current W (a DP
  output, so post-processing; the start vectors from a generator of their own, seeded once); the engine clips the
  per-example carrier gradients ∂L = ∂W Rᵀ, ∂R = Lᵀ ∂W; after the noise, ∂W ≈ (∂L)R + L(∂R) − LLᵀ(∂L)R
  (`rgp.full_weight_gradient`) is the gradient the inner optimizer applies to W.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...engine import PerExampleGradientEngine
from ...models.peft import AUXILIARY_MARKER, is_peft_model
from ...optimizer import NoisyOptimizer
from ...privacy.rng import test_stream_seed
from ..base import DPMethod, RecipeDefaults, register_dp_method
from ..shared import apply_lora, head_parameter_names, train_only
from . import rgp
from .config import SparseLowRankConfig
from .masks import MaskedFactor, unit_masks

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

# Seed 003 §4.8: B 2000, 20 epochs, lr 1e-3, C = 10 (δ = 1e-5 in the paper; the recipe keeps 1/(2N), smaller here).
_PAPER_TASKS = ("sst2", "qnli")
_PAPER = "seed 003 §4.8 and Table 1 (methods_spec §4.8)"
# Transformer blocks: RGP's default targets are the Linear/Conv1D layers inside them.
_BLOCK = re.compile(r"\.(layer|layers|h|block|blocks)\.\d+\.")


@register_dp_method(SparseLowRankConfig)
class SparseLowRankMethod(DPMethod):
    config: SparseLowRankConfig

    def __init__(self, config: SparseLowRankConfig) -> None:
        super().__init__(config)
        self.factors: list[MaskedFactor] = []
        self.lora_layers: list[tuple[LoraLayer, str]] = []  # (PEFT LoRA layer, adapter name)
        self.rgp_layers: dict[str, rgp.RGPLinear] = {}
        self.head: set[str] = set()
        self.other_trainable = 0  # noised coordinates outside the factors (the head)
        self._generator: torch.Generator  # the carriers' start vectors (RGP): seeded in prepare_model, before any step

    # ------------------------------------------------------------------ model
    def wrap_model(self, model: nn.Module) -> nn.Module:
        config = self.config
        if config.variant == "lora":
            if is_peft_model(model):
                raise ValueError("SparseLowRankConfig(variant='lora') adds its own LoRA layers: pass the base model.")
            alpha = config.lora_alpha if config.lora_alpha is not None else config.resolved_rank
            return apply_lora(model, config.resolved_rank, alpha, config.target_modules)
        if is_peft_model(model):
            raise ValueError("SparseLowRankConfig(variant='rgp') trains the model's own weights: pass the base model.")
        targets = _rgp_targets(model, config.target_modules)
        self.head = head_parameter_names(model)
        self.rgp_layers = rgp.wrap_rgp(model, targets, config.resolved_rank)
        for layer in self.rgp_layers.values():  # the carriers are not part of the released model
            setattr(layer.left, AUXILIARY_MARKER, True)
            setattr(layer.right, AUXILIARY_MARKER, True)
        return model

    def prepare_model(self, model: nn.Module) -> None:
        sparsity = self.config.resolved_sparsity
        if self.config.variant == "lora":
            from peft.tuners.lora import LoraLayer

            self.lora_layers = [(m, m.active_adapters[0]) for m in model.modules() if isinstance(m, LoraLayer)]
            for lora_layer, adapter in self.lora_layers:
                rows, cols = unit_masks(_lora_weight(lora_layer, adapter), sparsity)
                self.factors += [
                    MaskedFactor(_weight(lora_layer.lora_B[adapter]), 0, rows),
                    MaskedFactor(_weight(lora_layer.lora_A[adapter]), 1, cols),
                ]
            self._count_other_trainable(model)
            return
        train_only(model, self.head)
        self._generator = _carrier_generator(test_stream_seed(self.config.noise_seed, "rgp carriers"))
        for layer in self.rgp_layers.values():
            rgp.set_carriers(layer, self._generator)
            layer.left.weight.requires_grad_(True)
            layer.right.weight.requires_grad_(True)
            rows, cols = unit_masks(layer.weight_out_in(), sparsity)
            self.factors += [
                MaskedFactor(_weight(layer.left), 0, rows, keep_values=False),
                MaskedFactor(_weight(layer.right), 1, cols, keep_values=False),
            ]
        self._count_other_trainable(model)

    def _count_other_trainable(self, model: nn.Module) -> None:
        factors = {id(f.param) for f in self.factors}
        self.other_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in factors)

    # ------------------------------------------------------------------ engine and optimizer
    def attach_engine(self, engine: PerExampleGradientEngine) -> None:
        for factor in self.factors:
            engine.add_term_transform(factor.param, factor.mask_term)

    def attach_optimizer(self, optimizer: NoisyOptimizer) -> None:
        for factor in self.factors:
            optimizer.add_gradient_transform(factor.param, factor.mask_gradient)
        if self.config.variant == "lora":
            optimizer.add_step_end_hook(self._after_lora_step)
            return
        decay_group = max(optimizer.param_groups, key=lambda group: group.get("weight_decay", 0.0))
        decay_group["params"].extend(layer.weight for layer in self.rgp_layers.values())
        optimizer.add_pre_step_hook(self._carrier_gradients_to_weights)
        optimizer.add_step_end_hook(self._after_rgp_step)

    def _after_lora_step(self) -> None:
        for factor in self.factors:
            factor.restore()
        if self.config.resolved_mask_source == "current":
            for (layer, adapter), index in zip(self.lora_layers, range(0, len(self.factors), 2)):
                current = _lora_weight(layer, adapter) + layer.scaling[adapter] * (
                    _weight(layer.lora_B[adapter]) @ _weight(layer.lora_A[adapter])
                )
                self.factors[index].mask, self.factors[index + 1].mask = unit_masks(
                    current, self.config.resolved_sparsity
                )

    def _carrier_gradients_to_weights(self) -> None:
        """The released carrier gradients become W's (post-processing); the carriers themselves are not stepped."""
        for layer in self.rgp_layers.values():
            left, right = layer.left.weight, layer.right.weight
            layer.weight.grad = layer.to_weight_layout(
                rgp.full_weight_gradient(left.grad, right.grad, left.detach(), right.detach())
            ).to(layer.weight.dtype)
            left.grad = right.grad = None

    def _after_rgp_step(self) -> None:
        """New masks and carriers from the updated W, for the next step."""
        sparsity = self.config.resolved_sparsity
        for index, layer in enumerate(self.rgp_layers.values()):
            rgp.set_carriers(layer, self._generator)
            if self.config.resolved_mask_source == "current":
                rows, cols = unit_masks(layer.weight_out_in(), sparsity)
                self.factors[2 * index].mask, self.factors[2 * index + 1].mask = rows, cols

    # ------------------------------------------------------------------ what trains, report
    def trained_parameter_names(self, model: nn.Module) -> set[str]:
        if self.config.variant == "lora":
            return super().trained_parameter_names(model)
        weights = {f"{name}.weight" for name in self.rgp_layers}
        return weights | self.head

    def report(self) -> dict[str, Any]:
        config = self.config
        factor_values = sum(f.param.numel() for f in self.factors)
        masked = sum(f.masked_coordinates for f in self.factors)
        return {
            "variant": config.variant,
            "rank": config.resolved_rank,
            "sparsity": config.resolved_sparsity,
            "mask_source": config.resolved_mask_source,
            "adapted_layers": len(self.lora_layers) or len(self.rgp_layers),
            "noised_coordinates": factor_values - masked + self.other_trainable,
            "noised_coordinates_without_masks": factor_values + self.other_trainable,
        }

    def citations(self) -> tuple[str, ...]:
        return (
            *super().citations(),
            "Sparse + low-rank DP-SGD (seed 003; methods_spec §4).",
            "Yu, Zhang, Chen, Yin, Liu, *Large Scale Private Learning via Low-rank Reparametrization* (RGP), "
            "ICML 2021.",
            "Hu et al., *LoRA: Low-Rank Adaptation of Large Language Models*, ICLR 2022.",
        )

    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        return RecipeDefaults(2000, 20, 1e-3, 10.0, 256, _PAPER, from_paper=task in _PAPER_TASKS)


def _lora_weight(layer: LoraLayer, adapter: str) -> torch.Tensor:
    """The frozen base weight of a PEFT LoRA layer laid out [out, in] (GPT-2's Conv1D stores [in, out])."""
    if not isinstance(layer, nn.Module):  # peft's LoRA layers are modules; `fan_in_fan_out` is an undeclared attribute
        raise TypeError(f"{type(layer).__name__} is not a torch module: not one of peft's LoRA layers.")
    weight = layer.get_base_layer().weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"The base layer of {type(layer).__name__} has no weight tensor.")
    return weight.T if layer.fan_in_fan_out else weight


def _weight(module: nn.Module) -> nn.Parameter:
    """`module.weight` as the Parameter it is: torch types a submodule's attributes as Tensor or Module, and peft
    keeps its LoRA factors in plain Module containers, so the type checker cannot see it by itself."""
    weight = module.weight
    if not isinstance(weight, nn.Parameter):
        raise TypeError(f"{type(module).__name__}.weight is a {type(weight).__name__}, not a Parameter.")
    return weight


def _rgp_targets(model: nn.Module, target_modules: str | None) -> list[str]:
    """Full names of the layers to reparametrize: matching suffixes of `target_modules`, or every Linear/Conv1D
    inside a transformer block."""
    from transformers.pytorch_utils import Conv1D

    layers = [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))]
    if target_modules:
        suffixes = [s.strip() for s in target_modules.split(",") if s.strip()]
        chosen = [n for n in layers if any(n == s or n.endswith(f".{s}") for s in suffixes)]
    else:
        chosen = [n for n in layers if _BLOCK.search(f".{n}")]
    if not chosen:
        raise ValueError(f"No Linear/Conv1D layer of {type(model).__name__} matches target_modules={target_modules!r}.")
    return chosen


def _carrier_generator(test_seed: int | None) -> torch.Generator:
    """The power iteration's start vectors: not privacy-relevant, but not the secret noise stream either; seeded once
    from OS entropy (broadcast from rank 0, so every process computes the same carriers), never reseeded per step.
    In test mode (`noise_seed` set, the whole run reproducible) from the carriers' stream of that seed instead."""
    entropy = int.from_bytes(os.urandom(7), "little") if test_seed is None else test_seed
    seed = torch.tensor(entropy, dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(seed, src=0)
    return torch.Generator().manual_seed(int(seed))
