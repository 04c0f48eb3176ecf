"""The share of a private step each per-example gradient rule takes (issue 47: the matched and generic rules must not
slow the common path).

    python -m benchmarks.rule_share --models qwen3-8x512 mixtral-4x2 --seq-len 512

Each rule's `terms` (the work done in the backward hooks) is timed inside real private steps of the speed
benchmark's hf_private arm; `--generic` sends every module without a dedicated rule to the generic rule instead of
a matched one, to show what the generic rule would cost there.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.speed import MODELS, HfPrivate, build, make_chunks
from hf_private.engine.layers import rules


def rule_shares(model_name: str, seq_len: int, batch_size: int, grad_accum: int, steps: int) -> dict:
    """Median-free totals over `steps` steps after a warm-up: seconds per step in each rule, and the step's."""
    device = torch.device("cpu")
    arm = HfPrivate(build(model_name, "full", device), batch_size)
    chunks = make_chunks(arm.model, batch_size, seq_len, grad_accum, device)
    spent: dict[str, float] = defaultdict(float)
    for layer in arm.engine.layers:
        _time_terms(layer, spent)
    arm.step(chunks)  # warm-up: optimizer state, the first chunk's autograd check
    spent.clear()
    start = time.perf_counter()
    for _ in range(steps):
        arm.step(chunks)
    step_s = (time.perf_counter() - start) / steps
    return {
        "model": model_name,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "step_s": step_s,
        "rules": {rule: {"s_per_step": s / steps, "share": s / steps / step_s} for rule, s in sorted(spent.items())},
        "rule_lines": arm.engine.rule_lines(),
    }


def _time_terms(layer, spent: dict[str, float]) -> None:
    handler = layer.handler
    terms = handler.terms

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return terms(*args, **kwargs)
        finally:
            spent[handler.rule] += time.perf_counter() - start

    layer.handler = _Timed(handler, timed)


class _Timed:
    """The handler with its `terms` timed (each hooked layer gets its own wrapper: rules are shared instances)."""

    def __init__(self, handler, terms) -> None:
        self._handler, self.terms = handler, terms

    def __getattr__(self, name):
        return getattr(self._handler, name)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-8x512", "mixtral-4x2"], choices=sorted(MODELS))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--generic", action="store_true", help="no matched rules: the generic rule instead")
    parser.add_argument("--out", default="benchmarks/results/rule_share.json")
    args = parser.parse_args(argv)
    if args.generic:
        rules.matched_handler = lambda module, trainable: None  # type: ignore[assignment]
    results = []
    for model_name in args.models:
        result = rule_shares(model_name, args.seq_len, args.batch_size, args.grad_accum, args.steps)
        result["generic_instead_of_matched"] = args.generic
        results.append(result)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"{model_name} T={args.seq_len}: {result['step_s']:.2f} s/step")
        for rule, figures in result["rules"].items():
            print(f"  {rule:<55} {figures['s_per_step']:.3f} s/step  {100 * figures['share']:.1f}% of the step")
    return results


if __name__ == "__main__":
    main()
