"""One training process of tests/integrations/test_fsdp2_trl.py: `privatize(SFTTrainer)` and `privatize(DPOTrainer)`
sharded, run as tests/support/fsdp2_trainer_worker.py runs `PrivateTrainer` (its sizes, clip, σ and learning rate):

    torchrun --nproc-per-node 2 tests/support/fsdp2_trl_worker.py --case dpo --out DIR

Cases: `sft` (SFTTrainer, prompt-completion pairs, full fine-tuning); `dpo` (DPOTrainer, full fine-tuning, a separate
reference model, which the sharded run shards too); `dpo-lora` (DPOTrainer on a PeftModel, no reference model: the
base with the adapter disabled is the reference). Every model is the tiny Llama in float64 (compared with one process
at 1e-5), noise on, the test seed. With one process (`WORLD_SIZE` unset) the same run unsharded.
Rank 0 writes `DIR/result.pt`: the full parameters after training, which parameters were sharded, the reference
model's parameters (gathered) and whether each was a DTensor shard, the privacy report and the ledger's steps;
`save_model` writes `DIR/model`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_private import DPConfig, privatize  # noqa: E402
from tests.support import fsdp2_trainer_worker as full  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.fsdp2_lora_worker import LORA  # noqa: E402
from tests.support.helpers import TRL_TEST_ARGS  # noqa: E402

CASES = ("sft", "dpo", "dpo-lora")
STEPS = 3
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(case: str, out: Path, world_size: int):
    """The case's private TRL trainer (sharded when `world_size` > 1, as under torchrun), not yet trained."""
    sharding = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if world_size > 1 else {}
    settings = dict(
        TRL_TEST_ARGS,
        output_dir=str(out),
        per_device_train_batch_size=full.LOGICAL_BATCH // (full.GRAD_ACCUM * world_size),
        gradient_accumulation_steps=full.GRAD_ACCUM,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=full.LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        **sharding,
    )
    dp_config = DPConfig(noise_multiplier=full.NOISE_MULTIPLIER, max_grad_norm=full.CLIP, noise_seed=11)
    model = tiny.llama().double()
    if case == "sft":
        return privatize(SFTTrainer)(
            model,
            SFTConfig(**settings),
            train_dataset=tiny.prompt_completions(full.DATASET_SIZE),
            processing_class=tiny.chat_tokenizer(),
            dp_config=dp_config,
        )
    reference = tiny.llama().double() if case == "dpo" else None
    if case == "dpo-lora":
        model = get_peft_model(model, LoraConfig(**LORA))
    return privatize(DPOTrainer)(
        model,
        reference,
        DPOConfig(**settings),
        train_dataset=tiny.preference_pairs(full.DATASET_SIZE),
        processing_class=tiny.chat_tokenizer(),
        dp_config=dp_config,
    )


def run(case: str, out: Path, world_size: int) -> None:
    trainer = build(case, out, world_size)
    trainer.train()
    trainer.save_model(str(out / "model"))
    params = dict(trainer.model.named_parameters())
    after = get_model_state_dict(trainer.model, options=FULL)
    reference = getattr(trainer, "ref_model", None)
    ref_params = dict(reference.named_parameters()) if reference is not None else {}
    ref_after = get_model_state_dict(reference, options=FULL) if reference is not None else {}
    if trainer.args.process_index == 0:
        torch.save(
            {
                "after": {name: tensor.detach().clone() for name, tensor in after.items()},
                "sharded": {n: isinstance(p, DTensor) and p.to_local().shape != p.shape for n, p in params.items()},
                "trainable": sorted(n for n, p in params.items() if p.requires_grad),
                "reference": {name: tensor.detach().clone() for name, tensor in ref_after.items()},
                "reference_sharded": {
                    n: isinstance(p, DTensor) and p.to_local().shape != p.shape for n, p in ref_params.items()
                },
                "report": trainer.privacy_report(),
                "ledger_steps": trainer.ledger.total_steps,
                "world_size": trainer.args.world_size,
                "global_step": trainer.state.global_step,
            },
            out / "result.pt",
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    run(ns.case, ns.out, int(os.environ.get("WORLD_SIZE", "1")))
    if dist.is_initialized():
        dist.destroy_process_group()
