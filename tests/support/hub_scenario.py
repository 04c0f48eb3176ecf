"""Client side of tests/trainer/test_hub.py, run in a subprocess because huggingface_hub reads HF_ENDPOINT at import.

Pushes a DP-BiTFiT adapter (`PrivateTrainer.push_to_hub`), a DP-LoRA adapter (the recipe's `--push_to_hub`) and
LoRA adapters trained with the privatized TRL SFT and DPO trainers, downloads each into a fresh directory, loads it
onto a fresh base, compares logits with the trained model and re-reads the privacy block from the Hub card. Prints
one JSON line of findings; asserts fail the process.
With strategy names after the work directory, pushes with each `hub_strategy` from an output directory littered with
what `save_state()`, `save_metrics()`, a logging integration and the user leave there (`push_with_strategy`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from huggingface_hub import ModelCard, snapshot_download
from peft import PeftModel
from transformers import DataCollatorWithPadding

from hf_private import BitFitConfig, PrivateTrainer, load_private_adapter
from tests.support import tiny
from tests.support.helpers import eval_logits, training_args

BITFIT_REPO, LORA_REPO = "me/tiny-bitfit-dp", "me/demo-lora-dp"
TRL_REPOS = {"sft": "me/tiny-sft-dp", "dpo": "me/tiny-dpo-dp"}
TRL_UNITS = {"sft": "conversation", "dpo": "preference pair"}


def _batch(tokenizer, texts) -> dict:
    return dict(tokenizer(texts, padding=True, return_tensors="pt"))


def bitfit_round_trip(workdir: str) -> dict:
    tok = tiny.tokenizer()
    trainer = PrivateTrainer(
        model=tiny.roberta(),
        train_dataset=tiny.sentiment_dataset(96),
        eval_dataset=tiny.sentiment_dataset(32, seed=4),
        # save_steps=1: Trainer also pushes from each checkpoint (every_save) before the final push.
        args=training_args(
            os.path.join(workdir, "bitfit"),
            max_steps=2,
            push_to_hub=True,
            hub_model_id=BITFIT_REPO,
            save_strategy="steps",
            save_steps=1,
        ),
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=BitFitConfig(target_epsilon=3.0),
    )
    trainer.train()
    trainer.evaluate()
    trainer.push_to_hub(dataset="tiny generated sentiment data (tests)")

    fresh = snapshot_download(BITFIT_REPO, local_dir=os.path.join(workdir, "fresh-bitfit"))
    batch = _batch(tok, ["good movie", "the plot was awful and dull", "a very nice film"])
    expected = eval_logits(trainer.model, batch)
    from_hub = load_private_adapter(tiny.roberta(), BITFIT_REPO)
    from_fresh = load_private_adapter(tiny.roberta(), fresh)
    assert torch.equal(eval_logits(from_hub, batch), expected), "Hub adapter gives different logits"
    assert torch.equal(eval_logits(from_fresh, batch), expected), "downloaded directory gives different logits"

    privacy = ModelCard.load(BITFIT_REPO).data.to_dict()["privacy"]
    report = trainer.privacy_report()
    assert privacy["epsilon"] == report["epsilon"] and privacy["delta"] == report["delta"], (privacy, report)
    assert privacy["guarantee"] == "formal" and privacy["unit"] == "example" and privacy["method"] == "dp-bitfit"
    card = ModelCard.load(BITFIT_REPO)
    card_text = card.text
    assert "| eval_loss |" in card_text and f'load_private_adapter(base, "{BITFIT_REPO}")' in card_text
    # The Hub's card is publishable as written: titled by its repo, licensed, indexed, versioned, no local path.
    assert card.data.model_name == BITFIT_REPO.split("/")[-1] and card.data.license == "unknown"
    assert "eval_loss" in {result.metric_name for result in card.data.eval_results}
    assert "## Framework versions" in card_text and workdir not in str(card)
    return {"bitfit_files": sorted(os.listdir(fresh)), "bitfit_epsilon": privacy["epsilon"]}


def lora_recipe_round_trip(workdir: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    import glue
    from demo_task import demo_model, demo_tokenizer

    output_dir = os.path.join(workdir, "recipe")
    result = glue.main(
        [
            "--method",
            "dp-lora",
            "--max_steps",
            "2",
            "--output_dir",
            output_dir,
            "--push_to_hub",
            "true",
            "--hub_model_id",
            LORA_REPO,
            "--disable_tqdm",
            "true",
        ]
    )
    batch = _batch(demo_tokenizer(), ["a great and moving film", "not good , quite dull"])
    local = load_private_adapter(demo_model(), output_dir)
    from_hub = load_private_adapter(demo_model(), LORA_REPO)
    assert isinstance(from_hub, PeftModel)
    expected = eval_logits(local, batch)
    assert torch.equal(eval_logits(from_hub, batch), expected), "Hub LoRA adapter differs from the local one"
    assert not torch.equal(eval_logits(demo_model(), batch), expected), "the adapter changed nothing"
    card = ModelCard.load(LORA_REPO)
    privacy = card.data.to_dict()["privacy"]
    assert privacy["epsilon"] == result["epsilon"] and privacy["method"] == "dp-lora", privacy
    assert card.data.model_name == LORA_REPO.split("/")[-1] and card.data.library_name == "peft", card.data
    assert card.text.startswith(f"\n# {LORA_REPO.split('/')[-1]}\n") and workdir not in str(card)
    return {"lora_epsilon": privacy["epsilon"]}


def trl_round_trip(workdir: str, kind: str) -> dict:
    """A private LoRA adapter trained with TRL's SFTTrainer (conversations) or DPOTrainer (preference pairs),
    pushed; loaded from the Hub with stock PEFT it gives the trained model's logits, and the Hub card names the unit
    and the trainer."""
    import trl
    from peft import LoraConfig

    from hf_private import DPConfig, privatize

    repo = TRL_REPOS[kind]
    config = dict(
        output_dir=os.path.join(workdir, kind),
        max_steps=2,
        per_device_train_batch_size=8,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        learning_rate=5e-2,
        push_to_hub=True,
        hub_model_id=repo,
        disable_tqdm=True,
        max_length=32,
    )
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    dp = DPConfig(target_epsilon=8.0)
    if kind == "sft":
        trainer = privatize(trl.SFTTrainer)(
            tiny.llama(),
            trl.SFTConfig(**config, assistant_only_loss=True),
            train_dataset=tiny.conversations(64),
            processing_class=tiny.chat_tokenizer(),
            peft_config=lora,
            dp_config=dp,
        )
    else:
        trainer = privatize(trl.DPOTrainer)(
            tiny.llama(),
            None,
            trl.DPOConfig(**config),
            train_dataset=tiny.preference_pairs(64),
            processing_class=tiny.chat_tokenizer(),
            peft_config=lora,
            dp_config=dp,
        )
    trainer.train()
    trainer.push_to_hub()

    batch = _batch(tiny.chat_tokenizer(), ["the movie was", "a film"])
    from_hub = PeftModel.from_pretrained(tiny.llama(), repo)
    assert torch.equal(eval_logits(from_hub, batch), eval_logits(trainer.model, batch)), f"{kind}: Hub adapter differs"
    card = ModelCard.load(repo)
    privacy = card.data.to_dict()["privacy"]
    assert privacy["epsilon"] == trainer.privacy_report()["epsilon"] and privacy["unit"] == TRL_UNITS[kind], privacy
    assert f"one training {TRL_UNITS[kind]}" in card.text and f"trl.{kind.upper()}Trainer" in card.text
    assert workdir not in str(card)
    return {f"{kind}_epsilon": privacy["epsilon"]}


def _leave_junk(trainer: PrivateTrainer) -> None:
    """Files that must never reach the Hub: trainer state (losses), metrics, an event file, the user's notes."""
    output_dir = trainer.args.output_dir
    os.makedirs(os.path.join(output_dir, "runs"), exist_ok=True)
    trainer.save_state()
    trainer.save_metrics("train", {"train_loss": 0.6931})
    with open(os.path.join(output_dir, "runs", "events.out.tfevents.1.host"), "wb") as f:
        f.write(b"loss=0.6931")
    with open(os.path.join(output_dir, "notes.txt"), "w") as f:
        f.write("private notes")


def push_with_strategy(workdir: str, strategy: str) -> list[str]:
    """Train with checkpoints every step, junk in the output directory before and after, push; list the directory."""
    tok = tiny.tokenizer()
    output_dir = os.path.join(workdir, strategy)
    trainer = PrivateTrainer(
        model=tiny.roberta(),
        train_dataset=tiny.sentiment_dataset(96),
        args=training_args(
            output_dir,
            max_steps=2,
            push_to_hub=True,
            hub_model_id=f"me/tiny-{strategy}",
            hub_strategy=strategy,
            save_strategy="steps",
            save_steps=1,
        ),
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=BitFitConfig(noise_multiplier=1.0),
    )
    _leave_junk(trainer)  # present at every checkpoint push
    trainer.train()
    _leave_junk(trainer)  # trainer_state.json now holds the un-noised losses
    trainer.push_to_hub()
    return sorted(os.listdir(output_dir))


if __name__ == "__main__":
    if len(sys.argv) > 2:
        findings = {strategy: push_with_strategy(sys.argv[1], strategy) for strategy in sys.argv[2:]}
    else:
        findings = {
            **bitfit_round_trip(sys.argv[1]),
            **lora_recipe_round_trip(sys.argv[1]),
            **trl_round_trip(sys.argv[1], "sft"),
            **trl_round_trip(sys.argv[1], "dpo"),
        }
    print(json.dumps(findings))
