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
import json
import os

import torch

from benchmarks.alternating import compare, print_arms
from benchmarks.speed import CLIP, MODELS, SIGMA, NonPrivate, make_chunks, per_example_loss
from hf_private import DPFPConfig
from hf_private.engine import PerExampleGradientEngine
from hf_private.optimizer import NoisyOptimizer
from hf_private.privacy import PrivacyPlan
from hf_private.privacy.noise import GaussianNoise


def build(model_name: str) -> tuple[torch.nn.Module, object]:
    """The seeded model with DP-FP's sound-mode trainable set (the head above the noise point), dropout off."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    method = DPFPConfig(noise_multiplier=SIGMA, max_grad_norm=CLIP).build_method()
    method.prepare_model(model)
    return model.train(), method


class SoundDPFP:
    """Forward mechanism at the noise point, the engine on the head, the noisy optimizer."""

    def __init__(self, model, method, batch_size: int, steps: int) -> None:
        self.model, self.batch_size = model, batch_size
        device = torch.device("cpu")
        plan = PrivacyPlan(100_000, batch_size, steps=steps, noise_multiplier=SIGMA, name=method.name,
                           stages=method.stages())
        method.attach_forward_mechanisms(model, GaussianNoise(device), plan)
        self.engine = PerExampleGradientEngine(model, CLIP)
        self.engine.attach()
        inner = torch.optim.AdamW([p for _, p in self.engine.parameters], lr=1e-5)
        self.optimizer = NoisyOptimizer(inner, self.engine, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                                        expected_batch_size=batch_size, noise=GaussianNoise(device),
                                        may_step=lambda: True, on_step=lambda: None)

    def step(self, chunks) -> None:
        for batch in chunks:
            with self.engine.recording(self.batch_size):
                per_example_loss(self.model, batch).sum().backward()
            self.engine.finish_backward()
        self.optimizer.step()


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

    model, method = build(args.model)
    arms = {"non-private head": NonPrivate(model, args.batch_size)}
    model, method = build(args.model)
    arms["hf_private dp-fp sound"] = SoundDPFP(model, method, args.batch_size, 1000)
    chunks = make_chunks(model, args.batch_size, args.seq_len, args.grad_accum, torch.device("cpu"))
    results = compare(arms, chunks, "non-private head", args.steps, args.rounds)
    result = {
        "device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(), "model": args.model,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "arms": results,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{args.model} T={args.seq_len}, {args.batch_size}x{args.grad_accum} per step, trainable "
          f"{result['trainable']}")
    print_arms(results)
    return result


if __name__ == "__main__":
    main()
