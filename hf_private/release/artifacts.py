"""Every file a run writes or pushes, by name, and what may leave the machine.

The names below are the only place hf_private spells an artefact's file name: its own files (ledger, method config,
card, private adapter), the PEFT and transformers weights it saves through Trainer, the tokenizer and processor
files, and `PUSHABLE_NAMES`, the allow-list of what a Hub push uploads.

Trainer uploads its whole output directory (only `_*` and `checkpoint-*` ignored), so whatever `save_state()`,
`save_metrics()`, a logging integration or the user leaves there would go public: `trainer_state.json` holds the
un-noised per-step losses and data-dependent counters, `runs/` the same as event files. A push of a private model
therefore uploads only the released artefacts, named below; anything else stays local, with a warning.
"""

from __future__ import annotations

import os
import re
import shutil

from transformers.trainer import TRAINING_ARGS_NAME as TRAINING_ARGS_NAME  # re-exported with the names below

# hf_private's own files: the privacy record and the adapter of the trained tensors
LEDGER_NAME = "privacy_ledger.json"
DP_CONFIG_NAME = "dp_config.json"
METHOD_STATE_NAME = "dp_method_state.json"  # a method's released choices (DP-FROST: the selected partitions)
# ELS (user level): which examples each user kept, drawn secretly once; resumed runs keep them. Never pushed.
USER_CAP_NAME = "user_cap.json"
# BandMF: the last b − 1 correlated noise vectors and each example's partition (`run.band_mf`). Never pushed.
BAND_MF_STATE_NAME = "band_mf_state.pt"
CARD_NAME = "README.md"
ADAPTER_WEIGHTS_NAME = "private_adapter.safetensors"
# TRAINING_ARGS_NAME (imported): transformers' own name for the saved TrainingArguments, also next to a private adapter
# PEFT's adapter
PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PT_WEIGHTS_NAME = "adapter_model.bin"
# transformers' full model: a single file or an index of shards, and its configurations
FULL_WEIGHTS_NAME = "model.safetensors"
FULL_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PT_WEIGHTS_NAME = "pytorch_model.bin"
PT_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
MODEL_CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# tokenizer and processor (built before training, from public data)
TOKENIZER_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)

# The weights Trainer's own `_load_best_model` looks for (a full model or a PEFT adapter).
TRAINER_WEIGHTS_NAMES = (
    FULL_WEIGHTS_NAME,
    PT_WEIGHTS_NAME,
    PEFT_WEIGHTS_NAME,
    PEFT_PT_WEIGHTS_NAME,
    FULL_WEIGHTS_INDEX_NAME,
    PT_WEIGHTS_INDEX_NAME,
)
PUSHABLE_NAMES = frozenset(
    {
        # weights: a full model (single file or index), a PEFT adapter, hf_private's adapter of the trained tensors
        *TRAINER_WEIGHTS_NAMES,
        PEFT_CONFIG_NAME,
        ADAPTER_WEIGHTS_NAME,
        # configurations
        MODEL_CONFIG_NAME,
        GENERATION_CONFIG_NAME,
        *TOKENIZER_NAMES,
        # the privacy record: method config and state, ledger, card
        DP_CONFIG_NAME,
        METHOD_STATE_NAME,
        LEDGER_NAME,
        CARD_NAME,
    }
)
_WEIGHT_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|pytorch_model-\d{5}-of-\d{5}\.bin")


def is_pushable(name: str) -> bool:
    """Whether a top-level file of an output directory may be uploaded."""
    return name in PUSHABLE_NAMES or _WEIGHT_SHARD.fullmatch(name) is not None


def pushable_files(directory: str | os.PathLike[str]) -> list[str]:
    """The files of `directory` (top level only) a push may upload, sorted."""
    return sorted(e.name for e in os.scandir(directory) if e.is_file() and is_pushable(e.name))


def withheld_files(directory: str | os.PathLike[str]) -> list[str]:
    """What a push leaves behind (folders end in '/'); checkpoint folders, local by design, are not listed."""
    return sorted(
        e.name if e.is_file() else f"{e.name}/"
        for e in os.scandir(directory)
        if not (e.is_file() and is_pushable(e.name)) and not (e.is_dir() and e.name.startswith("checkpoint-"))
    )


def copy_pushable(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy a checkpoint's pushable files to the output directory, so weights, ledger and card travel together."""
    for name in pushable_files(source):
        shutil.copy(os.path.join(source, name), os.path.join(target, name))


def has_trainer_weights(checkpoint: str | os.PathLike) -> bool:
    """Whether Trainer's `_load_best_model` finds weights to load in `checkpoint` (otherwise it only warns)."""
    return any(os.path.isfile(os.path.join(checkpoint, name)) for name in TRAINER_WEIGHTS_NAMES)
