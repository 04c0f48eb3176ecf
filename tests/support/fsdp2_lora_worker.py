"""One training process of tests/trainer/test_fsdp2_lora_bf16.py: sharded DP-LoRA and sharded bf16 training, run
as tests/support/fsdp2_trainer_worker.py runs full fine-tuning (its sizes, clip, σ and learning rate):

    torchrun --nproc-per-node 2 tests/support/fsdp2_lora_worker.py --case lora --out DIR

Cases: `lora` (a PeftModel: LoRA on a tiny Llama in float64, the base frozen and sharded too, noise on); `bf16`
(full fine-tuning, float32 weights, `bf16=True`: sharded, FSDP2 computes in bf16; one process, bf16 autocast);
`fp32` (as `bf16` in float32: how far bf16 itself moves the update); `bf16-down` and `bf16-up` (as `bf16`, noise
off, test only, one step, the example `--scaled` has its loss weighted by `WEIGHTS[case]` through the public
`per_example_loss`: two neighbouring datasets whose one example's gradient differs by a factor 10^12). With one
process (`WORLD_SIZE` unset) the same run unsharded.
Rank 0 writes `DIR/result.pt` (the full parameters after training, what was sharded into which FSDP2 units, the
dtypes of the master weights, of a layer's forward and of the noised sums, the adapter files each rank wrote, the
privacy report); `save_model` writes `DIR/model`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, peft_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import DataCollatorForLanguageModeling, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_private import DPConfig, PrivateTrainer  # noqa: E402
from hf_private.privacy.noise import GaussianNoise  # noqa: E402
from tests.support import fsdp2_trainer_worker as full  # noqa: E402
from tests.support import tiny  # noqa: E402

STEPS = {"lora": 3, "bf16": 3, "fp32": 3, "bf16-down": 1, "bf16-up": 1}
WEIGHTS = {"bf16-down": 1e-6, "bf16-up": 1e6}  # the scaled example's loss weight
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")


def dataset():
    return tiny.lm_dataset(full.DATASET_SIZE)


def model_for(case: str) -> torch.nn.Module:
    """The case's model, the same on every process (built from a seeded config)."""
    if case == "lora":
        return get_peft_model(tiny.llama().double(), LoraConfig(**LORA))  # float64: compared with one process at 1e-5
    return tiny.llama()


def build(case: str, out: Path, world_size: int, scaled: int | None = None) -> PrivateTrainer:
    """The case's trainer (sharded when `world_size` > 1, as under torchrun), not yet trained."""
    sharding = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if world_size > 1 else {}
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=full.LOGICAL_BATCH // (full.GRAD_ACCUM * world_size),
        gradient_accumulation_steps=full.GRAD_ACCUM,
        max_steps=STEPS[case],
        optim="sgd",
        learning_rate=full.LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=case.startswith("bf16"),
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **sharding,
    )
    return PrivateTrainer(
        model=model_for(case),
        args=args,
        train_dataset=dataset(),
        data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
        dp_config=DPConfig(noise_multiplier=full.NOISE_MULTIPLIER, max_grad_norm=full.CLIP, noise_seed=11),
        per_example_loss=full.scaled_loss(scaled, WEIGHTS[case]) if scaled is not None else None,
    )


def run(case: str, out: Path, world_size: int, scaled: int | None) -> None:
    if case in WEIGHTS:  # test only: no noise, so the released update is the clipped sum alone
        GaussianNoise.add_ = lambda self, tensors, std: None  # type: ignore[method-assign]
        GaussianNoise.add_shards_ = lambda self, shards, std: None  # type: ignore[method-assign]
    trainer = build(case, out, world_size, scaled)
    forward_dtypes: set[torch.dtype] = set()
    layer = next(m for name, m in trainer.model.named_modules() if name.endswith("layers.0.mlp.down_proj"))
    layer.register_forward_hook(lambda module, inputs, output: forward_dtypes.add(output.dtype))
    adapter_writes = _count_adapter_writes()
    noised_dtypes = _record_noised_dtypes()
    trainer.train()
    trainer.save_model(str(out / "model"))
    params = dict(trainer.model.named_parameters())
    after = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    writes = [adapter_writes]
    if world_size > 1:
        writes = [None] * world_size
        dist.all_gather_object(writes, adapter_writes)
    if trainer.args.process_index == 0:
        torch.save(
            {
                "after": {name: tensor.detach().clone() for name, tensor in after.items()},
                "trainable": sorted(n for n, p in params.items() if p.requires_grad),
                "sharded": {n: isinstance(p, DTensor) and p.to_local().shape != p.shape for n, p in params.items()},
                "fsdp_units": sorted(n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)),
                "master_dtypes": sorted({str(p.dtype) for p in params.values() if p.requires_grad}),
                "forward_dtypes": sorted(str(dtype) for dtype in forward_dtypes),
                "adapter_writes": [len(w) for w in writes],
                "noised_dtypes": sorted(str(dtype) for dtype in noised_dtypes),
                "report": trainer.privacy_report(),
                "world_size": trainer.args.world_size,
                "global_step": trainer.state.global_step,
            },
            out / "result.pt",
        )


def _record_noised_dtypes() -> set[torch.dtype]:
    """The dtypes of the sums a sharded step noises (its shards of the clipped sums) on this process."""
    dtypes: set[torch.dtype] = set()
    add = GaussianNoise.add_shards_

    def recorded(self, shards, std):
        dtypes.update(shard.values.dtype for shard in shards)
        return add(self, shards, std)

    GaussianNoise.add_shards_ = recorded  # type: ignore[method-assign]
    return dtypes


def _count_adapter_writes() -> list[str]:
    """The files PEFT's `save_pretrained` writes with safetensors on this process."""
    written: list[str] = []
    save = peft_model.safe_save_file

    def recorded(tensors, filename, *args, **kwargs):
        written.append(str(filename))
        return save(tensors, filename, *args, **kwargs)

    peft_model.safe_save_file = recorded
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(STEPS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scaled", type=int, default=None, help="the example whose loss is weighted")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    run(ns.case, ns.out, int(os.environ.get("WORLD_SIZE", "1")), ns.scaled)
    if dist.is_initialized():
        dist.destroy_process_group()
