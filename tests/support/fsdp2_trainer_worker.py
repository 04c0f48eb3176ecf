"""One training process of the sharded trainer tests (tests/trainer/test_fsdp2_trainer.py launches it), as a user
without a GPU would run a sharded script:

    torchrun --nproc-per-node 2 tests/support/fsdp2_trainer_worker.py --case noisy --out DIR

`PrivateTrainer` with `DPConfig` (full fine-tuning) on a tiny Llama, `TrainingArguments(fsdp=True,
fsdp_config={"fsdp_version": 2}, use_cpu=True)`, a few steps under a test seed; with one process (`run(...,
world_size=1)`, no fsdp settings) the same run unsharded. Rank 0 writes `DIR/result.pt`: the full parameters after
training, the privacy report, which parameters were sharded, the indices each step sampled on each rank, and the
card; `save_model` writes `DIR/model`.

Cases: `noisy` (noise on); `clipped` and `neighbour` (noise off, test only, one step: the released update is the
clipped sum; the example `--scaled` has its loss weighted by `WEIGHT_DOWN`, resp. `WEIGHT_UP`, through the public
`per_example_loss`: two neighbouring datasets whose one example's gradient differs by a factor 10^12);
`checkpointed` (as `noisy`, AdamW, a checkpoint every step, `fsdp_config["state_dict_type"]` from
`--state-dict-type`; `--kill-at S` interrupts it after step S, `--resume` resumes it from its newest checkpoint; the
full model and optimizer state are recorded at each save and when the resumed run begins); `budget` (a secret seed,
target ε, σ calibrated for `STEPS["budget"]` steps, then asked for `BUDGET_ASKED`: the budget must stop it).
Options of the `noisy` case: `--users` (user-level units: `USERS` users of unequal sizes, `EXAMPLES_PER_USER` each
at most), `--checkpointing args|reentrant|fsdp` (activation checkpointing asked for by `gradient_checkpointing=True`,
non-reentrant or reentrant, resp. `fsdp_config["activation_checkpointing"]`; the result counts the forwards of the
model and of its first decoder layer's first norm, which a recompute begins once more). Option of the
`checkpointed` case: `--lora` (a PeftModel, LoRA as tests/support/fsdp2_lora_worker.py's on the tiny Llama).
`--evaluate`: Trainer evaluates on `eval_dataset()` after every step; the result lists the eval losses.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from transformers import DataCollatorForLanguageModeling, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_private import DPConfig, PrivateTrainer  # noqa: E402
from hf_private.data.labels import IGNORE_INDEX  # noqa: E402
from hf_private.data.sampling import PoissonBatchSampler  # noqa: E402
from hf_private.integrations.losses import default_per_example_loss  # noqa: E402
from hf_private.optimizer import noisy_optimizer  # noqa: E402
from hf_private.privacy.noise import GaussianNoise  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.helpers import KillAtStep  # noqa: E402

DATASET_SIZE = 32
LOGICAL_BATCH, GRAD_ACCUM = 8, 2
CLIP, NOISE_MULTIPLIER, LEARNING_RATE = 0.5, 1.0, 0.1
STEPS = {"noisy": 3, "clipped": 1, "neighbour": 1, "checkpointed": 3, "budget": 2}
WEIGHT_DOWN, WEIGHT_UP = 1e-6, 1e6  # the scaled example's loss weight in `clipped` and `neighbour`
BUDGET_EPSILON, BUDGET_ASKED = 2.0, 40
CHECKPOINT_LEARNING_RATE = 1e-3  # AdamW: the steps the checkpoint tests compare stay small
EVAL_SIZE, EVAL_LENGTH = 12, 4  # `--evaluate`: every row of tiny.lm_dataset(12, seed=5) has at least 4 tokens
USERS, EXAMPLES_PER_USER = 11, 2  # --users: user u holds the examples i with i % USERS == u (2 or 3 of them)


def dataset(users: bool = False):
    data = tiny.lm_dataset(DATASET_SIZE)
    return data.add_column("user_id", [i % USERS for i in range(DATASET_SIZE)]) if users else data


def eval_dataset():
    """`EVAL_SIZE` rows cut to `EVAL_LENGTH` tokens each: Trainer weighs each process's eval loss by its tokens, so with
    rows of one length the loss of every way of batching and spreading them over processes is their mean."""
    rows = tiny.lm_dataset(EVAL_SIZE, seed=5)
    return rows.map(lambda row: {key: value[:EVAL_LENGTH] for key, value in row.items()})


def scaled_loss(example: int, weight: float):
    """The model's own per-example loss, times `weight` for the rows that are `example` (matched by its labels: the
    collator's labels are its token ids, padding -100). The filler chunks of a sharded step are token 0, never it."""
    ids = [token for token in dataset()[example]["input_ids"] if token != tiny.tokenizer().pad_token_id]

    def loss(model, outputs, labels):
        losses = default_per_example_loss(model, outputs, labels)
        hit = torch.tensor([row[row != IGNORE_INDEX].tolist() == ids for row in labels], device=losses.device)
        return torch.where(hit, losses * weight, losses)

    return loss


def run(case: str, out: Path, world_size: int, options: argparse.Namespace) -> None:
    model = tiny.llama()
    model.double()  # the comparison with one process is at 1e-5: keep summation-order error far below it
    if options.lora:  # a PeftModel: LoRA adapters trained, the base frozen (and sharded too)
        from peft import LoraConfig, get_peft_model

        from tests.support.fsdp2_lora_worker import LORA  # that module imports this one: here, not at the top

        model = get_peft_model(model, LoraConfig(**LORA))
    fsdp_config = {"fsdp_version": 2}
    if options.state_dict_type is not None:
        fsdp_config["state_dict_type"] = options.state_dict_type
    if options.checkpointing == "fsdp":
        fsdp_config["activation_checkpointing"] = True
    sharding = {"fsdp": True, "fsdp_config": fsdp_config} if world_size > 1 else {}
    checkpointing = {}
    if options.checkpointing in ("args", "reentrant"):
        reentrant = {"use_reentrant": options.checkpointing == "reentrant"}
        checkpointing = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": reentrant}
    checkpointed = case == "checkpointed"
    evaluation = (
        {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 2} if options.evaluate else {}
    )
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=LOGICAL_BATCH // (GRAD_ACCUM * world_size),
        gradient_accumulation_steps=GRAD_ACCUM,
        max_steps=STEPS[case],
        optim="adamw_torch" if checkpointed else "sgd",
        learning_rate=CHECKPOINT_LEARNING_RATE if checkpointed else LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps" if checkpointed else "no",
        save_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **sharding,
        **checkpointing,
        **evaluation,
    )
    sampled = _record_samples()
    if case in ("clipped", "neighbour"):  # test only: no noise, so the released update is the clipped sum alone
        GaussianNoise.add_ = lambda self, tensors, std: None  # type: ignore[method-assign]
        GaussianNoise.add_shards_ = lambda self, shards, std: None  # type: ignore[method-assign]
    dp_config = DPConfig(noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP, noise_seed=11)
    if case == "budget":  # a secret seed, as the one-process budget test
        dp_config = DPConfig(target_epsilon=BUDGET_EPSILON, max_grad_norm=CLIP)
    if options.users:
        dp_config = DPConfig(
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=CLIP,
            noise_seed=11,
            privacy_unit="user",
            user_column="user_id",
            examples_per_user=EXAMPLES_PER_USER,
        )
    loss = None
    if options.scaled is not None:
        loss = scaled_loss(options.scaled, WEIGHT_UP if case == "neighbour" else WEIGHT_DOWN)
    trainer = PrivateTrainer(
        model=model,
        args=args,
        train_dataset=dataset(options.users),
        eval_dataset=eval_dataset() if options.evaluate else None,
        data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
        dp_config=dp_config,
        per_example_loss=loss,
    )
    if case == "budget":
        trainer.args.max_steps = BUDGET_ASKED  # asks for many more steps than σ was calibrated for
    states = _StateRecorder(trainer, options.resume)
    trainer.add_callback(states)
    if options.kill_at is not None:
        trainer.add_callback(KillAtStep(options.kill_at))
    warnings = _record_warnings()
    forwards = _count_forwards(trainer.model)
    try:
        trainer.train(resume_from_checkpoint=True if options.resume else None)
    except KeyboardInterrupt:  # --kill-at: the checkpoints written so far are what a resume starts from
        pass
    else:
        trainer.save_model(str(out / "model"))
    params = dict(trainer.model.named_parameters())
    full = get_model_state_dict(trainer.model, options=FULL)
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
                "epsilon": trainer.ledger.epsilon(),
                "ledger_steps": trainer.ledger.total_steps,
                "expected_batch": trainer.sample_rate * trainer.dataset_size,
                "world_size": trainer.args.world_size,
                "global_step": trainer.state.global_step,
                "samples": samples,
                "card": card.read_text() if card.exists() else "",
                "accelerate_fsdp2_at_save": trainer.accelerator.is_fsdp2,
                "states": states.recorded,
                "warnings": warnings,
                "forwards": forwards,
                "eval_losses": [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
            },
            out / ("resumed.pt" if options.resume else "result.pt"),
        )


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class _StateRecorder(TrainerCallback):
    """The full model and optimizer state (gathered from the shards: a collective, on every process; copied, since
    tensors that are not sharded, such as Adam's step count, come back as the live ones) after each checkpoint is
    saved (`saved`, by step) and, in a resumed run, when training begins (`begin`: after the checkpoint's loads; in a
    fresh run the optimizer has no state yet, and reading it would create one)."""

    def __init__(self, trainer: PrivateTrainer, resumed: bool) -> None:
        self.trainer, self.resumed, self.recorded = trainer, resumed, {"saved": {}}

    def _state(self) -> dict:
        model, inner = self.trainer.model, noisy_optimizer(self.trainer.optimizer).optimizer  # type: ignore[union-attr]
        state = {
            "model": get_model_state_dict(model, options=FULL),
            "optimizer": get_optimizer_state_dict(model, inner, options=FULL),
        }
        return copy.deepcopy(state)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resumed:
            self.recorded["begin"] = self._state()

    def on_save(self, args, state, control, **kwargs):
        self.recorded["saved"][state.global_step] = self._state()


def _count_forwards(model) -> dict[str, int]:
    """How many forwards the model and its first decoder layer's first norm began (checkpointed: the norm's twice a
    pass, its recompute in backward; a pre-hook, since a recompute stops once it has what backward reads)."""
    counts = {"model": 0, "layer": 0}
    norm = next(m for name, m in model.named_modules() if "layers.0." in name and name.endswith("input_layernorm"))
    for name, module in (("model", model), ("layer", norm)):
        module.register_forward_pre_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def _record_warnings() -> list[str]:
    """hf_private's WARNING lines on this process."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers.hf_private").addHandler(handler)
    return lines


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
    parser.add_argument("--scaled", type=int, default=None, help="the example whose loss is weighted")
    parser.add_argument("--state-dict-type", choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"], default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--users", action="store_true", help="user-level privacy units")
    parser.add_argument("--lora", action="store_true", help="LoRA on the tiny Llama (a PeftModel)")
    parser.add_argument("--evaluate", action="store_true", help="evaluate on eval_dataset() after every step")
    parser.add_argument("--checkpointing", choices=["args", "reentrant", "fsdp"], default=None)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    run(ns.case, ns.out, int(os.environ.get("WORLD_SIZE", "1")), ns)
    if dist.is_initialized():
        dist.destroy_process_group()
