"""The model card of a privately trained model: a `privacy:` metadata block plus a readable Privacy section.

The card carries held-out evaluation only: training loss, gradient norms and metrics of an evaluation set that
overlaps the training data are computed on private data without noise, so they never appear here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .audit import AUDIT_MECHANISM_PREFIX

TEMPLATE = "private_model.md"

# A Hub model id: "name" or "owner/name" (letters, digits, '-', '_', '.'). The card's base_model metadata is
# meant to hold a Hub id, and a local path must not be rendered as a huggingface.co link.
_HUB_MODEL_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def is_hub_model_id(name: str) -> bool:
    """True for what names a Hub model, False for a local directory (even one shaped like an id)."""
    return bool(_HUB_MODEL_ID.match(name)) and not os.path.exists(name) and ".." not in name


NOT_COVERED = (
    "Training-loss values in logs and `trainer_state.json`: they are computed on private data without noise. "
    "Do not publish them.",
    "Hyperparameter tuning or model selection on private data: every extra run or choice spends privacy that "
    "this ε does not count.",
    "Evaluation on private data, and anything else done with the data outside this training run.",
    "Users who contribute several examples: the unit is one example, so a user with k examples is protected "
    "only at about k·ε (group privacy).",
    "Data-dependent preprocessing (e.g. a vocabulary or normalisation statistics computed from the private data).",
)

def privacy_metadata(report: dict[str, Any], method: str, audit: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `privacy:` YAML block, from a `PrivateTrainer.privacy_report()`."""
    block: dict[str, Any] = {
        "guarantee": report["guarantee"],
        "epsilon": float(report["epsilon"]),
        "delta": float(report["delta"]),
        "accountant": report["accountant"],
        "unit": "example",
        "method": method,
        "dataset_size": int(report["dataset_size"]),
        "mechanisms": [dict(m) for m in report["mechanisms"]],
    }
    for optional in ("guarantee_note", "training_epsilon", "trainable_fraction", "phases"):
        if report.get(optional) is not None:
            block[optional] = report[optional]
    if audit is not None:
        composed = any(m["name"].startswith(AUDIT_MECHANISM_PREFIX) for m in block["mechanisms"])
        if audit.get("audit_data", "private") == "private" and not composed:
            raise ValueError(
                "This audit ran on the training data, but its run is not among the report's mechanisms: attach it "
                "with PrivateTrainer.attach_audit(result), which composes it into ε, or run it on data declared "
                "'public' or 'disjoint'."
            )
        block["audit"] = {**audit, "kind": "empirical lower bound (not the guarantee)"}  # the label always wins
    return block


def build_model_card(
    *,
    privacy: dict[str, Any],
    base_model: str | None,
    model_title: str,
    training: dict[str, Any],
    eval_results: dict[str, float],
    load_snippet: str,
    eval_notes: Sequence[str] = (),
    library_name: str | None = None,
    tags: list[str] | None = None,
    citations: tuple[str, ...] = (),
    adapter_note: str | None = None,
    needs_hf_private: bool = False,
) -> ModelCard:
    base_on_hub = bool(base_model) and is_hub_model_id(base_model)
    card_data = ModelCardData(
        base_model=base_model if base_on_hub else None,
        library_name=library_name,
        tags=sorted({"differential-privacy", "hf_private", privacy["method"], *(tags or [])}),
        privacy=privacy,
    )
    template = resources.files("hf_private.model_cards").joinpath(TEMPLATE).read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        model_title=model_title,
        method_name=privacy["method"],
        base_model=base_model,
        base_on_hub=base_on_hub,
        adapter_note=adapter_note,
        not_covered=NOT_COVERED,
        training=training,
        eval_results=eval_results,
        eval_notes=eval_notes,
        load_snippet=load_snippet,
        citations=citations,
        needs_hf_private=needs_hf_private,
    )


def load_snippet(adapter_format: str, model_class: str, base_model: str | None, repo: str,
                 num_labels: int | None = None) -> str:
    """The card's "How to load" code for each save format (see `hf_private.adapters`)."""
    if adapter_format == "full":
        return f'from transformers import {model_class}\n\nmodel = {model_class}.from_pretrained("{repo}")'
    base = base_model or "<the base model this was trained from>"
    base_line = f'base = {model_class}.from_pretrained("{base}"{f", num_labels={num_labels}" if num_labels else ""})'
    if adapter_format == "peft":
        return (f"from peft import PeftModel\nfrom transformers import {model_class}\n\n{base_line}\n"
                f'model = PeftModel.from_pretrained(base, "{repo}")')
    return (f"from hf_private import load_private_adapter\nfrom transformers import {model_class}\n\n{base_line}\n"
            f'model = load_private_adapter(base, "{repo}")  # also accepts a local directory')


def adapter_note(adapter_format: str, trained_tensors: int, trained_fraction: float) -> str:
    """One sentence on what the repository holds, so a reader knows what the base model must supply."""
    if adapter_format == "full":
        return ("Every weight was trained with differential privacy: the repository holds the full model, plus the "
                "method config `dp_config.json`.")
    if adapter_format == "peft":
        return ("The repository holds a PEFT adapter (`adapter_model.safetensors`, `adapter_config.json`): only the "
                "tensors trained with differential privacy, plus the method config `dp_config.json`. The base "
                "model's weights are public and unchanged.")
    return (f"The repository holds only what differentially private training changed: {trained_tensors} tensors "
            f"({100 * trained_fraction:.3g}% of the model's parameters) in `private_adapter.safetensors`, plus the "
            "method config `dp_config.json`. The base model's other weights are public and unchanged; "
            "`hf_private.load_private_adapter` puts the trained tensors back onto it and checks that the base "
            "matches.")


def write_model_card(card: ModelCard, output_dir: str | os.PathLike) -> str:
    path = os.path.join(output_dir, "README.md")
    card.save(path)
    return path
