"""Every refusal made when a private trainer is built (hf_private/trainer/preflight.py), one row each.

A row is (id, how to build the bad setting, expected exception, a fragment of its message). The build gets
`tmp_path` and `monkeypatch` and builds a private trainer on the tiny BERT and the demo task (`_build`), changing only
what the row is about. What must still be accepted next to a refusal is in `ACCEPTED`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
import transformers.trainer
from datasets import Dataset
from torch.utils.data import DataLoader, IterableDataset, WeightedRandomSampler
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import hf_private.data.chunks
import hf_private.trainer.mixin as trainer_module
import hf_private.trainer.step_boundaries as step_boundaries
from hf_private import BitFitConfig, DPConfig, DPFPConfig, PrivateTrainer, privatize
from hf_private.data.sampling import PoissonBatchSampler
from hf_private.integrations.trl_dpo import PAIR_LOSSES
from hf_private.trainer import preflight
from hf_private.trainer.preflight import _PRIVATE_PATH_METHODS
from tests.support import tiny
from tests.support.helpers import training_args

N = 96  # examples of the default training set
# Methods on the private training path (Trainer's, then the private mixin's own): a user's override of any of them is
# refused, in whatever class of the MRO it sits
GUARDED = (
    "training_step",
    "get_train_dataloader",
    "_get_train_sampler",
    "create_optimizer",
    "floating_point_ops",
    "training_data",
    "poisson_chunks",
    "record_chunks",
    "_chunk_step",
    "_training_loss",
    "summed_loss",
    "_probe_example_independence",
)
_DEFAULT = object()


def _build(
    tmp_path,
    cls: type[Trainer] = PrivateTrainer,
    *,
    model: Any = _DEFAULT,
    dataset: Any = _DEFAULT,
    dp: Any = None,
    args: Any = _DEFAULT,
    **trainer_kwargs: Any,
) -> Trainer:
    """A private trainer of class `cls`; `args` is a dict of overrides of tests.support.helpers.training_args, the
    arguments
    themselves, or None (Trainer makes its default ones)."""
    args = {} if args is _DEFAULT else args
    tok = tiny.tokenizer()
    return cls(
        tiny.bert() if model is _DEFAULT else model,
        training_args(tmp_path, **args) if isinstance(args, dict) else args,
        train_dataset=tiny.sentiment_dataset(N) if dataset is _DEFAULT else dataset,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0) if dp is None else dp,
        **trainer_kwargs,
    )


def _per_example_loss(model, outputs, labels):
    return F.cross_entropy(outputs.logits, labels, reduction="none")


def _override(self, *args, **kwargs):
    raise AssertionError("a refused override is never called")


def _user_trainer(name: str) -> type[Trainer]:
    """A user's Trainer subclass overriding `name`, made private by privatize()."""
    return privatize(type("UserTrainer", (Trainer,), {name: _override}))


def _private_subclass(name: str) -> type[Trainer]:
    """A subclass of PrivateTrainer overriding `name`."""
    return type("SubclassedPrivateTrainer", (PrivateTrainer,), {name: _override})


def _user_mixin(name: str) -> type:
    """A plain mixin (not a Trainer) overriding `name`."""
    return type("UserMixin", (), {name: _override})


def _mixed_in_first(name: str) -> type[Trainer]:
    """`class MixedPrivateTrainer(UserMixin, PrivateTrainer)`: the mixin's `name` comes before the private one."""
    return type("MixedPrivateTrainer", (_user_mixin(name), PrivateTrainer), {})


class _PatchesInInit(Trainer):
    """A user's Trainer whose __init__ sets compute_loss on the instance, after the class was checked."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.compute_loss = _override


# ---------------------------------------------------------------------- bad settings built by the rows
class _Stream(IterableDataset):
    def __iter__(self):
        yield from tiny.sentiment_dataset(8)


def _with_float_label(value: float) -> Dataset:
    data = tiny.sentiment_dataset(16).to_dict()
    data["label"] = [float(x) for x in data["label"]]
    data["label"][3] = value
    return Dataset.from_dict(data)


def _string_labels() -> Dataset:
    return tiny.sentiment_dataset(N).map(lambda row: {"label": ("negative", "positive")[row["label"]]})


def _sentences(n: int) -> Dataset:
    return tiny.texts(n).rename_column("text", "sentence")


def _items_with_float_label(value: float) -> list[dict]:
    return [{**row, "labels": torch.tensor(row["label"])} for row in _with_float_label(value)]


def _bert_with_batch_norm():
    model = tiny.bert()
    model.classifier = torch.nn.Sequential(torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 2))
    return model


def _split_over_devices():
    model = tiny.bert()
    model.hf_device_map = {"bert.embeddings": 0, "bert.encoder": 1, "classifier": 1}  # as device_map="auto" sets it
    return model


def _sharded_at_load():
    model = tiny.bert()
    model._is_distributed_loading_by_transformers = True  # as from_pretrained(distributed_config=...) sets it
    return model


def _scheduler():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _several_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    _build(tmp_path)


def _trainer_flag(flag: str) -> Callable:
    """Neither FSDP nor DeepSpeed can start on a CPU machine, so switch on Trainer's own flag for it."""

    def build(tmp_path, monkeypatch):
        set_up = Trainer.create_accelerator_and_postprocess

        def with_flag(self):
            set_up(self)
            setattr(self, flag, True)

        monkeypatch.setattr(Trainer, "create_accelerator_and_postprocess", with_flag)
        _build(tmp_path)

    return build


def _default_arguments(tmp_path, monkeypatch):
    """args=None: Trainer makes its default TrainingArguments, checked once Trainer is built."""
    monkeypatch.setattr(
        transformers.trainer,
        "TrainingArguments",
        lambda output_dir: training_args(tmp_path, train_sampling_strategy="sequential"),
    )
    _build(tmp_path, args=None)


def _sft(
    dp: Any = None, model: Callable = tiny.llama, dataset: Callable = tiny.conversations, **config: Any
) -> Callable:
    """A row's build: privatize(trl.SFTTrainer) on the tiny Llama and 16 conversations (or `dataset(16)`), `config`
    in its SFTConfig (`peft_config` and `formatting_func`, made `Fresh`, go to the trainer)."""

    def build(tmp_path, monkeypatch):
        import trl  # the test extra installs it: a missing trl fails here, it is never skipped

        keywords = {k: config.pop(k).make() for k in ("peft_config", "formatting_func") if k in config}
        defaults = dict(report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no")
        args = trl.SFTConfig(str(tmp_path), **{**defaults, **config})
        return privatize(trl.SFTTrainer)(
            model(),
            args,
            train_dataset=dataset(16),
            processing_class=tiny.chat_tokenizer(),
            dp_config=dp or DPConfig(noise_multiplier=1.0),
            **keywords,
        )

    return build


def _tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=tiny.VOCAB_SIZE,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=2,
            num_experts_per_tok=1,
        )
    )


def _users_dp(config_class: type = DPConfig, **fields: Any) -> Any:
    return config_class(noise_multiplier=1.0, privacy_unit="user", user_column="user_id", **fields)


def _users_dataset():
    return tiny.sentiment_dataset(N).add_column("user_id", [i % 10 for i in range(N)])


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


SFT = "is not supported by private trl.SFTTrainer training: "


def _dpo(
    dp: Any = None, per_example_loss: Any = None, dataset: Callable = tiny.preference_pairs, **config: Any
) -> Callable:
    """A row's build: privatize(trl.DPOTrainer) on the tiny Llama (its reference: a second one) and preference
    pairs, `config` in its DPOConfig."""

    def build(tmp_path, monkeypatch):
        import trl

        keywords = {k: config.pop(k).make() for k in ("peft_config",) if k in config}
        if per_example_loss is not None:
            keywords["per_example_loss"] = per_example_loss
        defaults = dict(report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no")
        args = trl.DPOConfig(str(tmp_path), **{**defaults, **config})
        train = dataset() if dataset is not tiny.preference_pairs else dataset(16)
        return privatize(trl.DPOTrainer)(
            tiny.llama(),
            tiny.llama(),
            args,
            train_dataset=train,
            processing_class=tiny.chat_tokenizer(),
            dp_config=dp or DPConfig(noise_multiplier=1.0),
            **keywords,
        )

    return build


DPO = "is not supported by private trl.DPOTrainer training: "


class Row(NamedTuple):
    id: str
    build: Callable[[Any, pytest.MonkeyPatch], Any]  # (tmp_path, monkeypatch): builds the trainer
    error: type[Exception]
    fragment: str


class Fresh(NamedTuple):
    """A keyword of `_build` made when the row runs (a model, a dataset), not when the table is collected."""

    make: Callable[[], Any]


def _row(id: str, error: type[Exception], fragment: str, **build: Any) -> Row:
    """A row whose build is `_build(tmp_path, **build)`, `Fresh` keywords made then."""

    def run(tmp_path, monkeypatch):
        return _build(tmp_path, **{k: v.make() if isinstance(v, Fresh) else v for k, v in build.items()})

    return Row(id, run, error, fragment)


PARALLELISM = (
    "hf_private supports one process per device (DDP through `accelerate launch --multi_gpu "
    "--num_processes N`, or torchrun), each holding the whole model, and FSDP2 (`accelerate launch --use_fsdp "
    "--fsdp_version 2`, or TrainingArguments(fsdp=True, fsdp_config={'fsdp_version': 2}))."
)

ROWS = [
    # ------------------------------------------------------------------ trainer class and keywords
    _row(
        "dp-config-not-a-method-config",
        TypeError,
        "dp_config must be a DPConfig (or a method config), got dict.",
        dp={"noise_multiplier": 1.0},
    ),
    *[
        _row(
            f"privatize-overrides-{name}",
            TypeError,
            f"UserTrainer overrides {name}(), which private training needs",
            cls=_user_trainer(name),
        )
        for name in GUARDED
    ],
    *[
        _row(
            f"subclass-overrides-{name}",
            TypeError,
            f"SubclassedPrivateTrainer overrides {name}(), which private training needs",
            cls=_private_subclass(name),
        )
        for name in GUARDED
    ],
    _row(
        "privatize-overrides-compute_loss-without-per_example_loss",
        TypeError,
        "UserTrainer overrides compute_loss(), which private training replaces by a per-example loss",
        cls=_user_trainer("compute_loss"),
    ),
    _row(
        "subclass-overrides-compute_loss-without-per_example_loss",
        TypeError,
        "SubclassedPrivateTrainer overrides compute_loss(), which private training replaces by a per-example loss",
        cls=_private_subclass("compute_loss"),
    ),
    *[
        _row(
            f"mixin-first-overrides-{name}",
            TypeError,
            f"UserMixin overrides {name}(), which private training needs",
            cls=_mixed_in_first(name),
        )
        for name in GUARDED
    ],
    _row(
        "mixin-first-overrides-compute_loss-without-per_example_loss",
        TypeError,
        "UserMixin overrides compute_loss(), which private training replaces by a per-example loss",
        cls=_mixed_in_first("compute_loss"),
    ),
    _row(
        "privatize-mixin-overrides-compute_loss-without-per_example_loss",
        TypeError,
        "UserMixin overrides compute_loss(), which private training replaces by a per-example loss",
        cls=privatize(type("UserTrainer", (_user_mixin("compute_loss"), Trainer), {})),
    ),
    _row(
        "init-sets-compute_loss-on-the-instance",
        TypeError,
        "compute_loss() is patched on the trainer instance (now tests.trainer.test_preflight._override), after "
        "Private_PatchesInInit was checked",
        cls=privatize(_PatchesInInit),
    ),
    _row(
        "compute_loss_func",
        ValueError,
        "compute_loss_func is not supported: Trainer calls it with the whole batch",
        compute_loss_func=lambda outputs, labels, **kw: outputs.loss,
    ),
    _row(
        "optimizers-with-an-optimizer",
        ValueError,
        "Pass optimizer_cls_and_kwargs=(torch.optim.AdamW, {...})",
        optimizers=Fresh(lambda: (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), None)),
    ),
    _row(
        "optimizers-with-a-scheduler",
        ValueError,
        "optimizers=(optimizer, scheduler) is not supported",
        optimizers=Fresh(lambda: (None, _scheduler())),
    ),
    _row(
        "model_init",
        ValueError,
        "model_init (hyperparameter search) is not supported: pass the model itself.",
        model_init=tiny.bert,
    ),
    # ------------------------------------------------------------------ TrainingArguments
    _row(
        "fp16",
        ValueError,
        "fp16 with a GradScaler rescales gradients before clipping; use bf16=True or fp32.",
        args=dict(fp16=True),
    ),
    _row("torch_compile", ValueError, "torch_compile=True is not supported", args=dict(torch_compile=True)),
    *[
        _row(
            f"train_sampling_strategy-{strategy}",
            ValueError,
            f"train_sampling_strategy='{strategy}' is not supported: the privacy guarantee assumes every logical "
            "batch is a Poisson sample",
            args=dict(train_sampling_strategy=strategy),
        )
        for strategy in ("sequential", "batch_rebalance")
    ],
    Row(
        "predict_with_generate-without-Seq2SeqTrainer",
        lambda tmp_path, monkeypatch: PrivateTrainer(
            tiny.gpt2(),
            Seq2SeqTrainingArguments(
                output_dir=str(tmp_path), predict_with_generate=True, use_cpu=True, report_to="none"
            ),
            train_dataset=tiny.lm_dataset(32),
            dp_config=DPConfig(noise_multiplier=1.0),
        ),
        ValueError,
        "predict_with_generate is a Seq2SeqTrainer setting that PrivateTrainer would ignore",
    ),
    _row(
        "label_smoothing-with-per_example_loss",
        ValueError,
        "label_smoothing_factor=0.1 is applied by the default per-example loss only; with your own per_example_loss, "
        "smooth the labels inside it",
        args=dict(label_smoothing_factor=0.1),
        per_example_loss=_per_example_loss,
    ),
    Row(
        "default-arguments-made-by-Trainer",
        _default_arguments,
        ValueError,
        "train_sampling_strategy='sequential' is not supported",
    ),
    # ------------------------------------------------------------------ TRL SFTConfig (hf_private.integrations.trl_sft)
    Row(
        "sft-packing-wrapped",
        _sft(packing=True, packing_strategy="wrapped", max_length=16),
        ValueError,
        f"packing_strategy='wrapped' {SFT}'bfd_split' and 'wrapped' split a sequence over packed rows",
    ),
    Row(
        "sft-packing-bfd_split",
        _sft(packing=True, packing_strategy="bfd_split", max_length=16),
        ValueError,
        f"packing_strategy='bfd_split' {SFT}'bfd_split' and 'wrapped' split a sequence over packed rows",
    ),
    Row(
        "sft-use_liger_kernel",
        _sft(use_liger_kernel=True),
        ValueError,
        f"use_liger_kernel=True {SFT}Liger kernels replace the model's layers",
    ),
    Row("sft-loss_type-dft", _sft(loss_type="dft"), ValueError, f"loss_type='dft' {SFT}only loss_type='nll'"),
    Row(
        "sft-activation_offloading",
        _sft(activation_offloading=True),
        ValueError,
        f"activation_offloading=True {SFT}offloading repacks the tensors saved for backward",
    ),
    Row(
        "sft-moe-router_aux_loss",
        _sft(model=_tiny_mixtral),
        ValueError,
        f"router_aux_loss_coef=None {SFT}the Mixture-of-Experts load-balancing loss",
    ),
    Row(
        "sft-no-column-it-prepares-from",
        _sft(dataset=_sentences),
        ValueError,
        "train_dataset has columns ['sentence'], none of which SFTTrainer prepares from: a text column 'text' "
        "(SFTConfig.dataset_text_field), 'messages' (conversations), 'prompt' with 'completion', or tokenized "
        "'input_ids'. Rename your text column (train_dataset.rename_column(name, 'text'))",
    ),
    Row(
        "sft-prompt-without-completion",
        _sft(dataset=lambda n: tiny.prompt_completions(n).remove_columns("completion")),
        ValueError,
        "train_dataset has columns ['prompt']: SFTTrainer reads a 'prompt' column as a "
        "prompt-completion dataset, and the 'completion' column is missing.",
    ),
    # ------------------------------------------------------------------ TRL DPOConfig (hf_private.integrations.trl_dpo)
    Row(
        "dpo-loss_type-aot",
        _dpo(loss_type="aot"),
        ValueError,
        f"loss_type=['aot'] {DPO}'aot': it sorts the batch's log-ratios",
    ),
    Row(
        "dpo-loss_type-aot_unpaired-among-others",
        _dpo(loss_type=["sigmoid", "aot_unpaired"]),
        ValueError,
        f"loss_type=['sigmoid', 'aot_unpaired'] {DPO}",
    ),
    Row(
        "dpo-padding_free",
        _dpo(padding_free=True),
        ValueError,
        f"padding_free=True {DPO}padding_free flattens the pairs' chosen and rejected rows into one",
    ),
    Row(
        "dpo-use_liger_kernel",
        _dpo(use_liger_kernel=True),
        ValueError,
        f"use_liger_kernel=True {DPO}Liger kernels replace the model's layers",
    ),
    Row(
        "dpo-activation_offloading",
        _dpo(activation_offloading=True),
        ValueError,
        f"activation_offloading=True {DPO}offloading repacks",
    ),
    Row(
        "dpo-per_example_loss",
        _dpo(per_example_loss=lambda model, outputs, labels: outputs.logits.sum((1, 2))),
        ValueError,
        "per_example_loss is not supported by private trl.DPOTrainer training",
    ),
    # ------------------------------------------------------------------ user level (hf_private.data.users)
    _row(
        "user-column-missing", ValueError, "user_column='user_id' is not a column of the training set", dp=_users_dp()
    ),
    _row(
        "user-missing-for-some-examples",
        ValueError,
        "2 training examples have no user in column 'user_id'",
        dp=_users_dp(),
        dataset=Fresh(
            lambda: tiny.sentiment_dataset(N).add_column(
                "user_id", [None if i in (3, 40) else i % 10 for i in range(N)]
            )
        ),
    ),
    _row(
        "user-level-dpfp-paper-mode",
        ValueError,
        "DPFPConfig as configured has no formal guarantee (stages ['dp-fp']), for a record or a user",
        dp=_users_dp(DPFPConfig, mode="paper"),
    ),
    _row(
        "user-level-group_by_length",
        ValueError,
        "train_sampling_strategy='group_by_length' is not supported at privacy_unit='user'",
        dp=_users_dp(),
        dataset=Fresh(_users_dataset),
        args={"train_sampling_strategy": "group_by_length"},
    ),
    Row(
        "dpo-vision-preference-data",
        _dpo(dataset=lambda: tiny.preference_pairs(16).add_column("images", [[]] * 16)),
        ValueError,
        "train_dataset is not supported with DPConfig: a vision-language preference dataset",
    ),
    Row(
        "dpo-peft_config-with-a-method-choosing-what-trains",
        _dpo(dp=BitFitConfig(noise_multiplier=1.0), peft_config=Fresh(_lora)),
        ValueError,
        "peft_config is not supported with BitFitConfig",
    ),
    Row(
        "sft-peft_config-with-a-method-choosing-what-trains",
        _sft(dp=BitFitConfig(noise_multiplier=1.0), peft_config=Fresh(_lora)),
        ValueError,
        "peft_config is not supported with BitFitConfig: peft_config lets TRL choose what trains",
    ),
    # ------------------------------------------------------------------ model
    _row("model-given-by-name", ValueError, "Pass the model itself, not its name 'some/model'", model="some/model"),
    _row(
        "no-model",
        ValueError,
        "PrivateTrainer needs a model; model_init (hyperparameter search) is not supported.",
        model=None,
    ),
    _row(
        "DataParallel-wrapper",
        ValueError,
        f"Pass the model itself, not a DataParallel wrapper: Trainer wraps it for DDP and PrivateTrainer reduces the "
        f"clipped gradients itself. {PARALLELISM}",
        model=Fresh(lambda: torch.nn.DataParallel(tiny.bert())),
    ),
    _row(
        "BatchNorm",
        ValueError,
        "BatchNorm layers ['classifier.0'] mix examples in train mode",
        model=Fresh(_bert_with_batch_norm),
    ),
    # ------------------------------------------------------------------ dataset and labels
    _row(
        "no-train_dataset",
        ValueError,
        "PrivateTrainer needs train_dataset: its size N sets the sampling rate and δ.",
        dataset=None,
    ),
    _row("IterableDataset", ValueError, "IterableDataset has no known size", dataset=Fresh(_Stream)),
    _row(
        "empty-train_dataset",
        ValueError,
        "train_dataset is empty.",
        dataset=Fresh(lambda: Dataset.from_dict({"input_ids": [], "attention_mask": [], "label": []})),
    ),
    *[
        _row(
            f"{name}-label-in-an-arrow-column",
            ValueError,
            "train_dataset has non-finite float labels (NaN or inf): 1 in column 'label'.",
            model=Fresh(lambda: tiny.bert(num_labels=1)),
            dataset=Fresh(partial(_with_float_label, value)),
        )
        for name, value in (("nan", float("nan")), ("inf", float("inf")))
    ],
    *[
        _row(
            f"{name}-label-in-dataset-items",
            ValueError,
            "train_dataset has non-finite float labels (NaN or inf): 1 in column 'labels'",
            model=Fresh(lambda: tiny.bert(num_labels=1)),
            dataset=Fresh(partial(_items_with_float_label, value)),
        )
        for name, value in (("nan", float("nan")), ("inf", float("inf")))
    ],
    _row(
        "labels-under-another-column",
        ValueError,
        "train_dataset has columns ['input_ids', 'attention_mask', 'sentiment'], and a collated training batch has no "
        "'labels' entry (keys ['attention_mask', 'input_ids'])",
        dataset=Fresh(lambda: tiny.sentiment_dataset(N).rename_column("label", "sentiment")),
    ),
    _row(
        "string-labels",
        ValueError,
        "train_dataset's label column 'label' holds strings (2 distinct values): labels "
        "must be integer class ids (float values for regression). Map them before training (the distinct values in "
        "sorted order): label2id = {'negative': 0, 'positive': 1}",
        dataset=Fresh(_string_labels),
    ),
    _row(
        "causal-LM-without-a-collator-that-makes-labels",
        ValueError,
        "A causal LM learns from its input_ids: use a "
        "collator that makes the labels from them, e.g. data_collator=DataCollatorForLanguageModeling(tokenizer, "
        "mlm=False).",
        model=Fresh(tiny.gpt2),
        dataset=Fresh(lambda: tiny.lm_dataset(N)),
    ),
    _row(
        "delta-not-below-one-over-N",
        ValueError,
        f"target_delta={1 / N:g} is not below 1/N",
        dp=DPConfig(target_epsilon=1.0, target_delta=1 / N),
    ),
    # ------------------------------------------------------------------ release settings
    *[
        _row(
            f"include_num_input_tokens_seen-{setting}",
            ValueError,
            f"include_num_input_tokens_seen={read!r}: the token count of each Poisson batch is an un-noised "
            "function of the private data",
            args=dict(include_num_input_tokens_seen=setting),
        )
        for setting, read in (("all", "all"), ("non_padding", "non_padding"), (True, "all"))
    ],
    # refused before Trainer would create the Hub repo (the tests are offline)
    *[
        _row(
            f"push-hub_strategy-{strategy}",
            ValueError,
            f"hub_strategy='{strategy}' uploads whole checkpoints",
            args=dict(push_to_hub=True, hub_model_id="me/x", hub_strategy=strategy),
        )
        for strategy in ("checkpoint", "all_checkpoints")
    ],
    # ------------------------------------------------------------------ parallelism and launch (the built Trainer)
    Row(
        "several-GPUs-in-one-process",
        _several_gpus,
        ValueError,
        f"torch DataParallel (several GPUs in one process) is not supported: {PARALLELISM}",
    ),
    Row(
        "is_deepspeed_enabled",
        _trainer_flag("is_deepspeed_enabled"),
        ValueError,
        f"DeepSpeed ZeRO shards gradients before a flat per-example clip is possible: {PARALLELISM}",
    ),
    Row("is_fsdp_enabled-without-fsdp2", _trainer_flag("is_fsdp_enabled"), ValueError, "FSDP1 is not supported"),
    _row(
        "fsdp1-arguments",
        ValueError,
        "FSDP1 is not supported: the clipped sums are reduce-scattered to FSDP2 shards.",
        args={"fsdp": True, "fsdp_config": {"fsdp_version": 1}},
    ),
    _row(
        "fsdp2-with-activation-checkpointing-asked-twice",
        ValueError,
        "Activation checkpointing is asked for twice: fsdp_config['activation_checkpointing'] (FSDP's own) and",
        args={
            "fsdp": True,
            "fsdp_config": {"fsdp_version": 2, "activation_checkpointing": True},
            "gradient_checkpointing": True,
        },
    ),
    _row(
        "fsdp2-on-one-process",
        ValueError,
        "FSDP2 with one process shards nothing",
        args={"fsdp": True, "fsdp_config": {"fsdp_version": 2}},
    ),
    _row(
        "model-split-over-devices",
        ValueError,
        f"Model or tensor parallelism (one model split over several devices) is not supported: {PARALLELISM}",
        model=Fresh(_split_over_devices),
    ),
    _row("model-sharded-at-load", ValueError, "Model or tensor parallelism", model=Fresh(_sharded_at_load)),
    _row(
        "expected-batch-exceeds-N",
        ValueError,
        f"Expected logical batch 104 (per_device_train_batch_size × gradient_accumulation_steps × world_size) "
        f"exceeds the dataset size {N}.",
        args=dict(per_device_train_batch_size=8, gradient_accumulation_steps=13),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_refused_at_construction(row: Row, tmp_path, monkeypatch):
    with pytest.raises(row.error) as refused:
        row.build(tmp_path, monkeypatch)
    assert type(refused.value) is row.error and row.fragment in str(refused.value)


def test_every_row_has_its_own_id_and_every_guarded_method_its_rows():
    assert len({row.id for row in ROWS}) == len(ROWS)
    assert set(GUARDED) == set(_PRIVATE_PATH_METHODS)


# ---------------------------------------------------------------------- accepted next to a refusal
def _seq2seq_trainer(tmp_path):
    """privatize(Seq2SeqTrainer) honours predict_with_generate in its own evaluation."""
    tok = tiny.tokenizer()
    return privatize(Seq2SeqTrainer)(
        tiny.gpt2(),
        Seq2SeqTrainingArguments(
            output_dir=str(tmp_path), predict_with_generate=True, use_cpu=True, report_to="none", save_strategy="no"
        ),
        train_dataset=tiny.lm_dataset(32),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        processing_class=tok,
        dp_config=DPConfig(noise_multiplier=1.0),
    )


ACCEPTED = {
    "privatize-overrides-compute_loss-with-per_example_loss": lambda tmp_path: _build(
        tmp_path, _user_trainer("compute_loss"), per_example_loss=_per_example_loss
    ),
    "subclass-overrides-compute_loss-with-per_example_loss": lambda tmp_path: _build(
        tmp_path, _private_subclass("compute_loss"), per_example_loss=_per_example_loss
    ),
    "mixin-first-overrides-compute_loss-with-per_example_loss": lambda tmp_path: _build(
        tmp_path, _mixed_in_first("compute_loss"), per_example_loss=_per_example_loss
    ),
    "predict_with_generate-with-privatize(Seq2SeqTrainer)": _seq2seq_trainer,  # labels made by the LM collator
    "sft-peft_config-with-DPConfig": lambda tmp_path: _sft(peft_config=Fresh(_lora))(tmp_path, None),
    "sft-text-in-the-column-dataset_text_field-names": lambda tmp_path: _sft(
        dataset=_sentences, dataset_text_field="sentence"
    )(tmp_path, None),
    "sft-text-made-by-formatting_func": lambda tmp_path: _sft(
        dataset=_sentences, formatting_func=Fresh(lambda: lambda row: row["sentence"])
    )(tmp_path, None),
    "dpo-every-per-pair-loss-type": lambda tmp_path: _dpo(loss_type=list(PAIR_LOSSES), label_smoothing=0.1)(
        tmp_path, None
    ),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_at_construction(name, tmp_path):
    trainer = ACCEPTED[name](tmp_path)
    assert trainer.planned_steps > 0


# ---------------------------------------------------------------------- a mixin's sampler; methods patched later
class BalancedSamplingMixin:
    """A user's class-balancing loader in a plain mixin (not a Trainer): each label drawn equally often."""

    def get_train_dataloader(self) -> DataLoader:
        labels = torch.tensor(self.train_dataset["label"])
        weights = (1.0 / torch.bincount(labels).double())[labels]
        return DataLoader(
            self._remove_unused_columns(self.train_dataset),
            self.args.per_device_train_batch_size,
            sampler=WeightedRandomSampler(weights, len(labels)),
            collate_fn=self.data_collator,
        )


def _balanced_trainer(tmp_path) -> Trainer:
    return _build(tmp_path, type("BalancedTrainer", (BalancedSamplingMixin, PrivateTrainer), {}))


def test_a_mixin_whose_sampler_would_replace_poisson_sampling_is_refused(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"BalancedSamplingMixin overrides get_train_dataloader\(\), which private "
        "training needs: it draws the Poisson batches the accountant assumes",
    ):
        _balanced_trainer(tmp_path)


def test_mutation_checking_only_trainer_subclasses_lets_the_mixin_replace_poisson_sampling(tmp_path, monkeypatch):
    """The MRO filter as it was (Trainer subclasses only): the mixin is accepted and its loader draws the batches."""
    monkeypatch.setattr(
        preflight,
        "_checked_classes",
        lambda trainer_class, mixin: [
            cls for cls in trainer_class.__mro__ if issubclass(cls, Trainer) and cls not in (mixin, Trainer)
        ],
    )
    loader = _balanced_trainer(tmp_path).get_train_dataloader()
    assert isinstance(loader.sampler, WeightedRandomSampler) and loader.batch_sampler is not None
    assert not isinstance(loader.batch_sampler, PoissonBatchSampler)


class _Ran(Exception):
    """Raised by a patched private-path method: it was called."""


def _patched(*args: Any, **kwargs: Any) -> None:
    raise _Ran


class _PatchesOnTrainBegin(TrainerCallback):
    """Sets summed_loss on the trainer when training begins, after train() has compared the private path."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.summed_loss = _patched


def _patch_the_class(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(trainer), "training_step", _patched, raising=False)


PATCHES = {  # how a private-path method is patched after construction, and what the refusal says
    "instance": (
        lambda trainer, monkeypatch: setattr(trainer, "get_train_dataloader", _patched),
        "get_train_dataloader() is patched on the trainer instance (now tests.trainer.test_preflight._patched)",
    ),
    "class": (
        _patch_the_class,
        "training_step() is patched on class UserTrainer (now tests.trainer.test_preflight._patched)",
    ),
    "callback": (
        lambda trainer, monkeypatch: trainer.add_callback(_PatchesOnTrainBegin(trainer)),
        "summed_loss() is patched on the trainer instance (now tests.trainer.test_preflight._patched)",
    ),
    # the privacy unit's methods (data.units) and the chunk layout's functions (data.chunks) are on the path too
    "unit instance": (
        lambda trainer, monkeypatch: setattr(trainer.units, "poisson_sampler", _patched),
        "units.poisson_sampler() is patched on the privacy unit instance (now tests.trainer.test_preflight._patched)",
    ),
    "unit class": (
        lambda trainer, monkeypatch: monkeypatch.setattr(type(trainer.units), "training_view", _patched),
        "units.training_view() is patched on class ExampleUnits (now tests.trainer.test_preflight._patched)",
    ),
    "chunk function": (
        lambda trainer, monkeypatch: monkeypatch.setattr(hf_private.data.chunks, "physical_chunks", _patched),
        "chunks.physical_chunks() is patched on module hf_private.data.chunks "
        "(now tests.trainer.test_preflight._patched)",
    ),
}


@pytest.mark.parametrize("how", sorted(PATCHES))
def test_a_private_path_method_patched_after_construction_is_refused_before_the_first_step(tmp_path, monkeypatch, how):
    trainer = _build(tmp_path, type("UserTrainer", (PrivateTrainer,), {}), args=dict(max_steps=2))
    patch, message = PATCHES[how]
    patch(trainer, monkeypatch)
    with pytest.raises(TypeError) as refused:
        trainer.train()
    assert message in str(refused.value) and "after UserTrainer was checked: private training needs its own" in str(
        refused.value
    )
    assert trainer.ledger.total_steps == 0 and trainer.state.global_step == 0


@pytest.mark.parametrize("how", sorted(PATCHES))
def test_mutation_without_the_comparison_the_patched_method_runs(tmp_path, monkeypatch, how):
    for module in (trainer_module, step_boundaries):  # before training, and before every step
        monkeypatch.setattr(module, "check_private_path_unchanged", lambda trainer, functions: None)
    trainer = _build(tmp_path, type("UserTrainer", (PrivateTrainer,), {}), args=dict(max_steps=2))
    PATCHES[how][0](trainer, monkeypatch)
    with pytest.raises(_Ran):
        trainer.train()
