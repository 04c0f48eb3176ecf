"""Private adapters: save only the tensors DP training changed, and put them back onto the base model in one call.

The on-disk format follows from what was trained, so each is the smallest faithful one:

* a PEFT model (DP-LoRA): PEFT's own `adapter_config.json` + `adapter_model.safetensors`;
* a plain model with only some tensors trained (DP-BiTFiT: biases and the new head): `private_adapter.safetensors`,
  whose header names the base model and fingerprints its frozen weights, so a wrong base is caught on load;
* every tensor trained (DP full fine-tuning, X+BiTFiT): the standard transformers checkpoint.

`PrivateTrainer` writes `dp_config.json` (the method config) next to each. `load_private_adapter` reads all three,
from a local directory or a Hub repo.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..logs import get_logger
from ..models.peft import auxiliary_parameter_names, is_peft_model
from .artifacts import (
    ADAPTER_WEIGHTS_NAME,
    CARD_NAME,
    DP_CONFIG_NAME,
    FULL_WEIGHTS_INDEX_NAME,
    FULL_WEIGHTS_NAME,
    LEDGER_NAME,
    MODEL_CONFIG_NAME,
    PEFT_CONFIG_NAME,
    PEFT_WEIGHTS_NAME,
)

logger = get_logger(__name__)

ADAPTER_FORMAT = "hf_private.adapter.v1"
_HUB_FILES = [
    ADAPTER_WEIGHTS_NAME,
    PEFT_CONFIG_NAME,
    PEFT_WEIGHTS_NAME,
    MODEL_CONFIG_NAME,
    "model*.safetensors",
    FULL_WEIGHTS_INDEX_NAME,
    DP_CONFIG_NAME,
    LEDGER_NAME,
    CARD_NAME,
]
_FINGERPRINT_SAMPLES = 16  # values per frozen tensor: enough to tell two checkpoints apart, cheap for 7B models


def is_hub_model_id(name: str) -> bool:
    """True for what names a Hub model ("name" or "owner/name"), False for anything shaped like a local path.

    A local base model's path (a cache directory of the training machine, ./my-model, ~/models/x, /abs/path, or an
    existing directory even when shaped like an id) must not reach the card, nor be rendered as a huggingface.co link.
    """
    if not name or name.startswith(("~", ".", "/")) or os.path.isabs(name) or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def public_base_name(name: str | None) -> str:
    """The base model's name as released artefacts may carry it: a Hub id, or "" for a local path or none."""
    return name if name and is_hub_model_id(name) else ""


def adapter_format(model: nn.Module, trained_names: Iterable[str]) -> str:
    """'peft', 'private_adapter' (a strict subset of a plain model's tensors trained) or 'full'."""
    if is_peft_model(model):
        return "peft"
    trained = set(trained_names)
    return "full" if trained >= {name for name, _ in model.named_parameters()} else "private_adapter"


def has_private_adapter(directory: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(directory, ADAPTER_WEIGHTS_NAME))


def private_adapter_names(directory: str | os.PathLike) -> set[str]:
    """The tensor names a private adapter holds (empty when there is none): what an earlier run trained."""
    if not has_private_adapter(directory):
        return set()
    with safe_open(os.path.join(directory, ADAPTER_WEIGHTS_NAME), framework="pt") as f:
        return set(f.keys())


def base_fingerprint(model: nn.Module, exclude: Iterable[str] = ()) -> str:
    """A short hash of names, shapes and a strided sample of every parameter not in `exclude` (the frozen base) and
    not auxiliary."""
    skip = set(exclude) | auxiliary_parameter_names(model)
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if name in skip:
            continue
        flat = param.detach().reshape(-1)
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        if flat.numel():
            index = torch.linspace(0, flat.numel() - 1, min(flat.numel(), _FINGERPRINT_SAMPLES), device=flat.device)
            digest.update(flat[index.long()].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:24]


def withhold_local_base_path(save_directory: str | os.PathLike) -> None:
    """PEFT writes the base's `_name_or_path` into adapter_config.json; a local path (the training machine's cache
    or home directory) must not travel with the adapter, so it is blanked (PeftModel.from_pretrained(base, dir)
    does not need it)."""
    path = os.path.join(save_directory, PEFT_CONFIG_NAME)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    name = config.get("base_model_name_or_path")
    if name and not is_hub_model_id(name):
        config["base_model_name_or_path"] = None
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def save_private_adapter(model: nn.Module, save_directory: str | os.PathLike, trained_names: Iterable[str]) -> str:
    """Write the trained tensors of a plain (non-PEFT) model; the header records which base they belong on."""
    if is_peft_model(model):
        raise ValueError("A PeftModel saves itself in PEFT's format (model.save_pretrained); this is for plain models.")
    names = set(trained_names)
    params = dict(model.named_parameters())
    unknown = sorted(names - params.keys())
    if unknown:
        raise ValueError(f"Trained tensors {unknown[:5]} are not parameters of {type(model).__name__}.")
    tensors = {name: params[name].detach().to("cpu").contiguous() for name in sorted(names)}
    frozen = [p for n, p in params.items() if n not in names]
    config = getattr(model, "config", None)
    metadata = {
        "format": "pt",
        "hf_private_format": ADAPTER_FORMAT,
        "model_class": type(model).__name__,
        "base_model": public_base_name(getattr(config, "_name_or_path", None)),
        "base_fingerprint": base_fingerprint(model, exclude=names),
        "base_dtype": str(frozen[0].dtype) if frozen else "",
    }
    os.makedirs(save_directory, exist_ok=True)
    path = os.path.join(save_directory, ADAPTER_WEIGHTS_NAME)
    save_file(tensors, path, metadata=metadata)
    logger.info(
        "Saved %d trained tensors (%d values) to %s.", len(tensors), sum(t.numel() for t in tensors.values()), path
    )
    return path


def load_private_adapter(
    base_model: nn.Module,
    path_or_repo: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    check_base: bool = True,
) -> nn.Module:
    """Put a privately fine-tuned adapter (local directory or Hub repo id) onto `base_model` and return the model.

    `base_model` is the public model training started from, loaded the same way (e.g. with the same
    `num_labels`). A PEFT adapter returns a `PeftModel` wrapping it; the other formats load in place and return
    `base_model` itself. With `check_base`, a base whose frozen weights differ from the training run's is refused:
    the adapter would load but compute something else.
    """
    if is_peft_model(base_model):
        raise ValueError("Pass the plain base model; load_private_adapter adds the adapter itself.")
    directory = _resolve(path_or_repo, revision, token)
    if has_private_adapter(directory):
        load_adapter_weights(base_model, directory, check_base=check_base)
        model = base_model
    elif os.path.isfile(os.path.join(directory, PEFT_CONFIG_NAME)):
        from peft import PeftModel

        model = PeftModel.from_pretrained(base_model, directory)
    elif os.path.isfile(os.path.join(directory, FULL_WEIGHTS_NAME)) or os.path.isfile(
        os.path.join(directory, FULL_WEIGHTS_INDEX_NAME)
    ):
        _assign(base_model, _full_state_dict(directory), require_all=True)
        model = base_model
    else:
        raise FileNotFoundError(
            f"{path_or_repo} holds no adapter: expected {ADAPTER_WEIGHTS_NAME} (hf_private), {PEFT_CONFIG_NAME} "
            f"(PEFT) or {FULL_WEIGHTS_NAME} (full model); found {sorted(os.listdir(directory))}."
        )
    _log_guarantee(directory)
    return model.eval()


def load_adapter_weights(model: nn.Module, directory: str | os.PathLike, *, check_base: bool = True) -> None:
    """Copy a `private_adapter.safetensors` into `model` in place (also used to resume from a checkpoint)."""
    path = os.path.join(directory, ADAPTER_WEIGHTS_NAME)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("hf_private_format") != ADAPTER_FORMAT:
        raise ValueError(f"{path} is not an hf_private adapter ({ADAPTER_FORMAT}); its header is {metadata}.")
    state = load_file(path)
    expected_class = metadata.get("model_class")
    if expected_class and expected_class != type(model).__name__:
        logger.warning("Adapter was trained on a %s; loading it onto a %s.", expected_class, type(model).__name__)
    _assign(model, state, require_all=False)
    if check_base:
        _check_base(model, state.keys(), metadata, path)


def _check_base(model: nn.Module, trained_names: Iterable[str], metadata: dict[str, str], path: str) -> None:
    trained = set(trained_names)
    expected = metadata.get("base_fingerprint")
    if not expected or base_fingerprint(model, exclude=trained) == expected:
        return
    frozen_dtype = next((str(p.dtype) for n, p in model.named_parameters() if n not in trained), "")
    base = metadata.get("base_model") or "a local base model or one built from its configuration"
    if metadata.get("base_dtype") and frozen_dtype != metadata["base_dtype"]:
        logger.warning(
            "The base model is %s but the adapter was trained on %s weights, so the base cannot be "
            "verified exactly; make sure it is %s.",
            frozen_dtype,
            metadata["base_dtype"],
            base,
        )
        return
    raise ValueError(
        f"The base model's frozen weights differ from those {path} was trained on ({base}). The adapter would "
        "load but compute something else. Load the same base model (same checkpoint and revision, same "
        "num_labels), or pass check_base=False if you know the difference is intended."
    )


def _assign(model: nn.Module, state: dict[str, torch.Tensor], *, require_all: bool) -> None:
    """Copy tensors into the model's parameters/buffers by name, refusing unknown names and wrong shapes."""
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}
    unknown = sorted(set(state) - targets.keys())
    if unknown:
        raise ValueError(
            f"{len(unknown)} saved tensors are not in {type(model).__name__} (e.g. {unknown[:3]}): the adapter was "
            "trained on a different architecture."
        )
    wrong = [
        f"{k}: saved {tuple(v.shape)} vs model {tuple(targets[k].shape)}"
        for k, v in state.items()
        if v.shape != targets[k].shape
    ]
    if wrong:
        raise ValueError(f"Shape mismatch (different num_labels or model size?): {wrong[:3]}")
    with torch.no_grad():
        for name, value in state.items():
            targets[name].copy_(value.to(targets[name].dtype))
    if require_all:
        loaded = {id(targets[name]) for name in state}
        missing = [n for n, p in model.named_parameters() if id(p) not in loaded]
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} parameters of the model (e.g. {missing[:3]}).")


def _full_state_dict(directory: str) -> dict[str, torch.Tensor]:
    index_path = os.path.join(directory, FULL_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = [FULL_WEIGHTS_NAME]
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(os.path.join(directory, shard)))
    return state


def _resolve(path_or_repo: str | os.PathLike, revision: str | None, token: str | bool | None) -> str:
    """A local directory as is; anything else is a Hub repo id whose adapter files are downloaded."""
    path = os.fspath(path_or_repo)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"{path} is a file; pass the directory that holds the adapter.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(path, revision=revision, token=token, allow_patterns=_HUB_FILES)
    except HFValidationError as error:
        raise FileNotFoundError(f"{path!r} is neither a local directory nor a valid Hub repo id.") from error


def _log_guarantee(directory: str) -> None:
    readme = os.path.join(directory, CARD_NAME)
    if not os.path.isfile(readme):
        return
    from huggingface_hub import ModelCard

    privacy = ModelCard.load(readme).data.to_dict().get("privacy") or {}
    if privacy:
        logger.info(
            "Loaded a private adapter: guarantee %s, ε=%s, δ=%s (%s accountant, unit: %s).",
            privacy.get("guarantee"),
            privacy.get("epsilon"),
            privacy.get("delta"),
            privacy.get("accountant"),
            privacy.get("unit"),
        )
