"""Which tensors DP-BiTFiT trains: every bias, the task head (by default) and optionally norm gains."""

from __future__ import annotations

from torch import nn

from ...logs import get_logger
from ..shared import head_parameter_names, train_only

logger = get_logger(__name__)

NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_TYPES) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def select_bitfit_parameters(model: nn.Module, *, train_head: bool, train_norm_weights: bool) -> None:
    """Freeze everything, then unfreeze biases (and the head / norm gains): requires_grad is the selection."""
    if hasattr(model, "peft_config"):
        raise ValueError(
            "BitFitConfig selects parameters of a plain transformers model; pass the base model, not "
            "a PeftModel (use DPConfig for DP-LoRA)."
        )
    selected = {name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] == "bias"}
    if not selected:
        if not train_norm_weights:
            raise ValueError(
                f"{type(model).__name__} has no bias parameters (Llama-style models have none), so DP-BiTFiT would "
                "train nothing. Use DPConfig on a PEFT LoRA model instead, or BitFitConfig(train_norm_weights=True) "
                "to train the norm gains."
            )
        logger.warning("%s has no bias parameters: only norm gains (and the head) will train.", type(model).__name__)
    if train_head:
        selected |= head_parameter_names(model)
    if train_norm_weights:
        selected |= {
            f"{module_name}.{param_name}" if module_name else param_name
            for module_name, module in model.named_modules()
            if _is_norm(module)
            for param_name, p in module.named_parameters(recurse=False)
            if param_name == "weight"
        }
    train_only(model, selected)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("DP-BiTFiT trains %d of %d parameters (%.3f%%).", trainable, total, 100 * trainable / total)
