"""The conformance matrix: every family the README lists × {full, LoRA, DP-BiTFiT} against a float64 per-example
loop, and the README's table of supported families generated from it (`tests/support/family_table.py`)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DataCollatorForLanguageModeling

from hf_private import DPConfig, PrivateTrainer
from tests.support import family_table, tiny
from tests.support.families import FAMILIES, FAMILY
from tests.support.helpers import snapshot, training_args

HF_LOGGER = "transformers.hf_private"

#: the cells that are refused, and why (anything else must match the loop)
REFUSED = {
    (name, "DP-BiTFiT"): "has no bias parameters"
    for name in (
        *("Llama", "Mistral", "Qwen3", "OLMo-2", "Gemma", "Gemma 2", "Gemma 3", "Phi-3", "Granite", "Cohere"),
        *("Mixtral", "Qwen3-MoE", "OLMoE", "T5"),
    )
}
TOLERANCE = 1e-6  # float64, but many families compute their norms in float32 (Gemma's, Cohere's)


@pytest.fixture(scope="module")
def matrix() -> dict[tuple[str, str], family_table.Cell]:
    return {(cell.family, cell.mode): cell for cell in family_table.run_matrix()}


@pytest.mark.parametrize("mode", family_table.MODES)
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_each_family_matches_the_per_example_loop_or_is_refused_by_name(matrix, family, mode):
    cell = matrix[family, mode]
    if (family, mode) in REFUSED:
        assert cell.error is None and REFUSED[family, mode] in cell.refusal, cell
    else:
        assert cell.error is not None, f"{family} × {mode} is refused: {cell.refusal}"
        assert cell.error <= TOLERANCE, cell


def test_the_readme_table_is_the_matrix(matrix):
    assert family_table.readme_table(family_table.README.read_text()) == family_table.render(list(matrix.values())), (
        "README.md's family table is out of date: run python -m tests.support.family_table"
    )


@pytest.mark.parametrize("family", ["Qwen3", "Gemma 3"])
def test_a_new_family_trains_end_to_end_and_the_plan_names_its_rules(tmp_path, caplog, family):
    """A new user's full DP fine-tune of a family that was refused before: PrivateTrainer with DPConfig trains, logs
    which rule each module uses, and reports ε."""
    model = FAMILY[family].build()
    with caplog.at_level(logging.WARNING, logger=HF_LOGGER):
        trainer = PrivateTrainer(
            model=model,
            args=training_args(tmp_path, max_steps=2, per_device_train_batch_size=8),
            train_dataset=tiny.lm_dataset(32),
            data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
            dp_config=DPConfig(target_epsilon=8.0),
        )
        before = snapshot(model)
        trainer.train()
    rules = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Per-example gradient rule")]
    norms = "Qwen3RMSNorm ×9" if family == "Qwen3" else "Gemma3RMSNorm ×13"
    assert any(line.endswith(f"({norms})") and "norm gain (matched by probe)" in line for line in rules), rules
    assert 0 < trainer.privacy_report()["epsilon"] <= 8.0
    assert all(not torch.equal(before[f"param:{n}"], p) for n, p in model.named_parameters() if "norm" in n)
