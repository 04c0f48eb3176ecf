"""PEFT and training-scaffolding facts about a model, needed from the engine up to the release."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard, cast

from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def is_peft_model(model: nn.Module) -> TypeGuard[PeftModel]:
    """A PeftModel, recognised by duck typing so that peft is never imported for a plain model."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def unwrap_peft(model: nn.Module) -> PreTrainedModel:
    """The plain transformers model: a PeftModel's base model, or the model itself (hf_private trains transformers
    models only, so that is what its callers may rely on: `get_input_embeddings`, `config`)."""
    return cast("PreTrainedModel", model.get_base_model() if is_peft_model(model) else model)


#: set on a module whose parameters a method added for training only (RGP's gradient carriers): they are not part of
#: the released model, so a fresh base model does not have them
AUXILIARY_MARKER = "hf_private_auxiliary"


def auxiliary_parameter_names(model: nn.Module) -> set[str]:
    """Parameters of modules marked `AUXILIARY_MARKER`: training scaffolding, neither base nor adapter."""
    return {
        f"{name}.{param_name}" if name else param_name
        for name, module in model.named_modules()
        if getattr(module, AUXILIARY_MARKER, False)
        for param_name, _ in module.named_parameters()
    }
