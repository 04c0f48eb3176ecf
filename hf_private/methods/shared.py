"""What several methods use, in one place (as PEFT keeps what its tuners share in `tuners_utils.py`, never in a
sibling tuner): a method folder imports from here, from `base.py` and from the engine, optimizer and privacy packages,
never from another method's folder.

* `head_parameter_names`: the parameters outside the pre-trained backbone, a new task head (DP-BiTFiT, DP-FROST,
  DP-FP and RGP train it; DP-LoRA and sparse low-rank LoRA make PEFT train it).
* `train_only`: requires_grad is the selection of what trains; exactly the named parameters train.
* `apply_lora`: a plain model as a PEFT LoRA model whose new head trains too (DP-LoRA, sparse low-rank LoRA).
* `DP_SGD`, `table9_defaults`: plain DP-SGD's name, which is also the name of X+BiTFiT's first stage (DP full
  fine-tuning), and the DP-BiTFiT paper's Table 9 schedule (DP full fine-tuning and DP-BiTFiT recipe defaults).
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from ..logs import get_logger
from ..models.support import is_causal_lm
from .base import RecipeDefaults

logger = get_logger(__name__)

#: plain DP-SGD on every trainable tensor: the dp-sgd method's name and X+BiTFiT's first stage
DP_SGD = "dp-sgd"


# ---------------------------------------------------------------------- what trains
def head_parameter_names(model: nn.Module) -> set[str]:
    """Parameters outside the pre-trained backbone (`base_model_prefix`): a new classification head.

    A causal LM's output layer is not new (often tied to the input embeddings), so it is never a "head" here.
    """
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or not hasattr(model, prefix) or is_causal_lm(model):
        return set()
    return {name for name, _ in model.named_parameters() if not name.startswith(f"{prefix}.")}


def train_only(model: nn.Module, names: Collection[str]) -> None:
    """Make exactly the parameters named in `names` trainable (requires_grad) and freeze every other one."""
    for name, param in model.named_parameters():
        param.requires_grad_(name in names)


# ---------------------------------------------------------------------- LoRA wrapping
# PEFT task types by head, so a new classification head is trained (modules_to_save) along with the factors.
_TASK_TYPES = {
    "ForSequenceClassification": "SEQ_CLS",
    "ForTokenClassification": "TOKEN_CLS",
    "ForCausalLM": "CAUSAL_LM",
    "LMHeadModel": "CAUSAL_LM",
}


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
            logger.info(
                "%s: PEFT knows no task type for it; its modules outside the backbone (%s) train with LoRA.",
                name,
                ", ".join(head_modules),
            )
    # peft annotates lora_alpha as int, but only ever divides it by r: a float alpha (SparseLowRankConfig) is valid
    config = LoraConfig(
        task_type=task_type,
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]
        target_modules=targets,
        modules_to_save=head_modules,
    )
    return get_peft_model(model, config)


def _encoder_default_targets(model: nn.Module) -> list[str] | None:
    """None (PEFT's default for the model type), except for a head whose config names the encoder it wraps
    (`hf_private.models.heads`): PEFT knows no default for the head's own model type, so the encoder's."""
    encoder = getattr(getattr(model, "config", None), "encoder_type", None)
    if encoder is None:
        return None
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(encoder)
    return None if targets is None else list(targets)


# ---------------------------------------------------------------------- recipe defaults
# DP-BiTFiT Table 9 (methods_spec §3.5): RoBERTa, DP-Adam, Abadi clipping R = 0.1, max length 256, Li et al.'s
# setup; the same table gives the DP full fine-tuning learning rate. (batch, epochs) per task:
TABLE9_SCHEDULE = {"sst2": (1000, 3), "qnli": (2000, 6), "qqp": (6000, 18), "mnli": (6000, 18)}
TABLE9 = "DP-BiTFiT Table 9 (methods_spec §3.5)"


def table9_defaults(task: str, learning_rate: float, what: str) -> RecipeDefaults:
    """Table 9's schedule for `task` (its SST-2 row, marked not from the paper, for a task it does not list)."""
    batch, epochs = TABLE9_SCHEDULE.get(task, TABLE9_SCHEDULE["sst2"])
    return RecipeDefaults(
        batch, epochs, learning_rate, 0.1, 256, f"{TABLE9}, {what}", from_paper=task in TABLE9_SCHEDULE
    )
