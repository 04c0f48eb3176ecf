"""The conformance matrix: every family the README lists × {full, LoRA, DP-BiTFiT} against a float64 per-example
loop, and the README's table of supported families generated from it (`tests/support/family_table.py`)."""

from __future__ import annotations

import pytest

from tests.support import family_table
from tests.support.families import FAMILIES

#: the cells that are refused, and why (anything else must match the loop)
REFUSED = {
    (name, "DP-BiTFiT"): "has no bias parameters"
    for name in ("Llama", "Mistral", "Qwen3", "OLMo-2", "Gemma", "Gemma 2", "Gemma 3", "Phi-3", "Granite", "Cohere")
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
