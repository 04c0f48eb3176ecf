"""DP-LoRA: wrap the model with PEFT LoRA (unless it already is a PeftModel), then plain DP-SGD on what trains."""

from __future__ import annotations

from torch import nn

from ...adapters import is_peft_model
from ...logs import get_logger
from ..base import DPMethod, RecipeDefaults, register_dp_method
from ..bitfit.model import head_parameter_names
from .config import DPLoRAConfig

logger = get_logger(__name__)

# Seed 003 §4.8: the LoRA + DP-SGD baseline (after Yu et al. 2022), SST-2 and QNLI: B 2000, 20 epochs, lr 1e-3,
# C = 10; plain LoRA did best at rank 16. The max length is not stated; 256 as in Table 9.
_SEED003_TASKS = ("sst2", "qnli")
_SEED003 = "seed 003 §4.8 LoRA+DP-SGD baseline (methods_spec §4.8)"
# PEFT task types by head, so a new classification head is trained (modules_to_save) along with the factors.
_TASK_TYPES = {"ForSequenceClassification": "SEQ_CLS", "ForTokenClassification": "TOKEN_CLS",
               "ForCausalLM": "CAUSAL_LM", "LMHeadModel": "CAUSAL_LM"}


def apply_lora(model: nn.Module, rank: int, alpha: float, target_modules: str | None) -> nn.Module:
    """`model` as a PEFT LoRA model whose new head trains too; targets are comma-separated module names, None for
    PEFT's default for the model type.

    The task type comes from the class name (PEFT then trains "classifier"/"score"). A model whose name says nothing
    (a custom `BertPreTrainedModel` subclass) would otherwise keep its new, randomly initialised head frozen: its
    modules outside the pre-trained backbone (`base_model_prefix`) are trained instead, and the log says which."""
    from peft import LoraConfig, get_peft_model

    name = type(model).__name__
    task_type = next((task for suffix, task in _TASK_TYPES.items() if name.endswith(suffix)), None)
    targets = target_modules.split(",") if target_modules else _encoder_default_targets(model)
    head_modules = None
    if task_type is None:
        head_modules = sorted({param.split(".", 1)[0] for param in head_parameter_names(model)}) or None
        if head_modules:
            logger.info("%s: PEFT knows no task type for it; its modules outside the backbone (%s) train with LoRA.",
                        name, ", ".join(head_modules))
    return get_peft_model(model, LoraConfig(task_type=task_type, r=rank, lora_alpha=alpha, target_modules=targets,
                                            modules_to_save=head_modules))


def _encoder_default_targets(model: nn.Module) -> list[str] | None:
    """None (PEFT's default for the model type), except for a head whose config names the encoder it wraps
    (`hf_private.heads`): PEFT knows no default for the head's own model type, so the encoder's."""
    encoder = getattr(getattr(model, "config", None), "encoder_type", None)
    if encoder is None:
        return None
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    return TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(encoder)


@register_dp_method(DPLoRAConfig)
class DPLoRAMethod(DPMethod):
    config: DPLoRAConfig

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if is_peft_model(model):
            logger.info("The model is already a PeftModel: training its adapters as they are (lora_* fields unused).")
            return model
        return apply_lora(model, self.config.lora_r, self.config.lora_alpha, self.config.lora_target_modules)

    def citations(self) -> tuple[str, ...]:
        return (*super().citations(),
                "Hu et al., *LoRA: Low-Rank Adaptation of Large Language Models*, ICLR 2022.",
                "Yu et al., *Differentially Private Fine-tuning of Language Models*, ICLR 2022.")

    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        return RecipeDefaults(2000, 20, 1e-3, 10.0, 256, _SEED003, from_paper=task in _SEED003_TASKS,
                              method_fields={"lora_r": 16, "lora_alpha": 16})
