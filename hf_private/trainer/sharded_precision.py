"""Mixed precision under sharding (`bf16=True` with FSDP2): FSDP2's own `MixedPrecisionPolicy`, with float32 where
privacy is computed.

What a sharded bf16 run computes in which dtype, and why:

* Each process keeps its shard of the trainable weights in float32 (the master weights: Accelerate's preparation
  casts trainable low-precision parameters up when mixed precision is on), and FSDP2 all-gathers them cast to bf16
  for forward and backward (`param_dtype`). Accelerate does not autocast a sharded model: FSDP2's policy is the mixed
  precision, so without one a `bf16=True` run would silently compute in float32. On the CPU Accelerate drops its
  plugin (see `sharded`), and with it the policy it builds from `mixed_precision="bf16"`: the trainer sets it here.
* The per-example terms are formed in bf16, as the layers computed; the engine accumulates norms, cross terms and
  clipped sums in float32 (`engine.terms.accumulation_dtype`), the optimizer reduce-scatters the clipped sums and adds
  the noise in float32, and the gradient it hands the inner optimizer is the float32 master shard's.
* FSDP2's own gradient reduction (`reduce_dtype`) never carries the private update, which the optimizer reduces
  itself; the engine's check against autograd compares with it. Accelerate's policy reduces in bf16; this one in
  float32, so that the check compares with float32 sums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import MixedPrecisionPolicy

if TYPE_CHECKING:
    from transformers import TrainingArguments


def sharded_precision_policy(
    args: TrainingArguments, plugin: FullyShardedDataParallelPlugin
) -> MixedPrecisionPolicy | None:
    """The policy a sharded private run trains with: bf16 compute with float32 reductions for `bf16=True`, none
    (float32, or the model's own dtype) otherwise. A policy the plugin already holds (Accelerate's, from
    `mixed_precision="bf16"`) is replaced; one that asks for another compute dtype, or any policy without
    `bf16=True`, is refused by name."""
    held = plugin.mixed_precision_policy
    if held is not None and (not args.bf16 or getattr(held, "param_dtype", None) not in (None, torch.bfloat16)):
        raise NotImplementedError(
            f"Sharded (FSDP2) private training supports one mixed precision, TrainingArguments(bf16=True); the FSDP "
            f"plugin asks for {held} (from `accelerate launch --mixed_precision` or the accelerate config): use "
            "bf16=True with `--mixed_precision bf16`, or no mixed precision."
        )
    if not args.bf16:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
