"""DP-FP in sound mode against non-private training of the same head, in one process.

    python -m benchmarks.dpfp --model bert-base --seq-len 128

Sound mode freezes everything below the noise point (BERT's pooler output) and trains the head above it with
DP-SGD, with the representation clipped and noised in the forward pass. The non-private arm trains the same head of
the same frozen model with plain AdamW. Both arms run in alternating rounds on the same fixed batch, so per step is
per example and machine load hits them alike; peak memory is each arm's VmHWM of one step after a reset, in this
process.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.alternating import PrivateArm, build_with_method, compare, print_arms, write_result
from benchmarks.speed import CLIP, SIGMA, NonPrivate, make_chunks
from hf_private import DPFPConfig
from hf_private.privacy import PrivacyPlan


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-base", choices=["bert-base"])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per arm per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/dpfp_cpu.json")
    args = parser.parse_args(argv)

    sound = DPFPConfig(noise_multiplier=SIGMA, max_grad_norm=CLIP)  # the head above the noise point trains
    model, _ = build_with_method(args.model, sound)
    arms = {"non-private head": NonPrivate(model, args.batch_size)}
    model, method = build_with_method(args.model, sound)
    plan = PrivacyPlan(
        100_000, args.batch_size, steps=1000, noise_multiplier=SIGMA, name=method.name, stages=method.stages()
    )
    arms["hf_private dp-fp sound"] = PrivateArm(model, method, args.batch_size, plan)
    chunks = make_chunks(model, args.batch_size, args.seq_len, args.grad_accum, torch.device("cpu"))
    results = compare(arms, chunks, "non-private head", args.steps, args.rounds)
    result = {
        "device": "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": args.model,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "arms": results,
    }
    write_result(args.out, result)
    print(
        f"{args.model} T={args.seq_len}, {args.batch_size}x{args.grad_accum} per step, trainable {result['trainable']}"
    )
    print_arms(results)
    return result


if __name__ == "__main__":
    main()
