"""What TRL's trainers share and the private path refuses alike, whichever the trainer (SFT, DPO): kernels and
offloading that bypass or repack what the engine hooks, a Mixture-of-Experts loss over the whole batch, and a PEFT
config that would fight a DP method choosing its own trainable tensors."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..methods import DPMethod, method_class
from .base import RefusedKeyword, RefusedSetting

PACKING_ISSUE = (
    "hf_private packs only the sequences of a sampled chunk, each a privacy unit of its own "
    "(SFTTrainer with padding_free=True)"
)


def moe_aux_loss(args: Any, model: nn.Module) -> bool:
    """Whether the TRL trainer would add a Mixture-of-Experts load-balancing loss (its rule, read before it runs)."""
    config: Any = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = getattr(args, "router_aux_loss_coef", None)
    if coef is None:
        coef = getattr(text_config, "router_aux_loss_coef", 0.0)
    return hasattr(text_config, "output_router_logits") and coef != 0.0


def changes_what_trains(value: Any, dp_config: Any) -> bool:
    """A PEFT config lets TRL choose what trains; a DP method that wraps the model or chooses its trainable set
    itself (DP-LoRA, BiTFiT, FROST, sparse low-rank, DP-FP) would fight it."""
    if value is None:
        return False
    method = method_class(dp_config.method)
    return method.wrap_model is not DPMethod.wrap_model or method.prepare_model is not DPMethod.prepare_model


KERNEL_AND_BATCH_SETTINGS = (
    RefusedSetting(
        "use_liger_kernel",
        lambda args, model: bool(getattr(args, "use_liger_kernel", False)),
        "Liger kernels replace the model's layers and loss with fused kernels that have no per-example gradient "
        "rule here, so nothing could be clipped per example. Set use_liger_kernel=False.",
    ),
    RefusedSetting(
        "activation_offloading",
        lambda args, model: bool(getattr(args, "activation_offloading", False)),
        "offloading repacks the tensors saved for backward, including those the per-example gradient hooks "
        "read, which has not been verified to keep each example's gradient exact. Set "
        "activation_offloading=False.",
    ),
    RefusedSetting(
        "router_aux_loss_coef",
        moe_aux_loss,
        "the Mixture-of-Experts load-balancing loss is computed over the router statistics of the whole batch, "
        "which couples examples, and it is not part of the per-unit loss. Set router_aux_loss_coef=0.0.",
    ),
)

PEFT_CONFIG = RefusedKeyword(
    "peft_config",
    changes_what_trains,
    "peft_config lets TRL choose what trains (a PEFT adapter), but this DP method wraps the model or chooses "
    "its trainable tensors itself. Use DPConfig with peft_config (DP-SGD on the adapter), or this method "
    "without peft_config.",
)
