"""What may leave the machine: the allow-list of files a Hub push uploads, and the settings that would leak counts.

Trainer uploads its whole output directory (only `_*` and `checkpoint-*` ignored), so whatever `save_state()`,
`save_metrics()`, a logging integration or the user leaves there would go public: `trainer_state.json` holds the
un-noised per-step losses and data-dependent counters, `runs/` the same as event files. A push of a private model
therefore uploads only the released artefacts, named below; anything else stays local, with a warning.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from concurrent.futures import Future

from huggingface_hub import CommitInfo
from transformers import TrainingArguments
from transformers.trainer_utils import HubStrategy
from transformers.utils import hf_api

from .adapters import ADAPTER_WEIGHTS_NAME, PEFT_CONFIG_NAME
from .logs import get_logger
from .methods.dpsgd.config import CONFIG_NAME as DP_CONFIG_NAME

logger = get_logger(__name__)

LEDGER_NAME = "privacy_ledger.json"
CARD_NAME = "README.md"
PUSHABLE_NAMES = frozenset({
    # weights: a full model (single file or index), a PEFT adapter, hf_private's adapter of the trained tensors
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
    "adapter_model.safetensors", "adapter_model.bin", PEFT_CONFIG_NAME, ADAPTER_WEIGHTS_NAME,
    # configurations
    "config.json", "generation_config.json",
    # tokenizer and processor (built before training, from public data)
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json",
    # the privacy record: method config, ledger, card
    DP_CONFIG_NAME, LEDGER_NAME, CARD_NAME,
})
_WEIGHT_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|pytorch_model-\d{5}-of-\d{5}\.bin")
_LOCAL_ONLY_STRATEGIES = (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)


def is_pushable(name: str) -> bool:
    """Whether a top-level file of an output directory may be uploaded."""
    return name in PUSHABLE_NAMES or _WEIGHT_SHARD.fullmatch(name) is not None


def pushable_files(directory: str | os.PathLike) -> list[str]:
    """The files of `directory` (top level only) a push may upload, sorted."""
    return sorted(e.name for e in os.scandir(directory) if e.is_file() and is_pushable(e.name))


def withheld_files(directory: str | os.PathLike) -> list[str]:
    """What a push leaves behind (folders end in '/'); checkpoint folders, local by design, are not listed."""
    return sorted(
        e.name if e.is_file() else f"{e.name}/" for e in os.scandir(directory)
        if not (e.is_file() and is_pushable(e.name)) and not (e.is_dir() and e.name.startswith("checkpoint-"))
    )


def copy_pushable(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy a checkpoint's pushable files to the output directory, so weights, ledger and card travel together."""
    for name in pushable_files(source):
        shutil.copy(os.path.join(source, name), os.path.join(target, name))


def check_release_settings(args: TrainingArguments) -> None:
    """Refuse TrainingArguments that would publish un-noised functions of the private data."""
    if args.include_num_input_tokens_seen not in ("no", False):
        raise ValueError(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r}: the token count of each Poisson "
            "batch is an un-noised function of the private data (who was sampled, how long their text is), logged "
            "and saved in trainer_state.json. Set include_num_input_tokens_seen='no'."
        )
    if args.push_to_hub and args.hub_strategy in _LOCAL_ONLY_STRATEGIES:
        raise ValueError(
            f"hub_strategy={HubStrategy(args.hub_strategy).value!r} uploads whole checkpoints: trainer_state.json "
            "(un-noised training losses, data-dependent counters) and the optimizer and RNG state. Use "
            "hub_strategy='every_save' or 'end', which push only the released artefacts (weights or adapter, configs, "
            "tokenizer, dp_config.json, privacy_ledger.json, the card); checkpoints stay in output_dir for resuming."
        )


class AllowListedUpload:
    """Uploads an output directory's pushable files; warns once about each file it withholds."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def __call__(self, repo_id: str, folder: str, *, commit_message: str | None, token: str | None,
                 revision: str | None, run_as_future: bool) -> CommitInfo | Future[CommitInfo]:
        files = pushable_files(folder)
        new = [name for name in withheld_files(folder) if name not in self._warned]
        if new:
            logger.warning("Not pushing %s from %s: only released artefacts leave the machine (see "
                           "hf_private.artifacts.PUSHABLE_NAMES).", ", ".join(new), folder)
            self._warned.update(new)
        logger.info("Pushing %s to %s.", ", ".join(files), repo_id)
        return hf_api().upload_folder(
            repo_id=repo_id, folder_path=folder, commit_message=commit_message, token=token, revision=revision,
            run_as_future=run_as_future, allow_patterns=[glob.escape(name) for name in files],
        )
