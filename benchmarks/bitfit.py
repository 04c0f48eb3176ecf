"""DP-BiTFiT against non-private BiTFiT, non-private full fine-tuning and Opacus hooks on the same bias-only model.

    python -m benchmarks.bitfit --seq-lens 128 512 --batch-size 32

One process, alternating rounds, RoBERTa-base shape built from config (random init: speed does not depend on the
weights). Ratios are to non-private BiTFiT; the last column compares DP-BiTFiT with non-private full fine-tuning.
"""

from __future__ import annotations

import argparse
import logging

import torch

from benchmarks.speed import HfPrivate, NonPrivate, OpacusHooks, bench_config, print_table, write_results

ARMS = [
    ("non-private bitfit", NonPrivate, "bitfit"),
    ("hf_private bitfit", HfPrivate, "bitfit"),
    ("non-private full", NonPrivate, "full"),
    ("opacus-hooks bitfit", OpacusHooks, "bitfit"),
]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="roberta-base")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results/bitfit.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    results = []
    for seq_len in args.seq_lens:
        results.append(
            bench_config(args.model, ARMS, seq_len, args.batch_size, args.grad_accum, args.steps, args.rounds, device)
        )
        write_results(args.out, device, results)  # after every configuration: a crash loses one
    print_table(results, [label for label, _, _ in ARMS])
    for r in results:
        dp, full = r["arms"]["hf_private bitfit"], r["arms"]["non-private full"]
        print(
            f"T={r['seq_len']}: DP-BiTFiT vs non-private full fine-tuning: "
            f"{dp['median_step_s'] / full['median_step_s']:.2f}x time, {dp['peak_bytes'] / full['peak_bytes']:.2f}x "
            "peak memory"
        )
    return results


if __name__ == "__main__":
    main()
