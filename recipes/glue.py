"""Differentially private fine-tuning on GLUE: `[accelerate launch] recipes/glue.py --task sst2 --method dp-bitfit ...`.

Every `TrainingArguments` flag works as usual. `--method` is any registered DP method (`hf_private.methods`); its
own config fields are flags too, and per (method, task) the paper's hyperparameters, which each method declares, are
the defaults; flags override them. Data come from the Hub (`load_dataset("glue", task)`) or, offline,
from `--train_file/--validation_file` or `--data_dir`. With no model and no data it runs the embedded offline demo
(a generated sentiment task and a small BERT built from config), which shows the pipeline, not GLUE numbers.

The paper defaults are sized for GPUs (dp-lora on SST-2: a logical batch of 2,000 for 20 epochs over its 67,349
sentences, up to 256 tokens each). `--quick` caps them for a CPU (see its `--help`): a check of the pipeline on your
model and data, not the paper's accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import typing
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    TrainingArguments,
    set_seed,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from demo_task import MAX_LENGTH, demo_model, demo_tokenizer, sentiment_splits  # noqa: E402
from glue_data import (  # noqa: E402
    TASKS,
    DataError,
    find_data_files,
    load_hub,
    load_local,
    prepare,
    task_spec,
)
from paper_defaults import method_name, split_batch  # noqa: E402
from process_group import exit_after_success  # noqa: E402

from hf_private import PrivateTrainer, median_gradient_norm, public_calibration_texts  # noqa: E402
from hf_private.evaluation.metrics import load_glue_metric  # noqa: E402
from hf_private.methods import MethodConfig, RecipeDefaults, method_class, registered_methods  # noqa: E402
from hf_private.models.head_choice import HEADS, sentence_classifier  # noqa: E402

logger = logging.getLogger("recipes.glue")

DEMO = RecipeDefaults(
    expected_batch_size=256,
    num_train_epochs=3,
    learning_rate=1e-2,
    clip_norm=1.0,
    max_seq_length=MAX_LENGTH,
    source="the offline demo's own settings (not a paper's)",
    method_fields={"lora_r": 8, "lora_alpha": 16},
)
# LoRA factors start at zero and need larger steps here (one demo run each: accuracy 0.87 vs 0.53 at 1e-2 on
# today's demo task).
DEMO_LORA_LEARNING_RATE = 5e-2
DEMO_ARGS = [
    "--output_dir",
    "outputs/demo",
    "--logging_steps",
    "20",
    "--per_device_train_batch_size",
    "256",
    "--per_device_eval_batch_size",
    "256",
    "--eval_strategy",
    "no",
    "--save_strategy",
    "no",
    "--use_cpu",
    "true",
]
GLUE_ARGS = ["--per_device_train_batch_size", "32", "--per_device_eval_batch_size", "64", "--logging_steps", "10"]
# --quick: caps on the method's paper defaults for a CPU-sized run (minutes on a few cores for a base-size encoder)
QUICK_BATCH, QUICK_EPOCHS, QUICK_SEQ_LENGTH, QUICK_TRAIN_SAMPLES = 256, 3, 64, 2000


@dataclass
class RecipeArguments:
    task: str = field(default="sst2", metadata={"help": f"GLUE task: {', '.join(TASKS)}."})
    method: str = field(
        default="dp-sgd",
        metadata={
            "help": f"DP method: one of {', '.join(registered_methods())}, or a short name (frost, bitfit, dpfp, ...)."
        },
    )
    epsilon: float = field(default=8.0, metadata={"help": "Target ε for the whole run."})
    delta: float | None = field(default=None, metadata={"help": "Target δ (default 1/(2N))."})
    accountant: str = field(default="prv", metadata={"help": "prv or rdp."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pre-trained model (Hub id or local path), e.g. roberta-base. None: demo."}
    )
    head: str = field(
        default="auto",
        metadata={
            "choices": HEADS,
            "help": "Classification head on --model_name_or_path: 'auto' reads the checkpoint's sentence-transformers "
            "pooling (the mean-pooled head for one that pools by mean, e.g. all-MiniLM-L6-v2; else the CLS "
            "head), 'cls' or 'mean' choose one (hf_private.sentence_classifier).",
        },
    )
    quick: bool = field(
        default=False,
        metadata={
            "help": f"A CPU-sized run: the paper defaults capped at a logical batch of {QUICK_BATCH}, {QUICK_EPOCHS} "
            f"epochs, {QUICK_SEQ_LENGTH} tokens and the first {QUICK_TRAIN_SAMPLES:,} training rows (flags still "
            "override): a check of the pipeline, not the paper's accuracy. The paper defaults themselves (e.g. "
            "dp-lora's batch of 2,000 for 20 epochs) need a GPU."
        },
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={"help": "Train on the first N training rows only (N then sets the sampling rate and δ)."},
    )
    train_file: str | None = field(default=None, metadata={"help": "Training data: tsv, csv, json(l) or parquet."})
    validation_file: str | None = field(default=None, metadata={"help": "Held-out data in the same layout."})
    data_dir: str | None = field(
        default=None, metadata={"help": "Directory with train.* and dev.*/validation.* (e.g. shared/data/sst2)."}
    )
    dataset_name: str = field(default="glue", metadata={"help": "Hub dataset used when no local data is given."})
    text_columns: str | None = field(default=None, metadata={"help": "Comma-separated text columns (task default)."})
    label_column: str = field(default="label", metadata={"help": "Label column of the data files."})
    expected_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Logical batch B = q·N (paper default, e.g. dp-lora's 2,000 for 20 epochs: "
            "sized for a GPU, see --quick); split into physical chunks."
        },
    )
    clip_norm: str | None = field(
        default=None,
        metadata={
            "help": "Per-example clip norm C: a number, or 'auto' (the default with a real model): the median "
            "per-example gradient norm at initialisation of what the method trains, on generated public sentences."
        },
    )
    max_seq_length: int | None = field(default=None, metadata={"help": "Truncation length (paper default)."})
    method_fields: dict[str, Any] = field(default_factory=dict, init=False)  # the method's own flags, parsed

    def __post_init__(self) -> None:
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise SystemExit(f"--max_train_samples must be positive, got {self.max_train_samples}.")
        if self.clip_norm not in (None, "auto"):
            try:
                valid = float(self.clip_norm) > 0
            except ValueError:
                valid = False
            if not valid:
                raise SystemExit(f"--clip_norm must be a positive number or 'auto', got {self.clip_norm!r}.")
        self.method = method_name(self.method)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, evaluate on held-out data, save (or push) the private adapter and card; returns the key numbers."""
    started = time.time()
    recipe, training_args, demo = parse_args(list(sys.argv[1:] if argv is None else argv))
    threads = torch.get_num_threads()
    if demo and "OMP_NUM_THREADS" not in os.environ:
        # The demo's matrices are tiny: extra threads only synchronise, and on a busy 2-core machine that made the
        # demo ~20x slower (measured). One thread keeps it at well under a minute of CPU.
        torch.set_num_threads(1)
    try:
        return _run(recipe, training_args, demo, started)
    finally:
        torch.set_num_threads(threads)


def _run(recipe: RecipeArguments, training_args: TrainingArguments, demo: bool, started: float) -> dict[str, Any]:
    if demo:
        logger.warning(
            "DEMO: no --model_name_or_path and no data given, so this trains a small randomly initialised "
            "BERT on a generated sentiment task. The numbers show the pipeline works; they say nothing "
            "about GLUE."
        )
        if recipe.method == "dp-bitfit":
            logger.warning(
                "DEMO: DP-BiTFiT adapts pre-trained features and the demo model has none (random "
                "weights), so expect chance accuracy here; give --model_name_or_path to see it work."
            )
        raw, tokenizer, model = sentiment_splits(), demo_tokenizer(), demo_model()
        text_columns, dataset_label = ("sentence",), "generated demo sentiment data (hf_private.demos.sentiment)"
    else:
        raw, text_columns, dataset_label = _load_data(recipe)
        if recipe.max_train_samples is not None and recipe.max_train_samples < len(raw["train"]):
            raw["train"] = raw["train"].select(range(recipe.max_train_samples))
            dataset_label += f", its first {recipe.max_train_samples:,} training rows"
        set_seed(training_args.seed)  # the new head alike on every process, so is the measured C
        tokenizer, model = _load_model(recipe)

    def tokenize(batch):
        texts = [batch[column] for column in text_columns]
        return tokenizer(*texts, truncation=True, max_length=recipe.max_seq_length)

    with training_args.main_process_first(desc="tokenize"):
        data = raw.map(tokenize, batched=True, remove_columns=list(text_columns))
    collator = DataCollatorWithPadding(tokenizer)
    clip_norm = _clip_norm(recipe, model, text_columns, tokenize, collator)
    dp_config = _dp_config(recipe, clip_norm)
    trainer = PrivateTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data.get("validation"),
        processing_class=tokenizer,
        data_collator=collator,
        dp_config=dp_config,
        compute_metrics=_metrics(recipe.task),
    )
    trainer.train()
    metrics = trainer.evaluate() if "validation" in data else {}
    card_kwargs = {"dataset": dataset_label, "finetuned_from": recipe.model_name_or_path}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card_kwargs)  # saves the adapter, ledger and card, then uploads them
    else:
        trainer.save_model()
        trainer.create_model_card(**card_kwargs)
    report = trainer.privacy_report()
    result = {
        "epsilon": report.get("epsilon"),
        "delta": report["delta"],
        "steps": report["steps"],
        "clip_norm": clip_norm,
        "metrics": {k[len("eval_") :]: v for k, v in metrics.items() if k.startswith("eval_")},
        "output_dir": os.path.abspath(training_args.output_dir),
        "seconds": time.time() - started,
    }
    result["accuracy"] = result["metrics"].get("accuracy")
    if trainer.is_world_process_zero():
        _log_result(result, report, recipe, demo, trainer.adapter_format)
    return result


def parse_args(argv: list[str]) -> tuple[RecipeArguments, TrainingArguments, bool]:
    """(recipe arguments, TrainingArguments, is_demo): paper defaults for the method and task, then the flags."""
    first = _pre_parse(argv)
    demo = _is_demo(first)
    method = method_class(first.method)
    defaults = DEMO if demo else method.recipe_defaults(first.task)
    if demo and first.method == "dp-lora":
        defaults = replace(defaults, learning_rate=DEMO_LORA_LEARNING_RATE)
    quick = first.quick and not demo  # the demo is CPU-sized already
    if quick:
        defaults = _quick(defaults)
    method_arguments = _method_arguments(method.config_class)
    parser = HfArgumentParser(
        (RecipeArguments, TrainingArguments, method_arguments), description=__doc__, formatter_class=_HelpFormatter
    )
    fixed = DEMO_ARGS if demo else ["--output_dir", f"outputs/{first.task}-{first.method}", *GLUE_ARGS]
    fixed += ["--max_train_samples", str(QUICK_TRAIN_SAMPLES)] if quick else []
    recipe, training_args, method_flags = parser.parse_args_into_dataclasses(
        args=[*fixed, *_default_args(defaults, method_arguments, demo), *argv]
    )
    recipe.method_fields = dataclasses.asdict(method_flags)
    for name in ("recipes", "transformers.hf_private"):  # the main process tells the story; the others only err
        logging.getLogger(name).setLevel(logging.INFO if training_args.should_log else logging.ERROR)
    accumulation_given = any(a.split("=")[0] == "--gradient_accumulation_steps" for a in argv)
    _set_batch(training_args, recipe.expected_batch_size, accumulation_given)
    _log_defaults(defaults, recipe, demo)
    return recipe, training_args, demo


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the module docstring as written, each flag's default shown."""


def _quick(paper: RecipeDefaults) -> RecipeDefaults:
    """The paper defaults capped to the CPU-sized profile; the learning rate, C and the method's own fields kept."""
    return replace(
        paper,
        expected_batch_size=min(paper.expected_batch_size, QUICK_BATCH),
        num_train_epochs=min(paper.num_train_epochs, QUICK_EPOCHS),
        max_seq_length=min(paper.max_seq_length, QUICK_SEQ_LENGTH),
        source=f"{paper.source}, capped by --quick to a CPU-sized run",
    )


def _is_demo(recipe: RecipeArguments) -> bool:
    return recipe.model_name_or_path is None and recipe.train_file is None and recipe.data_dir is None


def _pre_parse(argv: list[str]) -> RecipeArguments:
    """Read --task/--method/--model... first: they choose the defaults the full parse starts from."""
    if any(a in ("-h", "--help") for a in argv):
        return RecipeArguments()
    (first, _) = HfArgumentParser(RecipeArguments).parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if first.method not in registered_methods():
        raise SystemExit(f"--method must be one of {', '.join(registered_methods())}, got {first.method!r}.")
    if first.task not in TASKS:
        raise SystemExit(f"Unknown --task {first.task!r}; choose one of {', '.join(TASKS)}.")
    demo = _is_demo(first)
    if demo and first.task != "sst2":
        raise SystemExit(
            f"The offline demo is a sentiment task (sst2); for --task {first.task} give "
            "--model_name_or_path (e.g. roberta-base) and data or Hub access."
        )
    if not demo and first.model_name_or_path is None:
        raise SystemExit("With your own data, give --model_name_or_path (a pre-trained model, e.g. roberta-base).")
    return first


def _default_args(defaults: RecipeDefaults, method_arguments: type, demo: bool) -> list[str]:
    # The papers' C (0.1) is far below the per-example norms of most models: every example is then clipped alike and
    # a run can drift to the majority class with its loss rising (hf_private/clip_norm.py). The demo keeps its 1.0.
    clip_norm = str(defaults.clip_norm) if demo else "auto"
    args = [
        "--num_train_epochs",
        str(defaults.num_train_epochs),
        "--learning_rate",
        str(defaults.learning_rate),
        "--expected_batch_size",
        str(defaults.expected_batch_size),
        "--clip_norm",
        clip_norm,
        "--max_seq_length",
        str(defaults.max_seq_length),
    ]
    own = {f.name for f in dataclasses.fields(method_arguments)}
    for name, value in defaults.method_fields.items():
        if name in own:
            args += [f"--{name}", str(value)]
    return args


def _method_arguments(config_class: type[MethodConfig]) -> type:
    """The method's own config fields as recipe flags (their help text included)."""
    hints = typing.get_type_hints(config_class)
    fields = [(f.name, hints[f.name], field(default=f.default, metadata=f.metadata)) for f in config_class.own_fields()]
    return dataclasses.make_dataclass(f"{config_class.__name__}Arguments", fields)


def _set_batch(args: TrainingArguments, expected: int, accumulation_given: bool) -> None:
    """Split the logical batch over processes and accumulation steps, unless the user set accumulation."""
    if not accumulation_given:
        physical, steps = split_batch(expected, args.per_device_train_batch_size, args.world_size)
        if physical * steps * args.world_size != expected:
            logger.warning(
                "Expected batch %d does not split evenly over %d process(es); using %d.",
                expected,
                args.world_size,
                physical * steps * args.world_size,
            )
        args.per_device_train_batch_size, args.gradient_accumulation_steps = physical, steps
    logger.info(
        "Expected logical batch %d = %d per chunk × %d accumulation steps × %d processes.",
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        args.world_size,
    )


def _log_defaults(defaults: RecipeDefaults, recipe: RecipeArguments, demo: bool) -> None:
    if not demo and not defaults.from_paper:
        logger.warning(
            "The papers give no %s setting for %s: starting from their SST-2 row. Tune on public data, "
            "not the private data (tuning on it spends privacy this ε does not count).",
            recipe.method,
            recipe.task,
        )
    logger.info("Defaults (overridable by flags) from %s.", defaults.source)


def _load_data(recipe: RecipeArguments):
    spec = task_spec(recipe.task)
    text_columns = tuple(recipe.text_columns.split(",")) if recipe.text_columns else spec.text_columns
    train_file, validation_file = recipe.train_file, recipe.validation_file
    if recipe.data_dir:
        found_train, found_validation = find_data_files(recipe.data_dir)
        train_file, validation_file = train_file or found_train, validation_file or found_validation
    try:
        if train_file:
            raw = load_local(train_file, validation_file)
            sources = {"train": train_file, "validation": validation_file or ""}
            label = f"{recipe.task} data from local files (not published)"
        else:
            raw = load_hub(recipe.dataset_name, recipe.task)
            sources, label = {}, f"GLUE {recipe.task} ({recipe.dataset_name} on the Hugging Face Hub)"
        data = prepare(raw, recipe.task, text_columns, recipe.label_column, sources)
    except DataError as error:
        raise SystemExit(str(error)) from error
    if "validation" not in data:
        logger.warning("No validation data: the card will report no held-out evaluation.")
    return data, text_columns, label


def _load_model(recipe: RecipeArguments):
    """The tokenizer and the classifier with the head --head chooses (hf_private.sentence_classifier)."""
    num_labels = task_spec(recipe.task).num_labels
    tokenizer = AutoTokenizer.from_pretrained(recipe.model_name_or_path)
    model = sentence_classifier(recipe.model_name_or_path, num_labels=num_labels, head=recipe.head)
    logger.info("Classification head: %s (--head %s).", type(model).__name__, recipe.head)
    return tokenizer, model


def _dp_config(recipe: RecipeArguments, clip_norm: float) -> MethodConfig:
    """The registered method's config from the shared privacy flags and the method's own flags."""
    return method_class(recipe.method).config_class(
        target_epsilon=recipe.epsilon,
        target_delta=recipe.delta,
        max_grad_norm=clip_norm,
        accountant=recipe.accountant,
        **recipe.method_fields,
    )


CALIBRATION_EXAMPLES = 32


def _clip_norm(recipe: RecipeArguments, model, text_columns: tuple[str, ...], tokenize, collator) -> float:
    """--clip_norm as a number; 'auto': the median per-example gradient norm of what the method trains, measured at
    initialisation on generated sentences (public: the training data plays no part, so ε needs no share for it)."""
    if recipe.clip_norm != "auto":
        return float(recipe.clip_norm)
    num_labels = task_spec(recipe.task).num_labels
    columns = {column: public_calibration_texts(CALIBRATION_EXAMPLES, seed=i) for i, column in enumerate(text_columns)}
    labels = [float(i % 5) if num_labels == 1 else i % num_labels for i in range(CALIBRATION_EXAMPLES)]
    encoded = tokenize(columns)
    examples = [{**{k: v[i] for k, v in encoded.items()}, "labels": labels[i]} for i in range(CALIBRATION_EXAMPLES)]
    probe = method_class(recipe.method).config_class(noise_multiplier=1.0, **recipe.method_fields)
    clip_norm = median_gradient_norm(model, probe, examples, collator)
    logger.info(
        "C = %.4g: the median per-example gradient norm at initialisation over %d generated sentences "
        "(--clip_norm auto; give a number to set it).",
        clip_norm,
        CALIBRATION_EXAMPLES,
    )
    return clip_norm


def _metrics(task: str):
    """compute_metrics through the shipped `evaluate` GLUE module (accuracy plus the task's GLUE metric)."""
    metric = load_glue_metric(task)
    regression = task_spec(task).num_labels == 1

    def compute(prediction) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predictions = logits.squeeze(-1) if regression else logits.argmax(-1)
        return metric.compute(predictions=predictions, references=prediction.label_ids)

    return compute


SAVED_AS = {
    "peft": "PEFT adapter",
    "private_adapter": "Private adapter (only the trained tensors)",
    "full": "Full model",
}


def _log_result(
    result: dict[str, Any], report: dict[str, Any], recipe: RecipeArguments, demo: bool, adapter_format: str
) -> None:
    held_out = ", ".join(
        f"{k} = {v:.4f}"
        for k, v in result["metrics"].items()
        if k not in ("loss", "runtime", "samples_per_second", "steps_per_second", "epsilon")
    )
    privacy = (
        f"ε = {report['epsilon']:.3f}, δ = {report['delta']:.2e} ({report['accountant']} accountant"
        if "epsilon" in report
        else "NO formal guarantee ("
    )
    logger.info(
        "%s%s with %s: %s, %d steps, σ = %.3f, guarantee: %s); held-out %s; %.0f s. %s, privacy ledger and card in %s.",
        "DEMO (generated data, not GLUE) " if demo else "",
        recipe.task,
        recipe.method,
        privacy,
        report["steps"],
        report["noise_multiplier"],
        report["guarantee"],
        held_out or "evaluation not run",
        result["seconds"],
        SAVED_AS[adapter_format],
        result["output_dir"],
    )


if __name__ == "__main__":
    # force: opacus configures the root logger at import time, which would swallow hf_private's INFO lines.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    main()
    exit_after_success()
