"""Which classification head a checkpoint needs, from its sentence-transformers pooling config.

A sentence-transformers checkpoint names its pooling in `modules.json` (the `Pooling` module's folder) and that
folder's `config.json` (`pooling_mode_mean_tokens`, `pooling_mode_cls_token`, ...). One trained to pool by mean
needs a head on the mean (`hf_private.models.heads`): on its CLS state a new head learns little, and privately nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel
from transformers.utils import cached_file

from ..logs import get_logger
from . import heads
from .peft import unwrap_peft

logger = get_logger(__name__)

MODULES_FILE = "modules.json"
POOLING_MODULE = "sentence_transformers.models.Pooling"
MEAN = "mean_tokens"  # the pooling config's `pooling_mode_mean_tokens`
_MODE_PREFIX = "pooling_mode_"


def pooling_modes(path: str | os.PathLike, download: bool = False) -> frozenset[str]:
    """The pooling modes a sentence-transformers checkpoint enables ("mean_tokens", "cls_token", ...); empty for a
    checkpoint without a pooling config. Only a local folder is read unless `download` (then a Hub id's two small
    files are fetched, or read from the cache)."""
    modules = _read_json(path, MODULES_FILE, download)
    pooling = next((m for m in modules or [] if isinstance(m, dict) and m.get("type") == POOLING_MODULE), None)
    if pooling is None:
        return frozenset()
    folder = pooling.get("path") or ""
    config = _read_json(path, f"{folder}/config.json" if folder else "config.json", download) or {}
    return frozenset(
        key[len(_MODE_PREFIX) :] for key, value in config.items() if key.startswith(_MODE_PREFIX) and value is True
    )


def _read_json(path: str | os.PathLike, name: str, download: bool) -> Any:
    """`name` inside the checkpoint as JSON; None when absent (or not local, without `download`) or unreadable."""
    path = os.fspath(path)
    file: str | None
    if os.path.isdir(path):
        file = os.path.join(path, name)
    elif download:
        file = cached_file(
            path, name, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False
        )
    else:
        return None
    if not file or not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as error:  # a damaged file must not stop the load: the choice falls back
        logger.warning("Could not read %s (%s); the sentence-transformers pooling is taken as unknown.", file, error)
        return None


HEADS = ("auto", "cls", "mean")  # sentence_classifier's `head`: the checkpoint's pooling, its CLS token, the mean


def sentence_classifier(
    path: str | os.PathLike, num_labels: int = 2, head: str = "auto", **kwargs: Any
) -> PreTrainedModel:
    """The sequence classifier `path` needs: with `head="auto"` a mean-pooled head when its sentence-transformers
    config pools by mean, else `AutoModelForSequenceClassification`'s (it reads the CLS token); "mean" or "cls" choose
    one. `kwargs` go to `from_pretrained`; a Hub id's pooling config is fetched with the model."""
    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}.")
    if head == "cls" or (head == "auto" and MEAN not in pooling_modes(path, download=True)):
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, **kwargs)
    model_type = AutoConfig.from_pretrained(path).model_type
    name = heads.mean_pooled_head_for(model_type)
    if name is None:
        why = (
            "is a sentence-transformers checkpoint trained with mean pooling"
            if head == "auto"
            else "was asked for with a mean-pooled head"
        )
        raise ValueError(
            f"{path} {why}, of model type {model_type!r}: hf_private has mean-pooled heads for BERT and RoBERTa "
            "checkpoints only, and AutoModelForSequenceClassification would classify its CLS token, a poor feature "
            "of such an encoder. Write the head on AutoModel (a Linear on last_hidden_state averaged over "
            "attention_mask)."
        )
    return getattr(heads, name).from_pretrained(path, num_labels=num_labels, **kwargs)


def cls_head_advice(model: nn.Module) -> str | None:
    """What to load instead when `model` is a stock sequence classifier (it reads the CLS token) whose local
    checkpoint folder pools by mean; None otherwise. A Hub id is not looked up: no network."""
    base = unwrap_peft(model)
    if isinstance(base, heads.MEAN_POOLED_HEADS):
        return None
    if not type(base).__name__.endswith("ForSequenceClassification"):
        return None
    config = getattr(base, "config", None)
    path = getattr(config, "_name_or_path", "") or ""
    if config is None or not path or MEAN not in pooling_modes(path):
        return None
    name = heads.mean_pooled_head_for(getattr(config, "model_type", None))
    fix = (
        f"load hf_private.{name}.from_pretrained({path!r}, num_labels={config.num_labels}) instead"
        if name
        else "put a head on the mean of the token states (hf_private has one for BERT and RoBERTa checkpoints)"
    )
    return (
        f"{path} is a sentence-transformers checkpoint trained with mean pooling, but {type(base).__name__} "
        f"classifies its CLS token, a poor feature of such an encoder (private runs on it drift to the majority "
        f"class): {fix}."
    )


def warn_if_cls_head_on_mean_encoder(model: nn.Module) -> None:
    """Log `cls_head_advice` as a WARNING, if there is any."""
    advice = cls_head_advice(model)
    if advice:
        logger.warning(advice)
