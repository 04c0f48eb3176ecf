"""Utility of DP SFT and DP DPO against the non-private run on the recipe's generated instruction task.

    python -m benchmarks.sft_utility                    # SFT and DPO, ε ∈ {3, 8}, 3 private runs each
    python -m benchmarks.sft_utility --table            # only print docs/benchmarks.md's table from the records

Every run is `recipes/sft.py` with its offline defaults (10,000 generated pairs, a 2-layer Llama of width 64 built
from config, logical batch 256; SFT 5 epochs, DPO 3), in a fresh process, one JSON record appended to
`benchmarks/results/sft_utility_demo.jsonl` as soon as it finishes; a run whose record exists is skipped, so an
interrupted grid continues where it stopped. The private runs repeat (`--repeats`) because their noise and Poisson
batches are secret and differ every run; the non-private run is deterministic and runs once per trainer, in the
process of its first private run. The task is
a demo of the pipeline (`hf_private.demos.instruction`), not a benchmark of language modelling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "sft_utility_demo.jsonl"
METRICS = {"sft": ("exact_match",), "dpo": ("exact_match", "preference_accuracy")}


def run_key(trainer: str, epsilon: float, repeat: int) -> str:
    return f"{trainer}/eps={epsilon:g}/{repeat}"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_recipe(trainer: str, epsilon: float, with_non_private: bool, output_dir: str) -> list[dict]:
    """One recipe run in a fresh process: the private record, and the non-private one if asked for."""
    argv = [
        "--trainer",
        trainer,
        "--output_dir",
        output_dir,
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "1000",
        "--non_private",
        str(with_non_private).lower(),
        "--target_epsilon",
        str(epsilon),
    ]
    code = (
        "import json, sys; sys.path.insert(0, 'recipes'); import sft; "
        f"print('RESULT ' + json.dumps(sft.main({argv!r}), default=str))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    result = json.loads(run.stdout.split("RESULT ", 1)[1].splitlines()[0])
    private = {
        "trainer": trainer,
        "epsilon": epsilon,
        "delta": result["delta"],
        "steps": result["steps"],
        "noise_multiplier": result["noise_multiplier"],
        "baseline_exact_match": result["baseline_exact_match"],
        "seconds": result["private_seconds"],
        **{m: result[f"private_{m}"] for m in METRICS[trainer]},
    }
    if not with_non_private:
        return [private]
    public = {
        "trainer": trainer,
        "epsilon": None,
        "delta": None,
        "steps": result["non_private_steps"],
        "baseline_exact_match": result["baseline_exact_match"],
        "seconds": result["seconds"] - result["private_seconds"],
        **{m: result[f"non_private_{m}"] for m in METRICS[trainer]},
    }
    return [private, public]


def table(rows: list[dict]) -> str:
    lines = [
        "| trainer | run | ε (δ) | steps | held-out exact match | held-out preference accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for trainer in METRICS:
        for epsilon in (None, 8.0, 3.0):
            runs = [r for r in rows if r["trainer"] == trainer and r["epsilon"] == epsilon]
            if not runs:
                continue

            def cell(metric: str, runs=runs) -> str:
                values = [r[metric] for r in runs if metric in r]
                if not values:
                    return "-"
                if len(values) == 1:
                    return f"{values[0]:.3f}"
                return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} (n = {len(values)})"

            name = "non-private" if epsilon is None else "private (DP-SGD)"
            budget = "∞" if epsilon is None else f"{epsilon:g} ({runs[0]['delta']:.0e})"
            lines.append(
                f"| {trainer.upper()} | {name} | {budget} | {runs[0]['steps']} | {cell('exact_match')} | "
                f"{cell('preference_accuracy')} |"
            )
    baseline = next((r["baseline_exact_match"] for r in rows), None)
    if baseline is not None:
        lines.append(f"| both | trivial (majority answer; chance) | - | - | {baseline:.3f} | 0.500 |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", default=["sft", "dpo"], choices=list(METRICS))
    parser.add_argument("--epsilons", nargs="+", type=float, default=[3.0, 8.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--workdir", default="/tmp/sft_utility")
    parser.add_argument("--table", action="store_true", help="only print the table from the records")
    options = parser.parse_args(argv)
    if not options.table:
        done = {r["key"] for r in records(options.results) if r["epsilon"] is not None}
        for trainer in options.trainers:
            for epsilon in options.epsilons:
                for repeat in range(options.repeats):
                    key = run_key(trainer, epsilon, repeat)
                    if key in done:
                        continue
                    # the non-private run is deterministic: once per trainer, beside its first private run
                    first = epsilon == options.epsilons[0] and repeat == 0
                    found = run_recipe(trainer, epsilon, first, os.path.join(options.workdir, key))
                    options.results.parent.mkdir(parents=True, exist_ok=True)
                    with options.results.open("a") as f:
                        for record in found:
                            f.write(json.dumps({"key": key, **record}) + "\n")
                            print(json.dumps(record), flush=True)
    print(table(records(options.results)))


if __name__ == "__main__":
    main()
