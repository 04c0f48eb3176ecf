"""Nothing un-noised leaves the machine: no data-dependent counts, and pushes go through an allow-list.

The uploads themselves, against a fake Hub, are tested in tests/trainer/test_hub.py.
"""

from __future__ import annotations

import json

import pytest

from hf_private import DPConfig
from hf_private.release.artifacts import pushable_files, withheld_files
from tests.support import tiny
from tests.support.helpers import make_trainer


def _touch(directory, *names: str) -> None:
    for name in names:
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")


def test_allow_list_keeps_released_artefacts_and_withholds_the_rest(tmp_path):
    released = [
        "README.md",
        "config.json",
        "dp_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "privacy_ledger.json",
        "private_adapter.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    junk = ["all_results.json", "model-final.safetensors", "notes.txt", "trainer_state.json", "training_args.bin"]
    _touch(
        tmp_path,
        *released,
        *junk,
        "runs/events.out.tfevents.1.host",
        "checkpoint-1/trainer_state.json",
        "checkpoint-1/config.json",
    )
    assert pushable_files(tmp_path) == released
    assert withheld_files(tmp_path) == sorted([*junk, "runs/"])  # checkpoints are local by design, not worth a warning


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_pushing_whole_checkpoints_is_refused(tmp_path, strategy):
    # Refused before Trainer would create the Hub repo (the tests are offline).
    with pytest.raises(ValueError, match=f"hub_strategy='{strategy}' uploads whole checkpoints.*'every_save' or 'end'"):
        make_trainer(tmp_path, push_to_hub=True, hub_model_id="me/x", hub_strategy=strategy)
    make_trainer(tmp_path, hub_strategy=strategy)  # no push: checkpoints stay local, nothing to refuse


def _total_flos(output_dir, dataset) -> tuple[float, float]:
    """(the checkpoint's trainer_state.json, the final training metrics) of a 2-step run with fixed Poisson draws."""
    trainer = make_trainer(
        output_dir,
        dataset=dataset,
        dp=DPConfig(noise_multiplier=1.0, noise_seed=0),
        max_steps=2,
        save_strategy="steps",
        save_steps=2,
    )
    trainer.train()
    state = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    return state["total_flos"], trainer.state.log_history[-1]["total_flos"]  # train()'s metrics, as logged


def test_total_flos_does_not_depend_on_the_private_data(tmp_path):
    """Trainer's count is 6 × tokens × parameters per batch: the same N with longer texts would change it."""
    short = tiny.sentiment_dataset(64)
    the = tiny.VOCAB.index("the")
    long = short.map(
        lambda row: {
            "input_ids": row["input_ids"] + [the] * (tiny.SEQ_LEN - len(row["input_ids"])),
            "attention_mask": [1] * tiny.SEQ_LEN,
        }
    )
    assert _total_flos(tmp_path / "short", short) == _total_flos(tmp_path / "long", long) == (0, 0)
