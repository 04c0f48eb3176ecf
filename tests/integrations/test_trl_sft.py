"""DP SFT: `privatize(trl.SFTTrainer)` on a tiny Llama and a word-level chat tokenizer built in memory.

One unit is one sequence (a text, a prompt with its completion, a conversation), and its loss is its own mean over
its own trained tokens, never TRL's share of the batch's tokens (`num_items_in_batch`). The sensitivity tests go
through the public API: one SGD step at q = 1 (the whole training set is the batch), under a test seed so the noise
replays and cancels between two runs; the released sum is (W₀ − W₁)·B/lr. Mutation tests beside them put TRL's
batch-level normalisation back (both checks then fail) or take the per-example clip away (the bound then fails).
The settings SFT refuses are rows of tests/trainer/test_preflight.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel
from trl import SFTConfig, SFTTrainer  # the test extra installs trl: CI must run these, never skip them

import hf_private.trainer.mixin
from hf_private import DPConfig, privatize
from hf_private.data.labels import IGNORE_INDEX
from hf_private.demos.sentiment import NEGATIVE, NEUTRAL, POSITIVE
from hf_private.engine.reducers import FlatL2ClipReducer
from hf_private.evaluation import row_identity
from hf_private.evaluation.held_out import HELD_OUT, OVERLAPS, UNKNOWN
from hf_private.integrations import family_of
from tests.support import tiny
from tests.support.helpers import TRL_TEST_ARGS, run_doc_block

pytestmark = pytest.mark.usefixtures("single_thread")

SEED = 20261207
PrivateSFTTrainer = privatize(SFTTrainer)


def sft_config(tmp_path, **overrides) -> SFTConfig:
    defaults = dict(
        TRL_TEST_ARGS, per_device_train_batch_size=8, num_train_epochs=1, learning_rate=5e-3, logging_steps=1
    )
    return SFTConfig(str(tmp_path), **{**defaults, **overrides})


def sft_trainer(tmp_path, dataset, *, model=None, dp=None, per_example_loss=None, trainer_kwargs=None, **config):
    extra = {"per_example_loss": per_example_loss} if per_example_loss is not None else {}
    return PrivateSFTTrainer(
        model if model is not None else tiny.llama(),
        sft_config(tmp_path, **config),
        train_dataset=dataset,
        processing_class=tiny.chat_tokenizer(),
        dp_config=dp or DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
        **extra,
        **(trainer_kwargs or {}),
    )


# ---------------------------------------------------------------------- the three dataset kinds
KINDS = {
    "text": (tiny.texts, {}, "sequence"),
    "prompt-completion": (tiny.prompt_completions, {}, "prompt-completion pair"),
    "conversational": (tiny.conversations, {"assistant_only_loss": True}, "conversation"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_trains_privately_on_each_dataset_kind(kind, tmp_path):
    make, config, unit = KINDS[kind]
    trainer = sft_trainer(tmp_path, make(), **config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    report = trainer.privacy_report()
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] < float("inf")
    assert report["unit"] == unit and report["trainer"] == "trl.SFTTrainer"
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    # SFT's own training metrics are un-noised functions of the private batches: never logged in training
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert "epsilon" in logged and not logged & {"entropy", "mean_token_accuracy", "num_tokens", "grad_norm"}


def _trained_tokens(trainer) -> list[int]:
    return [sum(label != IGNORE_INDEX for label in labels) for labels in trainer.train_dataset["labels"]]


def test_completion_only_loss_and_assistant_only_loss_mask_what_is_trained(tmp_path):
    full = sft_trainer(tmp_path / "a", tiny.prompt_completions(8), completion_only_loss=False)
    completion = sft_trainer(tmp_path / "b", tiny.prompt_completions(8))  # TRL's default for prompt-completion: True
    lengths = [len(ids) for ids in completion.train_dataset["input_ids"]]
    assert _trained_tokens(full) == lengths
    assert _trained_tokens(completion) == [3] * 8  # two completion words and <eos>
    all_turns = sft_trainer(tmp_path / "c", tiny.conversations(8))
    assistant = sft_trainer(tmp_path / "d", tiny.conversations(8), assistant_only_loss=True)
    assert _trained_tokens(all_turns) == [len(ids) for ids in all_turns.train_dataset["input_ids"]]
    assert all(0 < a < b for a, b in zip(_trained_tokens(assistant), _trained_tokens(all_turns)))

    # the per-unit loss is each sequence's own mean over its trained tokens: masked prompt tokens change nothing
    batch = completion.data_collator([completion.train_dataset[i] for i in range(2)])
    model = completion.model
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    losses = completion.per_example_loss(model, outputs, batch["labels"])
    for b in range(2):
        keep = batch["labels"][b, 1:] != IGNORE_INDEX
        own = F.cross_entropy(outputs.logits[b, :-1][keep], batch["labels"][b, 1:][keep])
        torch.testing.assert_close(losses[b], own)


def test_a_lora_adapter_saves_and_reloads_with_stock_peft_and_generates(tmp_path):
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = sft_trainer(
        tmp_path,
        tiny.conversations(),
        assistant_only_loss=True,
        learning_rate=5e-2,
        trainer_kwargs={"peft_config": lora},
    )
    trainer.train()
    assert trainer.adapter_format == "peft"
    trainer.save_model(str(tmp_path / "adapter"))
    card = ModelCard.load(tmp_path / "adapter" / "README.md")
    assert card.data.to_dict()["privacy"]["unit"] == "conversation"
    assert "one training conversation" in card.text and "trl.SFTTrainer" in card.text

    reloaded = PeftModel.from_pretrained(tiny.llama(), str(tmp_path / "adapter")).eval()
    trained = trainer.model.eval()
    prompt = tiny.chat_tokenizer().apply_chat_template(
        [{"role": "user", "content": "the movie was"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**prompt).logits, trained(**prompt).logits)
        generated = reloaded.generate(**prompt, min_new_tokens=4, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 4


# ---------------------------------------------------------------------- the family (its refusals: test_preflight.py)
def test_the_family_is_found_by_class_and_knows_its_own_overrides():
    family = family_of(PrivateSFTTrainer)
    assert family.name == "trl.SFTTrainer" and family.owns(SFTTrainer)
    assert {"training_step", "compute_loss"} <= set(family.compatible_overrides)
    user = privatize(type("MySFT", (SFTTrainer,), {"training_step": lambda self, *a, **k: None}))
    assert family_of(user) is family and not family.owns(user.__mro__[2])


# ---------------------------------------------------------------------- sensitivity through the public API
def _pc(prompt: int, completion: int, offset: int = 0) -> dict:
    """A prompt-completion row with `prompt` and `completion` words (the completion trained, the prompt masked)."""
    words = list(NEUTRAL) + list(POSITIVE) + list(NEGATIVE)
    return {
        "prompt": " ".join(words[(offset + i) % len(words)] for i in range(prompt)),
        "completion": " " + " ".join(words[(offset + 3 * i + 1) % len(words)] for i in range(completion)),
    }


SHORT = [_pc(1, 1, i) for i in range(6)]  # short sequences, one trained word each
LONG = [_pc(8, 12 - i, 5 * i) for i in range(6)]  # long prompts and completions of different lengths
ADDED = _pc(2, 24, 7)  # the example added: many trained tokens


def batch_normalised_loss(model, outputs, labels):
    """TRL's training normalisation put back: each sequence's token losses over the trained tokens of its batch."""
    logits, labels = outputs.logits[:, :-1].float(), labels[:, 1:]
    tokens = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return tokens.sum(1) / (labels != IGNORE_INDEX).sum()


def released_sum(tmp_path, rows: list[dict], clip: float, loss=None, **config) -> torch.Tensor:
    """Σ of the clipped per-example gradients plus the replayed noise, read off one SGD step at q = 1."""
    model = tiny.llama()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    trainer = sft_trainer(
        tmp_path,
        Dataset.from_list(rows),
        model=model,
        per_example_loss=loss,
        dp=DPConfig(noise_multiplier=0.2, max_grad_norm=clip, noise_seed=SEED),
        per_device_train_batch_size=len(rows),
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        **config,
    )
    assert trainer.sample_rate == 1.0
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double()
    return (before - after) * len(rows)


def sensitivity(tmp_path, rows: list[dict], clip: float, loss=None, **config) -> float:
    """‖released sum with ADDED − without‖: the noise is the same in both, so it cancels."""
    return float(
        (
            released_sum(tmp_path / "with", [*rows, ADDED], clip, loss, **config)
            - released_sum(tmp_path / "without", rows, clip, loss, **config)
        ).norm()
    )


def contributions(tmp_path, clip: float, loss=None) -> list[torch.Tensor]:
    """ADDED's contribution to the released sum, next to short batch-mates and next to long ones."""
    return [
        released_sum(tmp_path / f"{name}+", [*mates, ADDED], clip, loss)
        - released_sum(tmp_path / name, mates, clip, loss)
        for name, mates in (("short", SHORT), ("long", LONG))
    ]


# ADDED's own-mean gradient has norm ≈ 1.7 (the bound is then tight); the short ones ≈ 7, the long ones ≈ 2.5.
CLIP = 1.0


def test_adding_one_example_moves_the_released_sum_by_at_most_C(tmp_path):
    for mates in (SHORT, LONG, SHORT + LONG):
        assert sensitivity(tmp_path, mates, CLIP) <= CLIP * (1 + 1e-4)


def test_the_sensitivity_test_fails_when_the_batch_normalisation_is_put_back(tmp_path, monkeypatch):
    """Short batch-mates: the long example added dilutes their (aligned) contributions by the batch's token count.
    The independence probe refuses such a loss on the first chunk; switched off, the bound is what catches it."""
    with pytest.raises(ValueError, match="its gradient depends on the other examples"):
        sensitivity(tmp_path / "probed", SHORT, CLIP, batch_normalised_loss)
    monkeypatch.setattr(hf_private.trainer.mixin, "probe_example_independence", lambda *args, **kwargs: None)
    assert sensitivity(tmp_path, SHORT, CLIP, batch_normalised_loss) > 1.5 * CLIP


def test_the_sensitivity_test_fails_without_the_per_example_clip(tmp_path, monkeypatch):
    """Each example's own-mean loss, but nothing clipped (the noise still at σ·C): the added example moves the sum
    by its own gradient's norm, ≈ 1.7·C. (One row is one unit in SFT, so the row's clip is the unit's clip.)"""
    original = FlatL2ClipReducer.__init__
    monkeypatch.setattr(FlatL2ClipReducer, "__init__", lambda self, max_grad_norm: original(self, float("inf")))
    assert sensitivity(tmp_path, SHORT, CLIP) > 1.5 * CLIP


# Above every per-example gradient norm here (≤ 8): nothing is clipped, so a batch-level normalisation shows as more
# than a scale.
HUGE = 20.0


def test_an_examples_contribution_does_not_depend_on_its_batch_mates(tmp_path):
    next_to_short, next_to_long = contributions(tmp_path, HUGE)
    assert next_to_short.norm() > 0
    torch.testing.assert_close(next_to_short, next_to_long, rtol=0, atol=1e-3 * float(next_to_short.norm()))


def test_the_independence_test_fails_when_the_batch_normalisation_is_put_back(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_private.trainer.mixin, "probe_example_independence", lambda *args, **kwargs: None)
    next_to_short, next_to_long = contributions(tmp_path, HUGE, batch_normalised_loss)
    assert float((next_to_short - next_to_long).norm()) > 0.1 * float(next_to_short.norm())


# ---------------------------------------------------------------------- packed evaluation sets: held out or not
PACKED = dict(max_length=56, per_device_train_batch_size=4, max_steps=1)  # 5 to 7 of the 24 sequences a packed row


def packed_eval_trainer(tmp_path, eval_dataset, **config):
    return sft_trainer(
        tmp_path, tiny.prompt_completions(24), trainer_kwargs={"eval_dataset": eval_dataset}, **{**PACKED, **config}
    )


def _card_text(trainer) -> str:
    trainer.save_model()
    return ModelCard.load(trainer.args.output_dir + "/README.md").text


def test_the_packed_training_set_evaluated_is_not_held_out(tmp_path):
    """packing=True packs the evaluation set too (several sequences a row, none equal to a training sequence): its
    sequences are compared one by one, so the training set evaluated is found, and its metrics are withheld."""
    trainer = packed_eval_trainer(tmp_path, tiny.prompt_completions(24), packing=True)
    assert min(map(len, trainer.eval_dataset["seq_lengths"])) > 1, "no packed row is one sequence alone"
    found = trainer._evaluations.training_rows.overlap(trainer.eval_dataset, "eval")
    assert (found.shared, found.units, found.verdict) == (24, 24, OVERLAPS)
    metrics = trainer.evaluate()
    assert trainer._evaluations.results["eval"][0] == OVERLAPS
    text = _card_text(trainer)
    assert "On held-out data" not in text and "`eval` was evaluated on data overlapping the training data" in text
    assert not any(key in text for key in metrics if key.startswith("eval_"))


def test_mutation_packed_evaluation_rows_compared_whole_are_called_held_out(tmp_path, monkeypatch):
    """The check as it was: each packed evaluation row one unit. Then no row repeats a training sequence."""
    monkeypatch.setattr(row_identity, "_packed_runs", lambda tokens, *args: [list(range(len(tokens)))])
    trainer = packed_eval_trainer(tmp_path, tiny.prompt_completions(24), packing=True)
    assert trainer._evaluations.training_rows.overlap(trainer.eval_dataset, "eval").verdict == HELD_OUT


def test_a_disjoint_packed_evaluation_set_is_held_out(tmp_path):
    dev = Dataset.from_list([_pc(3, 2, 40 + 7 * i) for i in range(16)])
    train = tiny.prompt_completions(24)
    assert not {(row["prompt"], row["completion"]) for row in dev} & set(zip(train["prompt"], train["completion"]))
    trainer = packed_eval_trainer(tmp_path, dev, packing=True)
    assert max(map(len, trainer.eval_dataset["seq_lengths"])) > 1
    loss = trainer.evaluate()["eval_loss"]
    assert trainer._evaluations.results["eval"][0] == HELD_OUT
    assert f"| eval_loss | {round(loss, 4)} |" in _card_text(trainer)


def test_evaluation_rows_packed_across_sequences_are_unknown(tmp_path, caplog):
    """eval_packing with 'wrapped' (allowed: training is not packed) cuts sequences across rows: nothing in a row
    says where a sequence starts, so no verdict of held-out is possible and nothing is published as one."""
    dev = Dataset.from_list([_pc(3, 2, 40 + 7 * i) for i in range(16)])
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        trainer = packed_eval_trainer(tmp_path, dev, eval_packing=True, packing_strategy="wrapped")
    assert "packing_strategy='wrapped'" in caplog.text and "could not be checked" in caplog.text
    metrics = trainer.evaluate()
    assert trainer._evaluations.results["eval"][0] == UNKNOWN
    text = _card_text(trainer)
    assert "On held-out data" not in text and "`eval` was evaluated on data that could not be checked" in text
    assert not any(key in text for key in metrics if key.startswith("eval_"))


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_set_passed_to_evaluate_is_judged_as_trl_prepares_it(tmp_path, packing, monkeypatch, caplog):
    """SFTTrainer.evaluate(dataset) tokenizes the set, appends an EOS to each completion and packs it: the check reads
    the set so prepared, where the dataloader is built. The training set as passed repeats no prepared training row
    (its completions lack the EOS; packed, it shares no column): compared as passed, it was called held-out."""
    train = tiny.prompt_completions(24)
    trainer = sft_trainer(tmp_path, train, packing=packing, **PACKED)
    as_passed = trainer._evaluations.training_rows.overlap(train, "as passed").verdict
    assert as_passed == (UNKNOWN if packing else HELD_OUT)
    trainer.evaluate(train)
    assert trainer._evaluations.results["eval"][0] == OVERLAPS
    # a subclass whose get_eval_dataloader skips the check: the set evaluated is not known, never held-out
    monkeypatch.setattr(PrivateSFTTrainer, "get_eval_dataloader", SFTTrainer.get_eval_dataloader)
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        trainer.evaluate(Dataset.from_list([_pc(3, 2, 40 + 7 * i) for i in range(16)]))
    assert trainer._evaluations.results["eval"][0] == UNKNOWN and "read no set" in caplog.text


# ---------------------------------------------------------------------- the docs' script
def test_docs_sft_script_runs_as_written(tmp_path, monkeypatch, capsys):
    """The python block under "DP SFT with TRL", executed unchanged: a LoRA adapter trained privately on
    prompt-completion pairs, saved with a card naming the unit, the trainer and ε."""
    namespace = run_doc_block("guides/sft.md", tmp_path, monkeypatch)

    assert "prompt-completion pair" in capsys.readouterr().out
    report = namespace["trainer"].privacy_report()
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] <= 8.0
    card = ModelCard.load(tmp_path / "out-sft" / "README.md")
    assert card.data.to_dict()["privacy"]["epsilon"] == pytest.approx(report["epsilon"])
    assert "one training prompt-completion pair" in card.text and "trl.SFTTrainer" in card.text
    assert (tmp_path / "out-sft" / "adapter_model.safetensors").is_file()
