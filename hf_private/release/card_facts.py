"""From a training run to its card: the facts `PrivateTrainer` knows when it saves, turned into `build_model_card`.

No local path (base model or output folder) and no evaluation of training data reach the card: the base model's
name is passed on for `hf_private.release.model_card` to publish only when it is a Hub id, and only evaluations of
held-out
sets measured on the released weights are published.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..evaluation.held_out import card_evaluation
from ..models.peft import unwrap_peft
from ..optimizer import noisy_optimizer
from ..privacy.adaptive_clip import clip_line
from ..privacy.band_mf import card_line
from .checkpoints import checkpoint_step
from .model_card import (
    adapter_note,
    base_model_name,
    build_model_card,
    load_snippet,
    privacy_metadata,
    sampler_tail_line,
    write_model_card,
)

# metric key prefix → (HELD_OUT, OVERLAPS or UNKNOWN, the metrics of its last evaluate() in this process)
Evaluations = dict[str, tuple[str, dict[str, float]]]


@dataclass(frozen=True)
class RunFacts:
    """What the card says about a run, as the trainer knows it when it saves (`trainer.publish` gathers them)."""

    report: dict[str, Any]  # PrivateTrainer.privacy_report()
    audit: dict[str, Any] | None  # the card's privacy.audit block
    model: nn.Module  # the trained model, a PeftModel or a plain transformers model
    adapter_format: str  # 'peft', 'private_adapter' or 'full' (see hf_private.release.adapters)
    trained_tensors: int  # tensors trained in any stage: what the saved adapter holds
    trained_fraction: float  # their share of the model's values
    citations: tuple[str, ...]
    hub_id: str | None
    planned_steps: int
    expected_batch_size: int
    learning_rate: float
    optimizer: str  # the real optimizer's class name
    evaluations: Evaluations
    reloaded_best: dict[str, Any] | None  # `reloaded_checkpoint` of the best checkpoint put back, if any
    global_step: int
    processes: int = 1  # how many processes trained it
    sharded: bool = False  # whether FSDP2 sharded its weights over them


def write_card(
    output_dir: str,
    facts: RunFacts,
    model_name=None,
    finetuned_from=None,
    tags=None,
    dataset=None,
    license=None,
    dataset_tags=None,
) -> str:
    """README.md of `output_dir`; the keywords are Trainer.create_model_card's (tags and dataset_tags as lists)."""
    report = facts.report
    fmt = facts.adapter_format
    base = unwrap_peft(facts.model)
    model_class = _model_class(base)
    base_model = finetuned_from or base_model_name(base)
    hub_id = facts.hub_id
    title = model_name or (hub_id.split("/")[-1] if hub_id else None)  # None: the base model and the method
    training = {
        "method": report["method"],
        "trainer": f"`{report.get('trainer', 'transformers.Trainer')}`, made private by `hf_private.privatize`",
        "privacy unit": f"one {report.get('unit', 'example')}",
        "dataset": dataset or "private training data (not published)",
        "steps taken": f"{report['steps']} (all counted in ε)" if "epsilon" in report else report["steps"],
        "planned steps": facts.planned_steps,
        "expected logical batch size (q·N)": facts.expected_batch_size,
        "learning rate": facts.learning_rate,
        "optimizer": facts.optimizer,
        "trainable parameters": f"{100 * report['trainable_fraction']:.3f}% of the model",
    }
    if facts.sharded:
        training["sharded"] = f"FSDP2 (`fully_shard`): weights and optimizer state over {facts.processes} processes"
    elif facts.processes > 1:
        training["processes"] = f"{facts.processes} (data parallel)"
    training.update(_method_lines(report.get("method_details", {})))
    if "adaptive_clipping" in report:
        training["clip norm C"] = clip_line(report["adaptive_clipping"])
    if "band_mf" in report:
        training["noise"] = card_line(report["band_mf"])
    tail = sampler_tail_line(report)
    if tail is not None:
        training["noise sampler's tail in δ"] = tail
    held_out, eval_notes = card_evaluation(facts.evaluations)
    best = _released_checkpoint(facts, report["steps"], held_out)
    if best is not None:
        training["weights released"] = f"step {best['step']} (the best checkpoint by `{best['metric']}`)"
        held_out, eval_notes = _drop_stale_evaluations(facts, best["step"], held_out, eval_notes)
    card = build_model_card(
        privacy=privacy_metadata(report, report["method"], audit=facts.audit),
        base_model=base_model,
        model_title=title,
        training=training,
        eval_results=held_out,
        eval_notes=eval_notes,
        load_snippet=load_snippet(
            fmt, model_class.__name__, base_model, hub_id, _num_labels(base, model_class), _model_module(model_class)
        ),
        library_name="peft" if fmt == "peft" else "transformers",
        tags=tags,
        citations=facts.citations,
        adapter_note=adapter_note(
            fmt,
            facts.trained_tensors,
            facts.trained_fraction,
            from_config=not base_model,
            guaranteed=report["guarantee"] == "formal",
        ),
        needs_hf_private=fmt == "private_adapter",
        license=license,
        model_class=model_class.__name__,
        task_type=_task_type(model_class),
        eval_dataset_name=f"{dataset} (held-out evaluation data)" if dataset else "held-out evaluation data",
        eval_dataset_type=dataset_tags[0] if dataset_tags else "held-out",
        best_checkpoint=best,
        adapter_format=fmt,
    )
    return write_model_card(card, output_dir)


def _method_lines(details: dict[str, Any]) -> dict[str, str]:
    """The method's own facts that read as one line (text, numbers, lists of names); nested ones stay in the YAML."""
    lines = {}
    for key, value in details.items():
        label = key.replace("_", " ")
        if isinstance(value, (str, int, float)):
            lines[label] = str(value)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            lines[label] = ", ".join(f"`{v}`" for v in value) if value else "none"
    return lines


def optimizer_name(optimizer) -> str:
    """The real optimizer's class, behind Accelerate's wrapper and the NoisyOptimizer proxy."""
    noisy = noisy_optimizer(optimizer)
    return type(optimizer if noisy is None else noisy.optimizer).__name__


def reloaded_checkpoint(state, metric: str | None, evaluations: Evaluations) -> dict[str, Any]:
    """What the card needs of a best checkpoint just reloaded: its step, metric, and the evaluations made before."""
    step = state.best_global_step
    if step is None:
        step = checkpoint_step(state.best_model_checkpoint)
    metric = metric or "loss"
    metric = metric if metric.startswith("eval_") else f"eval_{metric}"
    return {
        "step": step,
        "global_step": state.global_step,
        "metric": metric,
        "value": state.best_metric,
        "evaluations": list(evaluations.values()),
    }  # the entries themselves: evaluate() replaces them


def _released_checkpoint(facts: RunFacts, steps_taken: int, held_out: dict[str, float]) -> dict[str, Any] | None:
    """The best checkpoint `_load_best_model` put back, if the weights are still its (and it is not the last)."""
    best = facts.reloaded_best
    if best is None or best["global_step"] != facts.global_step or best["step"] >= best["global_step"]:
        return None
    metric = best["metric"]
    value = f"{best['value']:.4g}" if metric in held_out and best["value"] is not None else None
    return {"step": best["step"], "metric": metric, "value": value, "steps_taken": steps_taken}


def _drop_stale_evaluations(facts: RunFacts, step: int, held_out: dict[str, float], notes: list[str]):
    """Held-out results measured before the best checkpoint was reloaded describe other weights: not published."""
    assert facts.reloaded_best is not None  # called only once `_released_checkpoint` found the best one reloaded
    stale = facts.reloaded_best["evaluations"]
    kept = {
        prefix: entry for prefix, entry in facts.evaluations.items() if not any(entry is before for before in stale)
    }
    if len(kept) == len(facts.evaluations):
        return held_out, notes
    held_out, notes = card_evaluation(kept)
    return held_out, [
        *notes,
        f"Evaluations run during training measured the weights of a later step, not the "
        f"released weights of step {step}: they are not published here. Run "
        "`trainer.evaluate()` after training to measure the released weights.",
    ]


def _model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps it for a subclass named FSDP<class>, which nothing loads."""
    return next(klass for klass in type(model).__mro__ if not issubclass(klass, FSDPModule))


def _task_type(model_class: type) -> str | None:
    """The Hub task of the model's head (as transformers' own cards infer it), for the card's model-index."""
    from transformers.modelcard import TASK_MAPPING, _get_mapping_values
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES

    name = model_class.__name__
    tasks = {**TASK_MAPPING, "multiple-choice": MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES}
    return next((task for task, mapping in tasks.items() if name in _get_mapping_values(mapping)), None)


def _model_module(model_class: type) -> str:
    """Where the card's snippet imports the model's class from: transformers or hf_private (its own heads) for
    their classes, else the class's own module."""
    module = model_class.__module__
    root = module.split(".")[0]
    return root if root in ("transformers", "hf_private") else module


def _num_labels(model: nn.Module, model_class: type) -> int | None:
    """Needed to rebuild a new classification head's shape on the base model; None for other heads."""
    if model_class.__name__.endswith(("ForSequenceClassification", "ForTokenClassification")):
        return getattr(getattr(model, "config", None), "num_labels", None)
    return None
