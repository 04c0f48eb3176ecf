"""DP SFT and DP DPO through TRL's own trainers: time and peak memory per example, private against non-private.

    python -m benchmarks.trl_speed --trainer sft dpo --modes full lora --seq-len 512 --steps 4 --rounds 4 \\
        [--arms non-private private plain-loss] --out benchmarks/results/trl_speed_cpu_t512.json

Each (trainer, mode) row compares stock `trl.SFTTrainer` (or `trl.DPOTrainer`) with `privatize()` of the same class
and `DPConfig(noise_multiplier=1.0, max_grad_norm=1.0)` (a fixed σ: nothing to calibrate), on the same model, data,
`per_device_train_batch_size` and `gradient_accumulation_steps`; the private arm's Poisson batch then has the
non-private arm's fixed batch as its expectation (q = B·GA/N). Full fine-tuning, or PEFT LoRA through the trainer's own
`peft_config` (r = 8, alpha 16, q_proj and v_proj). Everything else is the trainers' defaults, in fp32 on the CPU
(the non-private arm keeps Trainer's global-norm clipping at 1.0; the private arm replaces it by the per-example clip).

What "the same trainer" computes differs in one place. Stock TRL 1.16 trainers compute the training loss through TRL's
fused LM head (`trl.trainer.utils.add_fused_lm_head`, `trl/kernels/chunked_logprob.py`): log-probabilities (and, for
SFT, entropy and top-1 for its metrics) in vocabulary tiles without materialising the logits, a Triton kernel on GPU
and tiled torch ops on CPU. The private arm never calls `SFTTrainer.compute_loss` (`hf_private.integrations.trl_sft`):
it runs the model's own forward (full logits) and a per-sequence loss. On CPU the tiled fallback is the slower and
larger of the two, so next to stock SFTTrainer the private arm can come out faster and leaner. `--arms ... plain-loss`
adds a reference that isolates the cost of privacy, alternated with the others and reported beside the main ratios
(`plain_time_ratio`, `plain_memory_ratio`): stock SFTTrainer with transformers.Trainer's `compute_loss` (the model's
own loss on its full logits; no fused head, no SFT metrics), or stock DPOTrainer with `plain_dpo_loss`: DPO's sigmoid
loss (DPOConfig's default) as the mean over the batch's pairs, from the policy's full logits and, without gradient,
the reference's (computed first, as the private path does), each completion's log-probability summed over its
tokens as the private path sums it; no fused head, no DPO metrics.

Model: a Llama built from `LlamaConfig`, randomly initialised (speed does not depend on the weights): 8 layers, width
512, 8 heads of 64 (no grouped-query attention), MLP width 1376 (Llama's 8/3·d rounded up to a multiple of 32, as
Llama's 11008 for d = 4096), vocabulary 32000 (the Llama / Llama-2 tokenizer's), untied input and output embeddings as
in Llama: 58M parameters, 33M of them in the two embedding matrices. At this width the vocabulary dominates the cost,
as it does in real small LMs; `--vocab-size` changes it (recorded in the JSON).

Data: every row is exactly T tokens. SFT: a pre-tokenized dataset `{"input_ids": [...]}` of random ids from a fixed
generator; TRL takes a dataset with `input_ids` as processed (labels = input_ids, every token trained). DPO: TRL's
DPOTrainer has no pre-tokenized path (it always tokenizes `prompt`/`chosen`/`rejected` text), so the rows are text of
random words of a word-level tokenizer with one word per id, built in memory: a prompt of T/2 tokens and a chosen and
a rejected completion of T/2 tokens each (T/2 − 1 words and the EOS DPOTrainer appends), so each of a pair's two
sequences is T long. The prepared lengths are checked before training. Full DPO gets an explicit `ref_model` (a copy
of the initial model); LoRA DPO none (the base with the adapter disabled is the reference).

Measurement, through the trainer itself: a `TrainerCallback` times every optimizer step (on_step_begin → on_step_end:
forward, backward, per-example clipping, noise and the optimizer step; the trainer prefetches a step's batches before
on_step_begin, so collation and the Poisson draw are outside) and a thin wrapper around the trainer's
`get_batch_samples` (set on the instance after the trainer is built; it only counts and returns what the original
fetched) reads the size of every batch the trainer trains on in the next step (SFT: rows; DPO: pairs, which TRL's
preference collator stacks as the chosen rows and then the rejected rows, [2B, T], and the private path as
[B, 2, T]: until this was read from the shape, the private arm's pairs were counted as half the rows, B/2, doubling
its time per pair in the DPO results written before it). Poisson batches vary, so a run reports time per example:
Σ step time / Σ examples over its measured steps, after `--warmup` steps (optimizer state allocation; the private
arm's first step also runs the example-independence probe). With `--fixed-batch`, every step of the private arm
trains exactly B·GA units too (`FixedBatches`): the benchmark's `get_batch_samples` wrapper replaces each Poisson
batch, once drawn, by the next B units of the training set collated by the private trainer's own collator (so "at 4
pairs" and "at 8 pairs" are measured, not read off a Poisson mix; the accountant still counts the Poisson steps, so
such a run's ε is not that of what trained: a timing device only). `--profile` runs one step more after the measured
ones under `torch.profiler` (C-level ops by self CPU time, kept in the JSON as `profile`; not timed). Each step's
CPU time (`time.process_time`, all the process's threads) is recorded beside its wall time (`cpu_s_per_example`,
`plain_cpu_time_ratio`): with one torch thread, on a machine shared with other work, it counts the work an arm did
rather than the time the scheduler gave it.
Peak memory: the process high-water mark (VmHWM, `benchmarks.memory`), reset at the first measured step, read at the
last. Every run is its own fresh process (spawn), so no arm's high-water mark or allocator pages reach another's; the
arms alternate (non-private, private, non-private, ...) for `--rounds` rounds so machine load hits both alike, and
the table reports the median over rounds and the private/non-private ratio of medians. One torch thread per run by
default (`--threads`): on a shared 2-core machine two threads make every small op wait for both, which slows the
private arm's many small ops (noise, per-example norms) far more than the GEMMs.

Each row is written to `--out` as soon as it completes, merged with the rows already in the file (same trainer and
mode: replaced); `--resume` skips the rows already there instead.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import logging
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from transformers import TrainerCallback

from benchmarks.memory import peak_bytes, reset_peak

logger = logging.getLogger("benchmarks.trl_speed")

CPU = torch.device("cpu")
ARMS = ("non-private", "private")
PLAIN = "plain-loss"  # opt-in reference: the stock trainer with a loss on full logits (see the module docstring)
TRAINERS = ("sft", "dpo")
MODES = ("full", "lora")
SPECIAL = ("<pad>", "<unk>", "<bos>", "<eos>")  # ids 0-3; data ids are drawn from the rest
CLIP, SIGMA = 1.0, 1.0
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


# ---------------------------------------------------------------------------------------------- model and data
def llama_config(vocab_size: int, layers: int, hidden: int, heads: int, intermediate: int, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        use_cache=False,
    )


def build_model(spec: dict):
    """The same random weights for every arm and round (seeded init)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    return LlamaForCausalLM(
        llama_config(
            spec["vocab_size"], spec["layers"], spec["hidden"], spec["heads"], spec["intermediate"], spec["seq_len"]
        )
    ).train()


def word_tokenizer(vocab_size: int):
    """Word-level tokenizer with one word per id: the specials, then `w4` ... `w{vocab_size-1}`; TRL appends <eos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def random_ids(rows: int, length: int, vocab_size: int, generator: torch.Generator) -> list[list[int]]:
    return torch.randint(len(SPECIAL), vocab_size, (rows, length), generator=generator).tolist()


def sft_dataset(n: int, seq_len: int, vocab_size: int, seed: int):
    """Pre-tokenized rows of exactly `seq_len` random ids."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": random_ids(n, seq_len, vocab_size, torch.Generator().manual_seed(seed))})


def dpo_dataset(n: int, seq_len: int, vocab_size: int, seed: int):
    """Text pairs whose prompt is seq_len/2 tokens and whose chosen and rejected completions are seq_len/2 tokens each
    once DPOTrainer has appended its EOS (so prompt + completion is exactly `seq_len`)."""
    from datasets import Dataset

    if seq_len % 2:
        raise ValueError(f"DPO rows split T into a prompt and a completion of T/2 each: T must be even, got {seq_len}.")
    half, generator = seq_len // 2, torch.Generator().manual_seed(seed)

    def text(rows: list[list[int]], lead: str = "") -> list[str]:
        return [lead + " ".join(f"w{i}" for i in row) for row in rows]

    return Dataset.from_dict(
        {
            "prompt": text(random_ids(n, half, vocab_size, generator)),
            "chosen": text(random_ids(n, half - 1, vocab_size, generator), " "),
            "rejected": text(random_ids(n, half - 1, vocab_size, generator), " "),
        }
    )


def check_row_lengths(trainer_kind: str, dataset, seq_len: int) -> None:
    """Every prepared row is exactly `seq_len` tokens (both sequences of a pair for DPO)."""
    if trainer_kind == "sft":
        lengths = {len(ids) for ids in dataset["input_ids"]}
    else:
        prompts = [len(ids) for ids in dataset["prompt_ids"]]
        lengths = {p + len(c) for p, c in zip(prompts, dataset["chosen_ids"])}
        lengths |= {p + len(r) for p, r in zip(prompts, dataset["rejected_ids"])}
    if lengths != {seq_len}:
        raise RuntimeError(f"{trainer_kind}: prepared rows have lengths {sorted(lengths)}, expected {seq_len} only.")


# ---------------------------------------------------------------------------------------------- trainers
def planned_steps(spec: dict) -> int:
    """max_steps of a run: warm-up, measured and spare steps (the private arm may need longer to warm up; training
    stops after the measured steps)."""
    return spec["warmup"] + spec["steps"] + spec["spare"] + bool(spec.get("profile"))


def training_args(spec: dict, output_dir: str):
    from trl import DPOConfig, SFTConfig

    common = dict(
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"],
        max_steps=planned_steps(spec),
        logging_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_length=spec["seq_len"],
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=spec["seed"],
    )
    if spec["trainer"] == "sft":
        return SFTConfig(output_dir, packing=False, **common)
    return DPOConfig(output_dir, **common)


def build_trainer(spec: dict, output_dir: str):
    """The arm's trainer: stock SFTTrainer / DPOTrainer, or privatize() of it with DPConfig at a fixed σ."""
    from peft import LoraConfig
    from trl import DPOTrainer, SFTTrainer

    from hf_private import DPConfig, privatize

    trainer_class = SFTTrainer if spec["trainer"] == "sft" else DPOTrainer
    model = build_model(spec)
    size = spec["batch_size"] * spec["grad_accum"] * planned_steps(spec)  # one epoch: q = 1 / planned steps
    make_data = sft_dataset if spec["trainer"] == "sft" else dpo_dataset
    kwargs: dict[str, Any] = dict(
        model=model,
        args=training_args(spec, output_dir),
        train_dataset=make_data(size, spec["seq_len"], spec["vocab_size"], spec["seed"]),
        processing_class=word_tokenizer(spec["vocab_size"]),
    )
    if spec["mode"] == "lora":
        kwargs["peft_config"] = LoraConfig(**LORA)
    elif spec["trainer"] == "dpo":
        kwargs["ref_model"] = copy.deepcopy(model)  # a random model has no Hub id to rebuild the reference from
    if spec["arm"] == "non-private":
        return trainer_class(**kwargs)
    if spec["arm"] == PLAIN:
        return plain_loss_class(trainer_class)(**kwargs)
    dp_config = DPConfig(noise_multiplier=SIGMA, max_grad_norm=CLIP)
    if spec["trainer"] == "sft":
        return privatize(trainer_class)(**kwargs, dp_config=dp_config)
    try:
        return privatize(trainer_class)(**kwargs, dp_config=dp_config)
    except Exception as err:
        raise PrivateArmUnavailable(
            f"the private DPO arm cannot run in this checkout: privatize(trl.DPOTrainer)(...) raised "
            f"{type(err).__name__}: {err} (`--arms non-private` runs the non-private arm alone)"
        ) from err


def plain_loss_class(trainer_class: type) -> type:
    """`trainer_class` with a loss computed from the model's own forward on its full logits, in place of TRL's fused
    chunked LM head: SFT, transformers.Trainer's compute_loss (no entropy or token-accuracy metrics); DPO,
    `plain_dpo_loss`. Everything else is the class's own."""
    from transformers import Trainer
    from trl import SFTTrainer

    compute_loss = Trainer.compute_loss if issubclass(trainer_class, SFTTrainer) else plain_dpo_loss
    return type(f"PlainLoss{trainer_class.__name__}", (trainer_class,), {"compute_loss": compute_loss})


def completion_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Σ over each row's completion tokens of log p(token | tokens before it), [rows], from full logits, by the private
    path's own per-token function."""
    from hf_private.integrations.trl_dpo import completion_token_logps

    return completion_token_logps(logits, input_ids, completion_mask).sum(-1)


def plain_dpo_loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None):
    """DPOTrainer's sigmoid loss (its default), mean over the batch's pairs, from the policy's full logits with
    gradient and the reference's without (the `ref_model`, or the base with the adapter disabled): what stock DPO
    computes, without the fused head and without its metrics (the rows are TRL's: B chosen, then B rejected)."""
    from trl.trainer.utils import use_adapter

    rows = {key: inputs[key] for key in ("input_ids", "attention_mask")}
    completion_mask = inputs["completion_mask"]
    with torch.no_grad():  # first, as the private path does: its logits are freed before the policy's forward
        if trainer.ref_model is not None:
            ref_logits = trainer.ref_model(**rows, use_cache=False).logits
        else:
            with use_adapter(trainer.accelerator.unwrap_model(model), adapter_name=None):
                ref_logits = model(**rows, use_cache=False).logits
        ref_logps = completion_logps(ref_logits, rows["input_ids"], completion_mask)
        del ref_logits
    outputs = model(**rows, use_cache=False)
    logps = completion_logps(outputs.logits, rows["input_ids"], completion_mask)
    chosen, rejected = (logps - ref_logps).chunk(2)
    loss = -torch.nn.functional.logsigmoid(trainer.beta * (chosen - rejected)).mean()
    return (loss, outputs) if return_outputs else loss


class PrivateArmUnavailable(RuntimeError):
    """The private trainer class refused or failed to build (DP DPO before it exists)."""


def examples_in(trainer_kind: str, inputs: dict) -> int:
    """Training examples in a collated batch: SFT rows; DPO pairs (TRL's collator stacks the chosen rows, then the
    rejected rows, [2B, T]; the private path's `PairCollator` stacks each pair's two rows, [B, 2, T])."""
    input_ids = inputs["input_ids"]
    if trainer_kind == "sft" or input_ids.dim() == 3:
        return input_ids.shape[0]
    return input_ids.shape[0] // 2


# ---------------------------------------------------------------------------------------------- measurement
class StepMeter(TrainerCallback):
    """Times every optimizer step (on_step_begin → on_step_end) with the examples trained in it.

    Measurement starts at the first step after `warmup` steps at which `ready()` holds (the private arm: its one-time
    example-independence probe has run, which needs a chunk of ≥ 2 examples, so a small first Poisson batch defers it)
    and stops training after `steps` measured steps. The process high-water mark is reset when the first measured step
    begins and read when the last one ends. With `profile`, one more step runs after them under `torch.profiler`
    (not timed: the profiler slows it), and `profile_table` holds its C-level ops sorted by self CPU time.
    """

    def __init__(self, warmup: int, steps: int, ready=lambda: True, profile: bool = False) -> None:
        self.warmup, self.steps, self.ready = warmup, steps, ready
        self.profile = profile
        self.profiler: torch.profiler.profile | None = None
        self.profile_table: str | None = None
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []  # the process's CPU time (all its threads) over the same window
        self.examples: list[int] = []
        self.first_measured: int | None = None  # index into seconds/examples
        self.trained = 0  # examples of the step in progress
        self.fetched = 0  # examples of the batches fetched for the next step
        self.rss_at_reset: int | None = None
        self.peak: int | None = None
        self._start = self._cpu_start = 0.0

    def counting(self, get_batch_samples, trainer_kind: str, substitute=None):
        """Trainer's `get_batch_samples`, noting the examples of the batches it fetches for the next step (the loop
        hands them to training_step unchanged; a private trainer refuses a patched training_step); with
        `substitute(batches)`, the batches it returns in their place (`FixedBatches`)."""

        def get_batch_samples_counted(*args, **kwargs):
            batches, num_items = get_batch_samples(*args, **kwargs)
            if substitute is not None:
                batches = substitute(batches)
            self.fetched = sum(examples_in(trainer_kind, inputs) for inputs in batches)
            return batches, num_items

        return get_batch_samples_counted

    @property
    def measured(self) -> slice:
        return slice(len(self.seconds) if self.first_measured is None else self.first_measured, None)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_measured is None and len(self.seconds) >= self.warmup and self.ready():
            self.first_measured = len(self.seconds)
            release_memory()
            self.rss_at_reset = rss_bytes()
            reset_peak(CPU)
        self.trained = self.fetched  # fetched just before the step begins
        if self.peak is not None:  # the measured steps are done: this is the profiled step
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profile_table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            control.should_training_stop = True
            return control
        self.seconds.append(time.perf_counter() - self._start)
        self.cpu_seconds.append(time.process_time() - self._cpu_start)
        self.examples.append(self.trained)
        if len(self.seconds[self.measured]) == self.steps:
            self.peak = peak_bytes(CPU)
            control.should_training_stop = not self.profile
        return control


class FixedBatches:
    """`--fixed-batch`: each batch a private trainer fetched replaced by exactly `units` units of its training set
    (the next ones, cycling), collated by its own training collator, so that every step trains B·GA units as the
    non-private arms' steps do. A timing device only: the steps then train on batches that the accountant's Poisson
    sampling did not draw (the sampler still runs and is still accounted; its draws are discarded)."""

    def __init__(self, trainer, units: int) -> None:
        self.dataset, self.collate = trainer.training_data()
        self.units, self.next = units, 0

    def __call__(self, batches: list) -> list:
        return [self.batch() for _ in batches]

    def batch(self) -> dict:
        indices = [(self.next + i) % len(self.dataset) for i in range(self.units)]
        self.next += self.units
        return self.collate([self.dataset[i] for i in indices])


def release_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back, so the peak starts low


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


class _Notes(logging.Handler):
    """Distinct warnings (Python warnings and WARNING log records) seen while the arm runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[str, None] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.add(f"{record.name}: {record.getMessage()}")

    def add(self, message: str) -> None:
        self.seen.setdefault(" ".join(message.split())[:400], None)


@contextlib.contextmanager
def collected_warnings():
    from transformers.utils import logging as hf_logging

    notes = _Notes()
    hf_logging.enable_propagation()  # transformers' (and hf_private's) library logger does not reach the root
    root = logging.getLogger()
    root.addHandler(notes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield notes
        finally:
            root.removeHandler(notes)
            for w in caught:
                notes.add(f"{w.category.__name__}: {w.message}")


def run_arm(spec: dict) -> dict:
    """Build and train one arm in this process; its measured steps, examples and peak memory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()  # one bar per preparation pass per run would bury the log
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output_dir, collected_warnings() as notes:
        trainer = build_trainer(spec, output_dir)
        check_row_lengths(spec["trainer"], trainer.train_dataset, spec["seq_len"])
        private = spec["arm"] == "private"
        meter = StepMeter(
            spec["warmup"],
            spec["steps"],
            (lambda: not trainer.privacy_run.needs_independence_probe) if private else (lambda: True),
            profile=bool(spec.get("profile")),
        )
        fixed = FixedBatches(trainer, spec["batch_size"]) if private and spec.get("fixed_batch") else None
        trainer.get_batch_samples = meter.counting(trainer.get_batch_samples, spec["trainer"], fixed)
        trainer.add_callback(meter)
        built = time.perf_counter()
        trainer.train()
        trained = time.perf_counter()
        report = trainer.privacy_report() if private else None
    seconds, examples = meter.seconds[meter.measured], meter.examples[meter.measured]
    if len(seconds) != spec["steps"]:
        raise RuntimeError(
            f"{spec['arm']} arm measured {len(seconds)} steps of {spec['steps']} (it ran "
            f"{len(meter.seconds)} in all, {meter.first_measured} before measuring): raise --spare"
        )
    if spec["arm"] != "private" and set(meter.examples) != {spec["batch_size"] * spec["grad_accum"]}:
        raise RuntimeError(f"{spec['arm']} steps trained {meter.examples} examples, expected B·GA each")
    result = {
        "arm": spec["arm"],
        "s_per_example": sum(seconds) / max(1, sum(examples)),
        "cpu_s_per_example": sum(meter.cpu_seconds[meter.measured]) / max(1, sum(examples)),
        "step_cpu_seconds": meter.cpu_seconds,
        "peak_bytes": meter.peak,
        "rss_at_reset_bytes": meter.rss_at_reset,
        "warmup_steps_run": meter.first_measured,
        "step_seconds": meter.seconds,
        "step_examples": meter.examples,
        "build_seconds": built - started,
        "train_seconds": trained - built,
        "threads": torch.get_num_threads(),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "log_history": trainer.state.log_history,
        "warnings": list(notes.seen),
    }
    if meter.profile_table is not None:
        result["profile"] = meter.profile_table
        print(
            f"{spec['trainer']} {spec['mode']} {spec['arm']}: the step after the measured ones, profiled\n"
            f"{meter.profile_table}",
            flush=True,
        )
    if report is not None:
        result["privacy"] = {
            key: report.get(key)
            for key in (
                "epsilon",
                "delta",
                "steps",
                "planned_steps",
                "noise_multiplier",
                "sample_rate",
                "expected_batch_size",
                "max_grad_norm",
                "unit",
                "trainer",
                "trainable_fraction",
            )
        }
    return result


def run_in_fresh_process(spec: dict) -> dict:
    """`run_arm` in a new interpreter (spawn): its high-water mark and allocator pages are its own."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_arm, spec).result()


def check_private_arm(spec: dict) -> None:
    """Build the private arm on a tiny model (2 layers, width 32, T = 8) in this process: a trainer class that cannot
    be privatized fails here, in seconds, before any round runs."""
    tiny = {
        **spec,
        "arm": "private",
        "vocab_size": 64,
        "layers": 2,
        "hidden": 32,
        "heads": 2,
        "intermediate": 64,
        "seq_len": 8,
        "batch_size": 2,
        "grad_accum": 1,
        "warmup": 0,
        "steps": 1,
        "spare": 0,
    }
    with tempfile.TemporaryDirectory() as output_dir, collected_warnings():
        build_trainer(tiny, output_dir)


# ---------------------------------------------------------------------------------------------- rows
def bench_row(spec: dict, rounds: int, arms: list[str], run_arm_with=run_in_fresh_process) -> dict:
    """The arms in alternating rounds, each run in a fresh process; medians over rounds and their ratios.
    (`run_arm_with=run_arm` runs them in this process: the smoke test's shortcut, not a measurement.)"""
    if "private" in arms:
        check_private_arm(spec)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for round_index in range(rounds):
        for arm in arms:
            run = run_arm_with({**spec, "arm": arm})
            runs[arm].append(run)
            logger.info(
                "%s %s round %d %s: %.3f s/example (%d examples in %d steps), peak %.0f MiB",
                spec["trainer"],
                spec["mode"],
                round_index + 1,
                arm,
                run["s_per_example"],
                sum(run["step_examples"][run["warmup_steps_run"] :]),
                spec["steps"],
                run["peak_bytes"] / 2**20,
            )
    row = {
        key: spec[key]
        for key in (
            "trainer",
            "mode",
            "seq_len",
            "batch_size",
            "grad_accum",
            "warmup",
            "steps",
            "spare",
            "seed",
            "vocab_size",
            "layers",
            "hidden",
            "heads",
            "intermediate",
        )
    }
    row["fixed_batch"] = bool(spec.get("fixed_batch"))
    expected = spec["batch_size"] * spec["grad_accum"]
    row.update(
        threads=next(iter(runs.values()))[0]["threads"],
        rounds=rounds,
        expected_batch=expected,
        dataset_size=expected * planned_steps(spec),
        arms={},
    )
    for arm, arm_runs in runs.items():
        row["arms"][arm] = {
            "median_s_per_example": statistics.median(r["s_per_example"] for r in arm_runs),
            "median_peak_bytes": int(statistics.median(r["peak_bytes"] for r in arm_runs)),
            "median_cpu_s_per_example": statistics.median(r["cpu_s_per_example"] for r in arm_runs),
            "runs": arm_runs,
        }
    if set(ARMS) <= set(runs):
        private, public = row["arms"]["private"], row["arms"]["non-private"]
        row["time_ratio"] = private["median_s_per_example"] / public["median_s_per_example"]
        row["memory_ratio"] = private["median_peak_bytes"] / public["median_peak_bytes"]
        row["round_time_ratios"] = [
            p["s_per_example"] / n["s_per_example"] for p, n in zip(runs["private"], runs["non-private"])
        ]
        row["cpu_time_ratio"] = private["median_cpu_s_per_example"] / public["median_cpu_s_per_example"]
    if {"private", PLAIN} <= set(runs):
        private, plain = row["arms"]["private"], row["arms"][PLAIN]
        row["plain_time_ratio"] = private["median_s_per_example"] / plain["median_s_per_example"]
        row["plain_memory_ratio"] = private["median_peak_bytes"] / plain["median_peak_bytes"]
        row["plain_round_time_ratios"] = [
            p["s_per_example"] / n["s_per_example"] for p, n in zip(runs["private"], runs[PLAIN])
        ]
        row["plain_cpu_time_ratio"] = private["median_cpu_s_per_example"] / plain["median_cpu_s_per_example"]
        row["plain_round_cpu_time_ratios"] = [
            p["cpu_s_per_example"] / n["cpu_s_per_example"] for p, n in zip(runs["private"], runs[PLAIN])
        ]
    return row


def row_key(row: dict) -> tuple:
    return row["trainer"], row["mode"]


def load_results(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {"results": []}


def write_results(path: str, saved: dict) -> None:
    import peft
    import transformers
    import trl

    saved.update(
        environment={
            "device": "cpu",
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "peft": peft.__version__,
        }
    )
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(saved, f, indent=2)
    os.replace(tmp, path)  # a run stopped mid-write keeps the previous file


def table_cells(row: dict, reference: str = "non-private", prefix: str = "") -> list[str]:
    """trainer, mode, T, B x GA, s/example of the reference arm and the private arm and their ratio, peak MiB of each
    and their ratio."""
    arms = row["arms"]

    def value(arm: str, key: str, scale: float, fmt: str) -> str:
        return format(arms[arm][key] / scale, fmt) if arm in arms else "-"

    def ratio(key: str) -> str:
        return f"{row[prefix + key]:.2f}x" if prefix + key in row else "-"

    return [
        row["trainer"],
        row["mode"],
        str(row["seq_len"]),
        f"{row['batch_size']}x{row['grad_accum']}",
        value(reference, "median_s_per_example", 1, ".3f"),
        value("private", "median_s_per_example", 1, ".3f"),
        ratio("time_ratio"),
        value(reference, "median_peak_bytes", 2**20, ".0f"),
        value("private", "median_peak_bytes", 2**20, ".0f"),
        ratio("memory_ratio"),
    ]


def print_table(rows: list[dict]) -> None:
    tables = [("non-private", "", rows)]
    plain_rows = [row for row in rows if PLAIN in row["arms"]]
    if plain_rows:
        tables.append((PLAIN, "plain_", plain_rows))
    for reference, prefix, table_rows in tables:
        lines = [
            [
                "trainer",
                "mode",
                "T",
                "B x GA",
                f"{reference} s/ex",
                "private s/ex",
                "ratio",
                f"{reference} MiB",
                "private MiB",
                "ratio",
            ],
            *(table_cells(row, reference, prefix) for row in table_rows),
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        print()
        for i, line in enumerate(lines):
            print("  ".join(cell.rjust(w) if j > 1 else cell.ljust(w) for j, (cell, w) in enumerate(zip(line, widths))))
            if i == 0:
                print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None, run_arm_with=run_in_fresh_process) -> list[dict]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trl_speed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trainer", nargs="+", default=["sft"], choices=TRAINERS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--arms",
        nargs="+",
        default=list(ARMS),
        choices=[*ARMS, PLAIN],
        help=f"arms to run, alternated in this order (non-private and private for the ratios; "
        f"non-private alone checks that arm runs; {PLAIN}: the informational "
        f"reference of the module docstring)",
    )
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per row (per sequence of a DPO pair)")
    parser.add_argument("--batch-size", type=int, default=4, help="per_device_train_batch_size, both arms")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps, both arms")
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps per run before the measured ones")
    parser.add_argument(
        "--spare",
        type=int,
        default=2,
        help="extra planned steps, for a private warm-up that waits for its first batch of >= 2 "
        "(planned steps = warmup + steps + spare, dataset size = B x GA x planned steps)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (non-private, private) per row")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help=(
            "torch threads per run, 0 for torch's default (1: on the shared 2-core machine the noise of one full step, "
            "58M coordinates, took 0.4 s with 1 thread and 1.7-2.6 s with 2, 7-26 s with 2 beside one other busy "
            "process, as every small op waits for both threads)"
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="model init and data (the DP noise is never seeded)")
    parser.add_argument(
        "--fixed-batch",
        action="store_true",
        help="every step of the private arm trains exactly B x GA units, as the other arms do (`FixedBatches`: its "
        "Poisson batches are replaced after they are drawn; timing only)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run one more step after the measured ones under torch.profiler and print its ops by self CPU time",
    )
    parser.add_argument("--out", default="benchmarks/results/trl_speed_cpu_t512.json")
    parser.add_argument("--resume", action="store_true", help="skip the rows already in --out")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = {
        key: getattr(args, key)
        for key in (
            "seq_len",
            "batch_size",
            "grad_accum",
            "steps",
            "warmup",
            "spare",
            "rounds",
            "vocab_size",
            "layers",
            "hidden",
            "heads",
            "intermediate",
            "threads",
            "seed",
            "arms",
            "fixed_batch",
            "profile",
        )
    }
    saved = load_results(args.out)
    done = {row_key(row) for row in saved["results"]}
    rows, failures = [], []
    for trainer_kind in args.trainer:
        for mode in args.modes:
            if args.resume and (trainer_kind, mode) in done:
                logger.info("%s %s: already in %s, skipped (--resume)", trainer_kind, mode, args.out)
                rows.append(next(row for row in saved["results"] if row_key(row) == (trainer_kind, mode)))
                continue
            spec = {
                **{k: v for k, v in settings.items() if k not in ("rounds", "arms")},
                "trainer": trainer_kind,
                "mode": mode,
            }
            logger.info("benchmarking %s %s at T = %d", trainer_kind, mode, args.seq_len)
            try:
                row = bench_row(spec, args.rounds, args.arms, run_arm_with)
            except PrivateArmUnavailable as err:
                logger.error("%s %s: %s", trainer_kind, mode, err)
                failures.append(f"{trainer_kind} {mode}: {err}")
                continue
            saved["results"] = [r for r in saved["results"] if row_key(r) != row_key(row)] + [row]
            write_results(args.out, saved)  # after every row: a stopped run loses only the row under way
            rows.append(row)
    print_table(rows)
    if failures:
        raise SystemExit("Rows that could not run:\n" + "\n".join(failures))
    return rows


if __name__ == "__main__":
    # Through the importable module, so the spawned runs and this process share its functions and error classes.
    from benchmarks import trl_speed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    trl_speed.main()
