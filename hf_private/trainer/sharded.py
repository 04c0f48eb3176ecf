"""Sharded training with FSDP2 (`fully_shard`), as Accelerate drives it: how a private trainer reaches it, what it
refuses, and the one thing its step must add (every process runs the same number of chunks).

Asked for as users ask Accelerate for it: `accelerate launch --use_fsdp --fsdp_version 2 ...`, or
`TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})`. Two decisions, and why:

* The trainer shards the model when it is built, with Accelerate's own `fsdp2_prepare_model` and plugin (each layer
  Accelerate's wrap policy names, the embeddings, the final norm and head, then the root), rather than leaving it to
  `accelerator.prepare` in `train()`. The per-example engine and the noisy optimizer are built with the run and hold
  the trainable parameters, which `fully_shard` replaces by their DTensor shards: sharding first builds them on the
  shards. Accelerate's later `prepare` finds an `FSDPModule` and keeps it as it is (its own early return), so what
  trains is what Accelerate would have built.
* On the CPU, Accelerate keeps a multi-process run (gloo) MULTI_CPU and drops the FSDP plugin (it shards only on
  accelerator devices), then would wrap the model in DDP. There the trainer hands Accelerate's state the plugin the
  arguments asked for and marks it FSDP before Trainer's `accelerator.prepare`, which so finds an `FSDPModule` and
  leaves it as it is. That mark does not last: Accelerate's state is rebuilt from its process state (still
  MULTI_CPU) whenever one of its objects is made again, the optimizer wrapper `prepare` makes included, so from then on
  `accelerator.is_fsdp2` is False and Accelerate runs its CPU branches, not the GPU code path. What a sharded run needs
  after `prepare` therefore does not ask Accelerate: the step forces the reduce-scatter itself (`sync_gradients`) and
  `save_model` gathers the full weights itself (`full_state_dict`); a checkpoint's reads and writes mark Accelerate's
  state FSDP again while they run (`checkpoint_io`). That is what the two-process CPU tests exercise, and a way to
  try a sharded script without a GPU (`torchrun --nproc-per-node 2 script.py` with `use_cpu=True`).

The privacy path under sharding is the optimizer's (`NoisyOptimizer`: clipped sums reduce-scattered to the shards,
noise once per coordinate on its owner) and the engine's (its check against autograd on the reduced shards).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.constants import FSDP_MODEL_NAME
from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from ..data.chunks import PhysicalChunk, unit_sizes_of
from ..engine.sharding import is_sharded
from ..logs import get_logger
from ..optimizer import noisy_optimizer
from .sharded_precision import sharded_precision_policy

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

    from ..methods import MethodConfig

logger = get_logger(__name__)

FSDP2_FIX = (
    "Shard with FSDP2: `accelerate launch --use_fsdp --fsdp_version 2 ...`, or "
    "TrainingArguments(fsdp=True, fsdp_config={'fsdp_version': 2})."
)


def requested_plugin(args: TrainingArguments) -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin this run asks Accelerate for: the one Trainer builds from TrainingArguments' fsdp settings,
    else the launcher's (`accelerate launch --use_fsdp` sets ACCELERATE_USE_FSDP and FSDP_*); None for no sharding."""
    if args.fsdp_plugin_args is not None:
        return FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return FullyShardedDataParallelPlugin()
    return None


def check_sharding(args: TrainingArguments, model: nn.Module, dp_config: MethodConfig) -> None:
    """Refuse, by name, what sharded private training does not support (yet), before Trainer is built."""
    if args.fsdp_plugin_args is not None:
        version = int(args.fsdp_plugin_args.get("fsdp_version", 2))
    elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        version = int(os.environ.get("FSDP_VERSION", "1"))  # Accelerate's own default
    else:
        return
    if version != 2:  # before building its plugin, which FSDP1 cannot on a CPU
        raise ValueError(f"FSDP1 is not supported: the clipped sums are reduce-scattered to FSDP2 shards. {FSDP2_FIX}")
    plugin = requested_plugin(args)
    assert plugin is not None
    check_sharded_mesh(args)
    if args.gradient_checkpointing and plugin.activation_checkpointing:  # as Trainer refuses it on a GPU
        raise ValueError(
            "Activation checkpointing is asked for twice: fsdp_config['activation_checkpointing'] (FSDP's own) and "
            "gradient_checkpointing=True. Keep one of them (FSDP's own spares an all-gather in backward)."
        )
    refused = {
        "partly frozen models other than PEFT ones (saved as a private adapter)": not _is_peft(model)
        and not all(p.requires_grad for p in model.parameters()),
        f"the {type(dp_config).__name__} method (only DPConfig)": type(dp_config).__name__ != "DPConfig",
        "adaptive clipping": dp_config.max_grad_norm == "adaptive",  # its step-end update reads whole weights
        # their noise histories are whole tensors, not shards
        f"correlated noise (noise_mechanism={dp_config.noise_mechanism!r})": dp_config.noise_mechanism
        in ("band-mf", "band-inv-mf"),
        # TRL's SFT and DPO trainers train sharded (DPO's reference model sharded too), without these yet
        "TRL's packing and padding_free": bool(getattr(args, "packing", False) or getattr(args, "padding_free", False)),
        "DPO's precompute_ref_log_probs": bool(getattr(args, "precompute_ref_log_probs", False)),
        "DPO's sync_ref_model": bool(getattr(args, "sync_ref_model", False)),
        "CPU offload": isinstance(plugin.cpu_offload, CPUOffloadPolicy),
        "fp16 mixed precision (bf16=True is supported)": bool(args.fp16),
        "torch.compile": bool(args.torch_compile),
    }
    names = [name for name, hit in refused.items() if hit]
    if names:
        raise NotImplementedError(
            f"Sharded (FSDP2) private training does not support {', '.join(names)} yet: train without them, or "
            "without sharding (DDP: `accelerate launch --multi_gpu --num_processes N`)."
        )
    if args.world_size < 2:
        raise ValueError(
            "FSDP2 with one process shards nothing: launch several processes (`accelerate launch --use_fsdp "
            "--fsdp_version 2 --num_processes N`, or torchrun), or drop the fsdp settings."
        )


def check_sharded_mesh(holder: Any) -> None:
    """Only FSDP2's one-dimensional mesh: `holder`'s (TrainingArguments' or the Accelerator's) parallelism config
    must not ask for HSDP (replicas of shards) or tensor, context or sequence parallelism."""
    parallelism = getattr(holder, "parallelism_config", None)
    if parallelism is not None and any(
        getattr(parallelism, f"{axis}_size", 1) > 1 for axis in ("dp_replicate", "tp", "cp", "sp")
    ):
        raise ValueError(
            "HSDP, tensor, context and sequence parallelism are not supported with DP training: only FSDP2's "
            "one-dimensional sharding (full shard over every process)."
        )


def _is_peft(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("peft.") for m in (model, *model.children()))


def shard_for_training(trainer: Trainer, plugin: FullyShardedDataParallelPlugin) -> None:
    """`fully_shard` the trainer's model in place as Accelerate's FSDP2 preparation does, before the engine and the
    optimizer are built on its parameters; on the CPU, give Accelerate the plugin first (see the module docstring)."""
    state = trainer.accelerator.state
    if getattr(state, "fsdp_plugin", None) is None:
        state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        trainer.is_fsdp_enabled = True
        logger.info("Accelerate does not shard on %s: applying its FSDP2 preparation here.", trainer.args.device)
    model = trainer.model
    assert model is not None  # preflight refused a missing model
    plugin.mixed_precision_policy = sharded_precision_policy(trainer.args, plugin)
    if plugin.activation_checkpointing:  # as Accelerate's FSDP2 `prepare`: each layer of its wrap policy, then shard
        plugin.set_auto_wrap_policy(model)
        fsdp2_apply_ac(trainer.accelerator, model)
        plugin.activation_checkpointing = False  # applied: `prepare` would wrap it again, and fail on the FSDP layers
    fsdp2_prepare_model(trainer.accelerator, model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not is_sharded(trainable):  # refuses a mix of sharded and whole trainable parameters by itself
        raise RuntimeError("FSDP2's preparation left the trainable parameters whole (no DTensor).")
    # DPOTrainer's reference model: TRL shards it (`fully_shard` on the whole model, eval mode) when Accelerate is
    # FSDP at its construction; on the CPU it was not, so the same preparation here
    reference = getattr(trainer, "ref_model", None)
    if isinstance(reference, nn.Module) and not isinstance(reference, FSDPModule):
        from trl.models import prepare_fsdp

        trainer.ref_model = prepare_fsdp(reference, trainer.accelerator)  # type: ignore[attr-defined]


def sync_gradients(model: nn.Module) -> None:
    """Reduce-scatter every backward's gradient: Trainer's `no_sync` for FSDP2 would keep whole, unreduced gradients
    until the last micro-batch (the memory sharding saves), and the engine's check reads the reduced shards."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(True)


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The whole model's weights gathered from the shards, as `save_pretrained` writes them (a PEFT model's trainable
    ones alone: its adapter, without gathering the frozen base it does not write): a collective (every process calls
    it); full tensors on the CPU of the main process, an empty dict on the others."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=_is_peft(model))
    )


def check_resumable(checkpoint: str, processes: int, plugin: FullyShardedDataParallelPlugin) -> None:
    """A sharded run resumes only from a checkpoint that a sharded run of the same layout wrote: this plugin's
    state_dict_type (SHARDED_STATE_DICT: the shards in `pytorch_model_fsdp_0/`; FULL_STATE_DICT:
    `pytorch_model_fsdp.bin`) and as many processes as now (Trainer writes one `rng_state_<rank>.pth` each). Another
    layout is untested, so it is refused by name rather than loaded in part."""
    kind = "SHARDED_STATE_DICT" if "SHARDED" in str(plugin.state_dict_type) else "FULL_STATE_DICT"
    weights = os.path.join(
        checkpoint, f"{FSDP_MODEL_NAME}_0" if kind == "SHARDED_STATE_DICT" else f"{FSDP_MODEL_NAME}.bin"
    )
    saved_by = len([name for name in os.listdir(checkpoint) if name.startswith("rng_state_")])
    if not os.path.exists(weights) or saved_by != processes:
        raise ValueError(
            f"{checkpoint} was not written by a sharded run of {processes} processes with "
            f"fsdp_config['state_dict_type'] = {kind!r} (it holds {saved_by} per-process RNG states and "
            f"{'no' if not os.path.exists(weights) else 'the'} {os.path.basename(weights)}): resume a sharded run with "
            "the number of processes and the state_dict_type its checkpoints were saved with, or start afresh."
        )


@contextmanager
def checkpoint_io(trainer: Any) -> Iterator[None]:
    """While Trainer saves or loads a sharded checkpoint's model and optimizer state with Accelerate's FSDP helpers.

    Two things differ from Trainer's own FSDP2 run. Accelerate's state is marked FSDP again while they run: on the
    CPU it reads MULTI_CPU after `prepare` (module docstring), and its FULL_STATE_DICT loader would then return early
    on every process but the main one, which waits alone in the broadcast of the weights. And Trainer holds the inner
    optimizer, not the noisy one: Accelerate reads the optimizer's state with torch's `get_optimizer_state_dict`,
    which creates a missing state (at a resume, before the load; plain SGD, always) by one `step()` on zero
    gradients at learning rate 0; through the noisy optimizer that step would add noise and record one more release
    in the ledger at every resume, while the inner optimizer's changes nothing and its state is then replaced by the
    checkpoint's."""
    state = trainer.accelerator.state
    kind, state.distributed_type = state.distributed_type, DistributedType.FSDP
    noisy = noisy_optimizer(trainer.optimizer)
    wrapped = trainer.optimizer
    if noisy is not None:
        trainer.optimizer = noisy.optimizer
    try:
        yield
    finally:
        trainer.optimizer, state.distributed_type = wrapped, kind


def padding_chunks(chunks: list[PhysicalChunk], device: torch.device) -> int:
    """How many chunks this process must add so that every process runs as many as the one with the most.

    FSDP2 all-gathers each unit's parameters in forward and reduce-scatters its gradient in backward: collectives that
    every process must join. A Poisson batch gives each process its own number of units, so the counts differ."""
    count = torch.tensor([len(chunks)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item()) - len(chunks)


def join_the_other_chunks(trainer: Any, model: nn.Module, engine: Any, padding: int) -> None:
    """After this process's own chunks: `padding` chunks of public filler (`padding_inputs`), each recorded as one
    unit whose loss counts zero, so that this process joins the collectives of the chunks other processes still run
    and adds exactly zero to the clipped sums; then the independence probe where it is due, on the probe chunk alone
    (the same forwards on every process)."""
    if padding:
        dataset, collate = trainer.training_data()
        inputs = padding_inputs(unit_sizes_of(collate([dataset[0]]))[0])  # no user's unit sizes: a plain row
        rows = trainer.trainer_family.rows_per_unit(model, inputs)
    for _ in range(padding):
        model.train()
        with engine.recording(1, rows):
            trainer.accelerator.backward(trainer._training_loss(model, trainer._prepare_inputs(inputs)) * 0.0)
        engine.finish_backward()
    if trainer.privacy_run.needs_independence_probe:
        trainer._probe_example_independence(model, None, engine)


def padding_inputs(collated: dict[str, Any]) -> dict[str, Any]:
    """One row of public filler shaped like a collated row (token ids and labels 0, attention mask 1): the forward
    and backward a padding chunk runs, whose loss is multiplied by zero. Nothing of any example is in it."""
    return {
        key: (torch.ones_like(value) if key == "attention_mask" else torch.zeros_like(value))
        if isinstance(value, torch.Tensor)
        else value
        for key, value in collated.items()
    }
