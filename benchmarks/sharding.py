"""Sharded (FSDP2) private training against unsharded DDP at the same number of processes: time per example and what
each process holds, on the CPU (gloo), as a user without a GPU runs the sharded path (docs/guides/sharding.md).

    python -m benchmarks.sharding [--layouts one ddp fsdp2] [--steps 4] [--out benchmarks/results/sharding_cpu.json]

Every layout trains the same model on the same data with `PrivateTrainer` and `DPConfig(noise_multiplier=1.0,
max_grad_norm=1.0, noise_seed=...)` (a test seed: the Poisson batches are the same draws in every layout, so the
layouts train the same examples step for step) and AdamW: `one` is one process; `ddp` two processes under `torchrun`
(Accelerate's MULTI_CPU: DDP, every process holds the whole model and optimizer); `fsdp2` two processes with
`TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2}, use_cpu=True)`. One torch thread a process.

Model: `benchmarks.trl_speed`'s Llama (8 layers, width 512, MLP 1376, vocabulary 32000, untied embeddings: 58M
parameters), random weights; rows of exactly `--seq-len` random tokens, every token trained.

Measured on every process, through the trainer (a `TrainerCallback`): each optimizer step's wall and CPU time after
`--warmup` steps; the examples each step trained (the rows of the batches the trainer fetched: Poisson sizes vary,
so time is reported per example, Σ step time / Σ examples of all processes); what the process holds of the training
state once trained (`hf_private.trainer.sharded_memory.training_state_bytes`: parameters and optimizer state, a
shard's local storage under FSDP2); its resident memory when training begins (after the model is built, and sharded)
and its high-water mark over the measured steps (VmHWM after a reset, `benchmarks.memory`), which adds the
gradients, the clipped sums, activations and the collectives' buffers to the state.

Two launches a layout, fresh processes each: `time`, as a user runs it, and `memory`, with glibc told to map every
allocation of 64 KiB or more on its own and to unmap it when freed (`MALLOC_MMAP_THRESHOLD_=65536`,
`MALLOC_TRIM_THRESHOLD_=0`), so that resident memory follows what is alive: with glibc's defaults a process keeps
the heap pages it freed (the whole model built before sharding, a step's gradients), and its resident memory hides
what sharding frees. The page faults slow that launch, so its times are not reported. Results are written to `--out`
as each launch completes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from benchmarks.memory import peak_bytes, reset_peak
from benchmarks.trl_speed import build_model, release_memory, rss_bytes, sft_dataset, word_tokenizer

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
LAYOUTS = ("one", "ddp", "fsdp2")
PROCESSES = {"one": 1, "ddp": 2, "fsdp2": 2}
SIGMA, CLIP, NOISE_SEED = 1.0, 1.0, 17
MODEL = dict(vocab_size=32000, layers=8, hidden=512, heads=8, intermediate=1376, seed=0)


def spec_for(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        **MODEL,
        "layout": layout,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "accumulation": args.accumulation,
        "warmup": args.warmup,
        "steps": args.steps,
        "dataset_size": args.dataset_size,
    }


# ---------------------------------------------------------------------------------------------- one process
class _Measure(TrainerCallback):
    """Times the steps after warmup, resetting the high-water mark when they begin; `counted` is filled by the
    batch-counting wrapper."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.wall, self.cpu, self.counted = warmup, [], [], []
        self._started = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            release_memory()
            reset_peak(CPU)
        self._started = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > self.warmup:
            self.wall.append(time.perf_counter() - self._started[0])
            self.cpu.append(time.process_time() - self._started[1])


def train_one_process(spec: dict[str, Any], out: Path) -> None:
    """One process of a layout (under torchrun): train, then write this process's record to `out/rank<r>.json`."""
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from hf_private import DPConfig, PrivateTrainer
    from hf_private.optimizer import noisy_optimizer
    from hf_private.trainer.sharded_memory import training_state_bytes

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = build_model(spec)
    sharding = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if spec["layout"] == "fsdp2" else {}
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=spec["batch"] // (spec["accumulation"] * world),
            gradient_accumulation_steps=spec["accumulation"],
            max_steps=spec["warmup"] + spec["steps"],
            optim="adamw_torch",
            learning_rate=1e-4,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
            **sharding,
        )
        trainer = PrivateTrainer(
            model=model,
            args=args,
            train_dataset=sft_dataset(spec["dataset_size"], spec["seq_len"], spec["vocab_size"], spec["seed"]),
            data_collator=DataCollatorForLanguageModeling(word_tokenizer(spec["vocab_size"]), mlm=False),
            dp_config=DPConfig(noise_multiplier=SIGMA, max_grad_norm=CLIP, noise_seed=NOISE_SEED),
        )
        measure = _Measure(spec["warmup"])
        trainer.add_callback(measure)
        fetch = trainer.get_batch_samples

        def counted(*args, **kwargs):
            batches, items = fetch(*args, **kwargs)
            if trainer.state.global_step >= spec["warmup"]:
                measure.counted.append(sum(len(batch["input_ids"]) for batch in batches))
            return batches, items

        trainer.get_batch_samples = counted  # type: ignore[method-assign]
        rss_at_start = rss_bytes()
        trainer.train()
        peak = peak_bytes(CPU)
        state = training_state_bytes(trainer.model, noisy_optimizer(trainer.optimizer).optimizer)
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": world,
        "parameters": sum(p.numel() for p in model.parameters()),
        "examples": sum(measure.counted),
        "step_wall_s": measure.wall,
        "step_cpu_s": measure.cpu,
        "parameter_bytes": state.parameters,
        "optimizer_bytes": state.optimizer,
        "rss_at_train_start_bytes": rss_at_start,
        "peak_rss_bytes": peak,
        "epsilon": trainer.ledger.epsilon(),
    }
    (out / f"rank{record['rank']}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------- a layout
#: glibc's settings for the memory launch (module docstring)
FOLLOW_LIVE_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def run_layout(spec: dict[str, Any], timeout_s: float = 3600, memory: bool = False) -> dict[str, Any]:
    """Launch one layout's processes (torchrun, gloo) and merge their records into one row; `memory`: the launch
    whose resident memory follows what is alive (module docstring)."""
    processes = PROCESSES[spec["layout"]]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(FOLLOW_LIVE_MEMORY if memory else {})}
    env.pop("WORLD_SIZE", None)
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "benchmarks.sharding",
            "--worker",
            json.dumps(spec),
            "--worker-out",
            out,
        ]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"the {spec['layout']} run failed:\n{(done.stdout + done.stderr)[-4000:]}")
        ranks = [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]
    examples = sum(rank["examples"] for rank in ranks)
    return {
        "layout": spec["layout"],
        "processes": processes,
        "spec": spec,
        "parameters": ranks[0]["parameters"],
        "examples": examples,
        "s_per_example": sum(ranks[0]["step_wall_s"]) / examples if examples else None,
        "cpu_s_per_example": sum(sum(rank["step_cpu_s"]) for rank in ranks) / examples if examples else None,
        "ranks": ranks,
    }


def ratios(rows: dict[str, dict], over: str, against: str) -> dict[str, float]:
    """`over` / `against` layouts: time per example (the time launches) and, per process (the largest), state and
    peak memory (the memory launches)."""
    a, b = rows[over], rows[against]

    def largest(row: dict, key: str) -> int:
        return max(rank[key] for rank in row["memory"]["ranks"])

    def state(row: dict) -> int:
        return max(rank["parameter_bytes"] + rank["optimizer_bytes"] for rank in row["memory"]["ranks"])

    return {
        "time_per_example": a["time"]["s_per_example"] / b["time"]["s_per_example"],
        "cpu_time_per_example": a["time"]["cpu_s_per_example"] / b["time"]["cpu_s_per_example"],
        "parameter_and_optimizer_bytes_per_process": state(a) / state(b),
        "peak_rss_per_process": largest(a, "peak_rss_bytes") / largest(b, "peak_rss_bytes"),
        "rss_at_train_start_per_process": largest(a, "rss_at_train_start_bytes")
        / largest(b, "rss_at_train_start_bytes"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sharding", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="expected logical batch (all processes)")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dataset-size", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/sharding_cpu.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        train_one_process(json.loads(args.worker), Path(args.worker_out))
        return {}
    saved: dict[str, Any] = {"torch": torch.__version__, "threads_per_process": 1, "rows": {}}
    for layout in args.layouts:
        for launch in ("time", "memory"):
            row = run_layout(spec_for(layout, args), memory=launch == "memory")
            saved["rows"].setdefault(layout, {})[launch] = row
            Path(args.out).write_text(json.dumps(saved, indent=1) + "\n")  # after every launch
            print(launch, json.dumps({k: v for k, v in row.items() if k not in ("ranks", "spec")}), flush=True)
        if {"fsdp2", "ddp"} <= saved["rows"].keys():
            saved["fsdp2_over_ddp"] = ratios(saved["rows"], "fsdp2", "ddp")
            Path(args.out).write_text(json.dumps(saved, indent=1) + "\n")
    print(json.dumps(saved.get("fsdp2_over_ddp"), indent=1))
    return saved


if __name__ == "__main__":
    main()
