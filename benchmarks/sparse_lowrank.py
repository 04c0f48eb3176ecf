"""Sparse + low-rank DP-SGD (LoRA variant) against non-private LoRA of the same rank, in one process.

    python -m benchmarks.sparse_lowrank --model bert-base --seq-len 128 --rank 32 --sparsity 0.1

The arms (non-private LoRA, hf_private DP-LoRA, hf_private sparse LoRA: masks before the norm, masked noisy
coordinates zeroed and restored) run in alternating rounds on the same fixed batch, so per step is per example and
machine load hits them alike. Also reports the noised coordinate count with and without the masks. Peak memory is
each arm's VmHWM of one step after a reset, in this process (a lower bound on a fresh process's peak).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.alternating import PrivateArm, build_with_method, compare, print_arms, write_result
from benchmarks.speed import CLIP, SIGMA, NonPrivate, make_chunks
from hf_private import DPLoRAConfig, SparseLowRankConfig


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-base", choices=["bert-base", "roberta-base"])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--sparsity", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per arm per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/sparse_lowrank_cpu.json")
    args = parser.parse_args(argv)

    privacy = {"noise_multiplier": SIGMA, "max_grad_norm": CLIP}
    sparse = SparseLowRankConfig(**privacy, rank=args.rank, sparsity=args.sparsity, lora_alpha=16)
    plain = DPLoRAConfig(**privacy, lora_r=args.rank, lora_alpha=16)
    arms = {}
    model, _ = build_with_method(args.model, plain)
    arms["non-private lora"] = NonPrivate(model, args.batch_size)
    model, method = build_with_method(args.model, plain)
    arms["hf_private lora"] = PrivateArm(model, method, args.batch_size)
    model, method = build_with_method(args.model, sparse)
    arms["hf_private sparse lora"] = PrivateArm(model, method, args.batch_size)
    reports = method.report()
    chunks = make_chunks(model, args.batch_size, args.seq_len, args.grad_accum, torch.device("cpu"))
    results = compare(arms, chunks, "non-private lora", args.steps, args.rounds)
    result = {
        "device": "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": args.model,
        "seq_len": args.seq_len,
        "rank": args.rank,
        "sparsity": args.sparsity,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "noised_coordinates": reports["noised_coordinates"],
        "noised_coordinates_without_masks": reports["noised_coordinates_without_masks"],
        "arms": results,
    }
    write_result(args.out, result)
    print(
        f"{args.model} T={args.seq_len} rank {args.rank} p={args.sparsity}: noised coordinates "
        f"{result['noised_coordinates']:,} (unmasked LoRA {result['noised_coordinates_without_masks']:,})"
    )
    print_arms(results)
    return result


if __name__ == "__main__":
    main()
