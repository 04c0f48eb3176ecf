"""The Trainer glue stays glue: the module defining `PrivateTrainingMixin` is short and never branches on the privacy
unit (example, ULS user, ELS capped user) or the chunk layout (padded, packed) - those are chosen once, in
`data/units.py` and `data/chunks.py`, so that a new unit or layout lands in `data/` and not as an `if` in the hooks.
"""

from __future__ import annotations

import ast
import inspect

import pytest

from hf_private.trainer import PrivateTrainingMixin

MAX_GLUE_LINES = 350
#: names whose appearance in a condition means the glue decides by unit or layout
UNIT_OR_LAYOUT = {
    "uls",
    "els",
    "user_level",
    "privacy_unit",
    "user_sampling",
    "user_index",
    "user_column",
    "packed",
    "packing",
    "is_packed",
    "packed_layout",
    "layout",
}


def _conditions(tree: ast.AST) -> list[ast.expr]:
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
    return tests


def unit_or_layout_branches(source: str) -> list[tuple[int, str]]:
    """(line, name) of each condition that reads a unit or layout name (a variable, attribute or string)."""
    found = []
    for test in _conditions(ast.parse(source)):
        for node in ast.walk(test):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else node.value
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                else None
            )
            if name is not None and name.lstrip("_").lower() in UNIT_OR_LAYOUT:
                found.append((test.lineno, name))
    return found


def test_the_trainer_glue_is_short():
    lines = inspect.getsource(inspect.getmodule(PrivateTrainingMixin)).count("\n")
    assert lines < MAX_GLUE_LINES, f"{inspect.getsourcefile(PrivateTrainingMixin)}: {lines} lines"


def test_the_trainer_glue_never_branches_on_the_unit_or_the_layout():
    source = inspect.getsource(inspect.getmodule(PrivateTrainingMixin))
    assert unit_or_layout_branches(source) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("if self._uls:\n    pass\n", [(1, "_uls")]),
        ("x = a if config.privacy_unit == 'user' else b\n", [(1, "privacy_unit")]),
        ("if chunks.packed is None:\n    pass\n", [(1, "packed")]),
        ("while mode == 'packed':\n    break\n", [(1, "packed")]),
        ("if self.run.units.sampler is None:\n    pass\n", []),
    ],
)
def test_the_branch_finder_sees_unit_and_layout_conditions(source, expected):
    assert unit_or_layout_branches(source) == expected
