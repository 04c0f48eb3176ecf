"""One training process of the sharded trainer tests (tests/trainer/test_fsdp2_trainer.py launches it), as a user
without a GPU would run a sharded script:

    torchrun --nproc-per-node 2 tests/support/fsdp2_trainer_worker.py --case noisy --out DIR

`PrivateTrainer` with `DPConfig` (full fine-tuning) on a tiny Llama, `TrainingArguments(fsdp=True,
fsdp_config={"fsdp_version": 2}, use_cpu=True)`, a few steps under a test seed; with one process (`run(...,
world_size=1)`, no fsdp settings) the same run unsharded. Rank 0 writes `DIR/result.pt`: the full parameters after
training, the privacy report, which parameters were sharded, the indices each step sampled on each rank, and the
card; `save_model` writes `DIR/model`.

Cases: `noisy` (noise on), `clipped` (noise off, test only: the deterministic part), `neighbour` (noise off, one step,
the example `--replace` replaced by an unlike one: what the sensitivity test compares with `clipped`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import DataCollatorForLanguageModeling, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_private import DPConfig, PrivateTrainer  # noqa: E402
from hf_private.data.sampling import PoissonBatchSampler  # noqa: E402
from hf_private.privacy.noise import GaussianNoise  # noqa: E402
from tests.support import tiny  # noqa: E402

DATASET_SIZE = 32
LOGICAL_BATCH, GRAD_ACCUM = 8, 2
CLIP, NOISE_MULTIPLIER, LEARNING_RATE = 0.5, 1.0, 0.1
STEPS = {"noisy": 3, "clipped": 1, "neighbour": 1}
UNLIKE = "good good good good good good good good"


def dataset(replace: int | None):
    data = tiny.lm_dataset(DATASET_SIZE)
    if replace is None:
        return data
    unlike = tiny.tokenizer()(UNLIKE)
    return data.map(lambda row, i: dict(unlike) if i == replace else row, with_indices=True)


def run(case: str, out: Path, world_size: int, replace: int | None = None) -> None:
    model = tiny.llama()
    model.double()  # the comparison with one process is at 1e-5: keep summation-order error far below it
    sharding = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if world_size > 1 else {}
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=LOGICAL_BATCH // (GRAD_ACCUM * world_size),
        gradient_accumulation_steps=GRAD_ACCUM,
        max_steps=STEPS[case],
        optim="sgd",
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **sharding,
    )
    sampled = _record_samples()
    if case != "noisy":  # test only: no noise, so the released update is the clipped sum alone
        GaussianNoise.add_ = lambda self, tensors, std: None  # type: ignore[method-assign]
        GaussianNoise.add_shards_ = lambda self, shards, std: None  # type: ignore[method-assign]
    tok = tiny.tokenizer()
    trainer = PrivateTrainer(
        model=model,
        args=args,
        train_dataset=dataset(replace),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        dp_config=DPConfig(noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP, noise_seed=11),
    )
    trainer.train()
    trainer.save_model(str(out / "model"))
    params = dict(trainer.model.named_parameters())
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    samples = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(samples, sampled)
    else:
        samples = [sampled]
    if trainer.args.process_index == 0:
        card = out / "model" / "README.md"
        torch.save(
            {
                "after": {name: tensor.detach().clone() for name, tensor in full.items()},
                "sharded": {n: isinstance(p, DTensor) and p.to_local().shape != p.shape for n, p in params.items()},
                "report": trainer.privacy_report(),
                "world_size": trainer.args.world_size,
                "global_step": trainer.state.global_step,
                "samples": samples,
                "card": card.read_text() if card.exists() else "",
                "accelerate_fsdp2_at_save": trainer.accelerator.is_fsdp2,
            },
            out / "result.pt",
        )


def _record_samples() -> list[list[int]]:
    """The indices each logical batch sampled on this process, in order."""
    draws: list[list[int]] = []
    draw = PoissonBatchSampler._draw

    def recorded(self):
        batch = draw(self)
        draws.append(batch.tolist())
        return batch

    PoissonBatchSampler._draw = recorded  # type: ignore[method-assign]
    return draws


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(STEPS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replace", type=int, default=None)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    run(ns.case, ns.out, int(os.environ.get("WORLD_SIZE", "1")), ns.replace)
    if dist.is_initialized():
        dist.destroy_process_group()
