"""The wheel must contain every subpackage: pyproject lists them explicitly (model_cards/ is mapped in)."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "hf_private").rglob("__init__.py")
    }
    assert found | {"hf_private.model_cards"} == listed
