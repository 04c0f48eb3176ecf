"""Building PrivateTrainers on tiny models for tests."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, TrainerCallback, TrainingArguments

from hf_private import DPConfig, PrivateTrainer
from tests.support import tiny


def training_args(output_dir, **overrides) -> TrainingArguments:
    defaults = dict(
        per_device_train_batch_size=8,
        num_train_epochs=1,
        learning_rate=5e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return TrainingArguments(output_dir=str(output_dir), **{**defaults, **overrides})


# TRL configs (SFTConfig, DPOConfig) in tests: on CPU, nothing saved or reported; TRL's bf16 and activation
# checkpointing (on by default, both supported) off for speed: tests/trainer/test_activation_checkpointing.py trains
# with TRL's defaults
TRL_TEST_ARGS = dict(
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
    bf16=False,
    gradient_checkpointing=False,
    max_length=32,
)


class KillAtStep(TrainerCallback):
    """Interrupts training at the end of a step, as a crash or Ctrl-C would."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            raise KeyboardInterrupt("simulated kill")


def make_trainer(output_dir, model=None, dataset=None, dp=None, **arg_overrides) -> PrivateTrainer:
    model = model if model is not None else tiny.bert()
    dataset = dataset if dataset is not None else tiny.sentiment_dataset(96)
    dp = dp if dp is not None else DPConfig(noise_multiplier=1.0, max_grad_norm=1.0)
    tok = tiny.tokenizer()
    return PrivateTrainer(
        model=model,
        args=training_args(output_dir, **arg_overrides),
        train_dataset=dataset,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=dp,
    )


def make_lm_trainer(output_dir, model, dp, examples: int = 32, **arg_overrides) -> PrivateTrainer:
    """A causal LM trained on the tiny LM texts (labels from the LM collator)."""
    tok = tiny.tokenizer()
    return PrivateTrainer(
        model=model,
        args=training_args(output_dir, **arg_overrides),
        train_dataset=tiny.lm_dataset(examples),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        processing_class=tok,
        dp_config=dp,
    )


def snapshot(model) -> dict[str, torch.Tensor]:
    state = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return state


def eval_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits in eval mode (no dropout), for comparing a trained model with what was saved and reloaded."""
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def trainable_partitions(model) -> list[list[torch.nn.Parameter]]:
    """DP-FROST's partitions (`methods.frost.partitions.model_partitions`) as the magnitude reducer takes them: the
    trainable parameters of each, partitions without any dropped."""
    from hf_private.methods.frost.partitions import model_partitions

    params = dict(model.named_parameters())
    groups = [[params[n] for n in p.parameter_names if params[n].requires_grad] for p in model_partitions(model)]
    return [group for group in groups if group]


DOCS = Path(__file__).parents[2] / "docs"
#: a python block of a docs page, with its marker line (`<!-- doc-test: ... -->`: see tests/project/test_docs.py)
DOC_BLOCK = re.compile(r"^(?:<!-- doc-test: (?P<marker>[^\n]*?) -->\n)?```python\n(?P<source>.*?)^```$", re.S | re.M)


def doc_blocks(page: str) -> list[re.Match]:
    """The python blocks of a docs page (e.g. "guides/sft.md"), in order, each with its doc-test marker."""
    return list(DOC_BLOCK.finditer((DOCS / page).read_text()))


def doc_block(page: str, index: int = 0) -> str:
    """The source of a docs page's `index`-th python block, as written."""
    return doc_blocks(page)[index]["source"]


def run_doc_block(page: str, tmp_path, monkeypatch, index: int = 0) -> dict:
    """A docs page's python block executed unchanged in `tmp_path`, as a user who pastes it would: its namespace."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(doc_block(page, index), f"docs/{page} (block {index})", "exec"), namespace)
    return namespace
