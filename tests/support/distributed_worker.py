"""One training process of the multi-process tests (tests/trainer/test_distributed.py launches it).

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 tests/support/distributed_worker.py \
        --method full --case update noise --out DIR

For each case, each rank writes `DIR/CASE/rank{R}.pt`: the trainable parameters before and after, the privacy report,
and how often it wrote the card and the model. The cases of one launch run one after the other in the same processes
(a launch costs more than a case), each with the test's patches undone after it. The same function runs in one
process for the reference run.

Methods: full, lora, bitfit, frost, rgp (and rgp-entropy), users and users-els (DP-SGD at user level, ULS and ELS),
frost-users (DP-FROST under ULS), adaptive (DP-SGD with max_grad_norm="adaptive").

Cases:
  update  noise switched off (monkeypatched, test only): the update must equal the one-process update
  noise   a zero loss, so the applied update is the noise alone: its variance must be σ²C²/(qN)²
  count   every noise on under the test seed: each step's unclipped count (this rank's share, exact) and the noisy
          fraction the run released, and the C it moved to (adaptive clipping's count must be noised once)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorWithPadding, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_private import (  # noqa: E402
    BitFitConfig,
    DPConfig,
    FrostConfig,
    PrivateTrainer,
    SparseLowRankConfig,
)
from hf_private.privacy import PrivacyLedger  # noqa: E402
from hf_private.privacy.noise import GaussianNoise  # noqa: E402
from hf_private.release import card_facts, checkpoints  # noqa: E402
from hf_private.run.adaptive_clip import AdaptiveClip, CountingClipReducer  # noqa: E402
from hf_private.run.method_view import MethodView  # noqa: E402
from recipes.process_group import exit_after_success  # noqa: E402
from tests.support import tiny  # noqa: E402

DATASET_SIZE = 64
USER_LEVEL = ("users", "users-els", "frost-users")
USERS = 20  # at user level (USER_LEVEL methods): 20 users of 2 to 4 examples
KEPT = 53  # ELS ("users-els"): the examples left when each of them keeps at most 3
NOISE_MULTIPLIER, CLIP = 1.0, 1.0
LOGICAL_BATCH, GRAD_ACCUM = 16, 2
LEARNING_RATE = {"update": 0.05, "noise": 1.0, "count": 0.05}
STEPS = {"update": 3, "noise": 1, "count": 6}


def build(method: str):
    model = tiny.roberta()
    if method == "lora":
        return get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0)), DPConfig
    if method == "frost":  # the selection's sample is sharded over the ranks and its magnitudes summed
        return model, partial(FrostConfig, unfreeze_ratio=0.3, selection_sample_rate=0.25)
    if method in ("rgp", "rgp-entropy"):  # every rank must compute the same carriers from the same weights
        return model, partial(SparseLowRankConfig, variant="rgp", rank=2, sparsity=0.25)
    if method == "users":  # user level (ULS): users sharded over the ranks, each with up to 3 of their examples
        return model, partial(DPConfig, privacy_unit="user", user_column="user_id", examples_per_user=3)
    if method == "frost-users":  # DP-FROST under ULS: each selection round samples users, sharded over the ranks
        return model, partial(
            FrostConfig,
            unfreeze_ratio=0.3,
            selection_sample_rate=0.25,
            privacy_unit="user",
            user_column="user_id",
            examples_per_user=3,
        )
    if method == "users-els":  # user level (ELS): the cap drawn on the main process, shared with the other
        return model, partial(
            DPConfig, privacy_unit="user", user_column="user_id", user_sampling="example", max_examples_per_user=3
        )
    if method == "adaptive":  # C starts at the tiny model's typical norm, so the count moves it both ways
        return model, partial(DPConfig, initial_max_grad_norm=CLIP)
    return model, (BitFitConfig if method == "bitfit" else DPConfig)


PATCHED = [
    (GaussianNoise, "add_"),
    (MethodView, "release"),
    (CountingClipReducer, "pop_centred_count"),
    (AdaptiveClip, "update"),
    (card_facts, "write_model_card"),
    (PrivacyLedger, "save"),
    (checkpoints, "save_private_adapter"),
]


@contextlib.contextmanager
def patches_undone() -> Iterator[None]:
    """`run` patches library functions to switch noise off or to record; put them back after it."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in PATCHED]
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def run(method: str, case: str, out: Path, world_size: int) -> None:
    """One case's training, in this process (one rank of a launch, or the one-process reference), patching as it
    needs: call it inside `patches_undone()`."""
    out.mkdir(parents=True, exist_ok=True)
    model, config_class = build(method)
    model.double()  # the comparison with one process is at 1e-6: keep summation-order error far below it
    # rgp-entropy: no test seed, so the carriers' seed comes from OS entropy on rank 0 and must be broadcast
    dp = config_class(
        noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm="adaptive" if method == "adaptive" else CLIP,
        noise_seed=None if method == "rgp-entropy" else 11,
    )
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=LOGICAL_BATCH // (GRAD_ACCUM * world_size),
        gradient_accumulation_steps=GRAD_ACCUM,
        max_steps=STEPS[case],
        optim="sgd",
        learning_rate=LEARNING_RATE[case],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    calls = {"card": 0, "ledger": 0, "model": 0}
    _count_calls(calls, model)
    releases = _record_releases()
    counts = _record_counts()
    if case == "update":
        GaussianNoise.add_ = lambda self, tensors, std: None  # test only: compare the deterministic part
    per_example_loss = _zero_loss if case == "noise" else None
    tok = tiny.tokenizer()
    dataset = tiny.sentiment_dataset(DATASET_SIZE)
    if method in USER_LEVEL:
        dataset = dataset.add_column("user_id", [i % USERS if i < 40 else (i * 7) % 13 for i in range(DATASET_SIZE)])
    trainer = PrivateTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorWithPadding(tok),
        dp_config=dp,
        per_example_loss=per_example_loss,
    )
    before = _trainable(trainer)
    trainer.train()
    trainer.save_model(str(out / "model"))
    torch.save(
        {
            "before": before,
            "after": _trainable(trainer),
            "report": trainer.privacy_report(),
            "calls": calls,
            "world_size": trainer.args.world_size,
            "wrapped": type(trainer.model_wrapped).__name__,
            "global_step": trainer.state.global_step,
            "releases": releases,
            "counts": counts,
        },
        out / f"rank{trainer.args.process_index}.pt",
    )


def _record_releases() -> list[torch.Tensor]:
    """Every vector a method releases through MethodRun (DP-FROST's selection rounds), as the method receives it."""
    releases, release = [], MethodView.release

    def recorded(self, *a, **kw):
        releases.append(release(self, *a, **kw).clone())
        return releases[-1]

    MethodView.release = recorded
    return releases


def _record_counts() -> dict[str, list[float]]:
    """Adaptive clipping's steps: this rank's exact Σ(b_i − ½), the noisy unclipped fraction released, the new C."""
    counts: dict[str, list[float]] = {"exact": [], "released": [], "clip": []}
    pop, update = CountingClipReducer.pop_centred_count, AdaptiveClip.update

    def recorded_pop(self, device):
        count = pop(self, device)
        counts["exact"].append(float(count.item()))
        return count

    def recorded_update(self, fraction):
        counts["released"].append(fraction)
        counts["clip"].append(update(self, fraction))
        return counts["clip"][-1]

    CountingClipReducer.pop_centred_count, AdaptiveClip.update = recorded_pop, recorded_update
    return counts


def _trainable(trainer: PrivateTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.engine.parameters}


def _zero_loss(model, outputs, labels) -> torch.Tensor:
    """Per-example losses times zero: every clipped gradient is 0, so the update is exactly the noise."""
    return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="none") * 0.0


def _count_calls(calls: dict[str, int], model) -> None:
    """Count real writes of the card, the ledger and the weights (save_pretrained as the main process, or the
    private adapter of a method that trains only some tensors)."""
    write_card, save_ledger, save_pretrained = (card_facts.write_model_card, PrivacyLedger.save, model.save_pretrained)

    def counted_write_card(*a, **kw):
        calls["card"] += 1
        return write_card(*a, **kw)

    def counted_save_ledger(self, *a, **kw):
        calls["ledger"] += 1
        return save_ledger(self, *a, **kw)

    def counted_save_pretrained(*a, **kw):
        calls["model"] += kw.get("is_main_process", True) is not False
        return save_pretrained(*a, **kw)

    save_adapter = checkpoints.save_private_adapter

    def counted_save_adapter(*a, **kw):
        calls["model"] += 1
        return save_adapter(*a, **kw)

    card_facts.write_model_card = counted_write_card
    PrivacyLedger.save = counted_save_ledger
    model.save_pretrained = counted_save_pretrained
    checkpoints.save_private_adapter = counted_save_adapter


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--method",
        choices=[
            "full",
            "lora",
            "bitfit",
            "frost",
            "rgp",
            "rgp-entropy",
            "users",
            "users-els",
            "frost-users",
            "adaptive",
        ],
        required=True,
    )
    parser.add_argument("--case", choices=sorted(LEARNING_RATE), nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    for case in ns.case:
        with patches_undone():
            run(ns.method, case, ns.out / case, int(os.environ.get("WORLD_SIZE", "1")))
    # interpreter teardown once aborted a rank after its work was done (exit code -6; in three CI runs)
    exit_after_success()
