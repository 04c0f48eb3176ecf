"""The model card of a privately trained model: a `privacy:` metadata block plus a readable Privacy section.

The card carries held-out evaluation only: training loss, gradient norms and metrics of an evaluation set that
overlaps the training data are computed on private data without noise, so they never appear here; nor do those of a
set that could not be checked against the training data (`hf_private.evaluation.held_out`'s unknown verdict).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from importlib import metadata, resources
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..models.peft import unwrap_peft
from ..privacy.band_mf import card_release
from ..privacy.events import AUDIT_MECHANISM_PREFIX
from ..privacy.rng import Z_MAX
from ..version import __version__
from .adapters import is_hub_model_id
from .artifacts import ADAPTER_WEIGHTS_NAME, CARD_NAME, DP_CONFIG_NAME, PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME

TEMPLATE = "private_model.md"

# What the card says when the trainer passed no `license=`: a value the Hub accepts that claims nothing.
UNKNOWN_LICENSE = "unknown"
# The load snippet's stand-ins for what the card must not or cannot name; loading fails until they are replaced.
BASE_PLACEHOLDER = "<REPLACE-WITH-THE-BASE-MODEL>"
REPO_PLACEHOLDER = "<REPLACE-WITH-THIS-MODEL-REPO-OR-DIRECTORY>"
FRAMEWORKS = ("hf_private", "transformers", "torch", "peft", "opacus")

# How the card names where training started: a Hub id is published, a local path never is.
HUB, LOCAL, CONFIG = "hub", "local", "config"


def base_kind(base_model: str | None) -> str:
    """HUB (a Hub id, published), LOCAL (a local path, withheld) or CONFIG (built from a configuration)."""
    if not base_model:
        return CONFIG
    return HUB if is_hub_model_id(base_model) else LOCAL


def default_title(base_model: str | None, method: str, model_class: str, guaranteed: bool = True) -> str:
    """A title when no model name or Hub id was given: the base model and the method, never a local folder."""
    kind = base_kind(base_model)
    privacy = "differential privacy" if guaranteed else "no privacy guarantee"
    if kind == HUB:
        return f"{base_model} fine-tuned with {method} ({privacy})"
    if kind == LOCAL:
        return f"{model_class} fine-tuned with {method} from a local base model ({privacy})"
    return f"{model_class} trained from random initialisation with {method} ({privacy})"


def base_model_name(model) -> str | None:
    """The pre-trained model's Hub id or local path, as loaded; None for a model built from config.

    A local path is returned too: `public_base_model` and the card decide what is published (a Hub id only).
    """
    name = getattr(getattr(unwrap_peft(model), "config", None), "_name_or_path", "") or ""
    return name.strip() or None


def public_base_model(base_model: str | None) -> str:
    """How the report and the ledger name the base model: its Hub id, never a local path."""
    if not base_model:
        return "none (random initialisation from a configuration)"
    return base_model if base_kind(base_model) == HUB else "a local model (path withheld)"


def framework_versions() -> dict[str, str]:
    """Installed versions of hf_private and the libraries whose code produced the weights and the guarantee."""
    versions = {}
    for name in FRAMEWORKS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "hf_private":
                versions[name] = __version__
            else:
                versions[name] = "not installed"
    return versions


def eval_results_metadata(
    eval_results: Mapping[str, float], *, task_type: str | None, dataset_name: str, dataset_type: str
) -> list[EvalResult]:
    """The held-out results as `model-index` entries (none without a task type the Hub knows)."""
    if not task_type:
        return []
    return [
        EvalResult(
            task_type=task_type,
            dataset_type=dataset_type,
            dataset_name=dataset_name,
            dataset_split="held-out",
            metric_type=key.split("_", 1)[-1] if key.startswith("eval_") else key,
            metric_name=key,
            metric_value=float(value),
        )
        for key, value in eval_results.items()
    ]


def not_covered(unit: str = "example") -> tuple[str, ...]:
    """What the guarantee does not cover, for a run whose privacy unit is `unit`."""
    items = USER_LEVEL_NOT_COVERED if unit == "user" else NOT_COVERED
    return tuple(item.replace("{unit}", unit) for item in items)


NOT_COVERED = (
    "Training-loss values in logs and `trainer_state.json`, and the median per-example gradient norm of the first "
    "batch that a warning about a clip norm far above the norms prints: they are computed on private data without "
    "noise. Do not publish them.",
    "Hyperparameter tuning or model selection on private data: every extra run or choice spends privacy that "
    "this ε does not count.",
    "Evaluation on private data, and anything else done with the data outside this training run.",
    "Users who contribute several {unit}s: the unit is one {unit}, so a user with k {unit}s is protected "
    "only at about k·ε (group privacy).",
    "Data-dependent preprocessing (e.g. a vocabulary or normalisation statistics computed from the private data).",
)
# At user level the group-privacy caveat is what the guarantee removes; what it rests on instead is the user column.
USER_LEVEL_NOT_COVERED = (
    *(item for item in NOT_COVERED if not item.startswith("Users who contribute")),
    "Users as the user column names them: one person's examples under two ids count as two users, and are "
    "protected only at about 2·ε.",
)


def sampler_tail_line(report: dict[str, Any]) -> str | None:
    """The card's line on the part of δ the noise sampler's finite tail takes (`rng.tail_mass`), when ε is given."""
    tail = report.get("sampler_tail_delta")
    if "epsilon" not in report or tail is None:
        return None
    return (
        f"δ = {report['delta']:.3g} includes {tail:.2g} for the noise sampler's finite tail (no draw beyond "
        f"{Z_MAX:.2f} std): ε is the accountant's at δ − {tail:.2g}. That analysis is for real numbers; the "
        "float32 rounding of the noise is not covered, as in other DP-SGD libraries."
    )


def privacy_metadata(report: dict[str, Any], method: str, audit: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `privacy:` YAML block, from a `PrivateTrainer.privacy_report()`."""
    block: dict[str, Any] = {
        "guarantee": report["guarantee"],
        "delta": float(report["delta"]),
        "accountant": report["accountant"],
        "unit": report.get("unit", "example"),
        "method": method,
        "dataset_size": int(report["dataset_size"]),
        "mechanisms": [card_release(m) for m in report["mechanisms"]],
    }
    if "epsilon" in report:  # absent without a guarantee: no number may read as one
        block["epsilon"] = float(report["epsilon"])
    for optional in (
        "trainer",
        "user_column",
        "user_sampling",
        "examples_per_user",
        "max_examples_per_user",
        "sampler_tail_delta",
        "guarantee_note",
        "training_epsilon",
        "forks",
        "epsilon_with_forks",
        "not_a_guarantee",
        "trainable_fraction",
        "phases",
        "method_details",
        "adaptive_clipping",
        "band_mf",
    ):
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
    model_title: str | None,
    training: dict[str, Any],
    eval_results: dict[str, float],
    load_snippet: str,
    eval_notes: Sequence[str] = (),
    library_name: str | None = None,
    tags: list[str] | None = None,
    citations: tuple[str, ...] = (),
    adapter_note: str | None = None,
    needs_hf_private: bool = False,
    license: str | None = None,
    model_class: str = "model",
    task_type: str | None = None,
    eval_dataset_name: str = "held-out evaluation data",
    eval_dataset_type: str = "held-out",
    best_checkpoint: dict[str, Any] | None = None,
    adapter_format: str | None = None,
    versions: dict[str, str] | None = None,
) -> ModelCard:
    """The card. A local `base_model` path is never written (see `is_hub_model_id`); `best_checkpoint` is
    {"step", "metric", "value" (None when withheld), "steps_taken"} when training reloaded an earlier checkpoint."""
    kind = base_kind(base_model)
    guaranteed = privacy["guarantee"] == "formal"
    title = model_title or default_title(base_model, privacy["method"], model_class, guaranteed)
    results = eval_results_metadata(
        eval_results, task_type=task_type, dataset_name=eval_dataset_name, dataset_type=eval_dataset_type
    )
    relation = {"full": "finetune", "peft": "adapter", "private_adapter": "adapter"}.get(adapter_format or "")
    extra: dict[str, Any] = {"base_model_relation": relation} if kind == HUB and relation else {}
    card_data = ModelCardData(
        base_model=base_model if kind == HUB else None,
        license=license or UNKNOWN_LICENSE,
        library_name=library_name,
        tags=sorted(
            {*(["differential-privacy"] if guaranteed else []), "hf_private", privacy["method"], *(tags or [])}
        ),
        model_name=title if results else None,
        eval_results=results or None,
        privacy=privacy,
        **extra,
    )
    return ModelCard.from_template(
        card_data,
        template_str=resources.files("hf_private.model_cards").joinpath(TEMPLATE).read_text(encoding="utf-8"),
        model_title=title,
        method_name=privacy["method"],
        base_model=base_model if kind == HUB else None,
        base_kind=kind,
        adapter_note=adapter_note,
        not_covered=not_covered(privacy["unit"]) if guaranteed else (),
        training=training,
        eval_results=eval_results,
        eval_notes=eval_notes,
        load_snippet=load_snippet,
        citations=citations,
        needs_hf_private=needs_hf_private,
        license=license,
        best_checkpoint=best_checkpoint,
        versions=versions if versions is not None else framework_versions(),
    )


def load_snippet(
    adapter_format: str,
    model_class: str,
    base_model: str | None,
    repo: str | None,
    num_labels: int | None = None,
    model_module: str = "transformers",
) -> str:
    """The card's "How to load" code for each save format (see `hf_private.release.adapters`); `model_module` is where
    `model_class` is imported from (hf_private for its own heads).

    Only a Hub id is written as the base; a local path or a model built from a configuration becomes a marked
    placeholder, as does the repository when no Hub id is known (the output folder's name is not one).
    """
    replace = []
    if not repo:
        repo = REPO_PLACEHOLDER
        replace.append(f"# REPLACE {REPO_PLACEHOLDER}: this model's Hub id, or the directory holding these files.")
    model_import = f"from {model_module} import {model_class}"
    if adapter_format == "full":
        return "\n".join([model_import, "", *replace, f'model = {model_class}.from_pretrained("{repo}")'])
    kind = base_kind(base_model)
    base = base_model if kind == HUB else BASE_PLACEHOLDER
    if kind == LOCAL:
        replace.insert(
            0,
            f"# REPLACE {BASE_PLACEHOLDER}: training started from a local model whose path is withheld "
            "from this card; load those same weights.",
        )
    elif kind == CONFIG:
        replace.insert(
            0,
            f"# REPLACE {BASE_PLACEHOLDER}: training started from a configuration with random weights "
            "(not published); the adapter needs those same base weights.",
        )
    base_line = f'base = {model_class}.from_pretrained("{base}"{f", num_labels={num_labels}" if num_labels else ""})'
    if adapter_format == "peft":
        return "\n".join(
            [
                "from peft import PeftModel",
                model_import,
                "",
                *replace,
                base_line,
                f'model = PeftModel.from_pretrained(base, "{repo}")',
            ]
        )
    return "\n".join(
        [
            "from hf_private import load_private_adapter",
            model_import,
            "",
            *replace,
            base_line,
            f'model = load_private_adapter(base, "{repo}")  # also accepts a local directory',
        ]
    )


def adapter_note(
    adapter_format: str,
    trained_tensors: int,
    trained_fraction: float,
    from_config: bool = False,
    guaranteed: bool = True,
) -> str:
    """One sentence on what the repository holds, so a reader knows what the base model must supply."""
    trained = "trained with differential privacy" if guaranteed else "trained (without a privacy guarantee)"
    if adapter_format == "full":
        return (
            f"Every weight was {trained}: the repository holds the full model, plus the method config "
            f"`{DP_CONFIG_NAME}`."
        )
    base = (
        "The base model's weights (random, from its configuration, and not published) are unchanged"
        if from_config
        else "The base model's weights are public and unchanged"
    )
    if adapter_format == "peft":
        return (
            f"The repository holds a PEFT adapter (`{PEFT_WEIGHTS_NAME}`, `{PEFT_CONFIG_NAME}`): only the "
            f"tensors {trained}, plus the method config `{DP_CONFIG_NAME}`. {base}."
        )
    base = base.replace("weights", "other weights", 1)
    training = "differentially private training" if guaranteed else "training"
    return (
        f"The repository holds only what {training} changed: {trained_tensors} tensors "
        f"({100 * trained_fraction:.3g}% of the model's parameters) in `{ADAPTER_WEIGHTS_NAME}`, plus the "
        f"method config `{DP_CONFIG_NAME}`. {base}; `hf_private.load_private_adapter` puts the trained tensors "
        "back onto it and checks that the base matches."
    )


def write_model_card(card: ModelCard, output_dir: str | os.PathLike) -> str:
    path = os.path.join(output_dir, CARD_NAME)
    card.save(path)
    return path
