"""The wheel holds every package under hf_private/ (found by setuptools, listed nowhere), the card template and the
PEP 561 marker py.typed (without it, type checkers ignore the package's inline hints).

The wheel is built offline from a clean copy of the sources (no build/ left over from an earlier build can add or
hide a file) through setuptools' PEP 517 hook, the one pip calls: a couple of seconds.
"""

import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
METHODS = ROOT / "hf_private" / "methods"


def _python_files(folder: pathlib.Path) -> set[str]:
    return {str(p.relative_to(ROOT)) for p in folder.rglob("*.py") if "__pycache__" not in p.parts}


def _build_wheel(tmp_path: pathlib.Path) -> set[str]:
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("hf_private", "model_cards"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    out = tmp_path / "wheel"
    hook = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    built = subprocess.run(
        [sys.executable, "-c", hook, str(out)], cwd=source, capture_output=True, text=True, check=False
    )
    assert built.returncode == 0, built.stderr[-3000:]
    with zipfile.ZipFile(out / built.stdout.strip().splitlines()[-1]) as wheel:
        return set(wheel.namelist())


def test_the_wheel_holds_every_module_every_method_folder_the_card_template_and_py_typed(tmp_path):
    names = _build_wheel(tmp_path)
    packaged = {n for n in names if n.startswith("hf_private/") and n.endswith(".py")}
    expected = _python_files(ROOT / "hf_private") | {
        f"hf_private/model_cards/{p.name}" for p in (ROOT / "model_cards").glob("*.py")
    }
    assert packaged == expected
    folders = [p.name for p in METHODS.iterdir() if (p / "__init__.py").is_file()]
    assert {"dpsgd", "lora", "bitfit", "frost", "sparse_lowrank", "dpfp"} <= set(folders)
    assert {f"hf_private/methods/{folder}/__init__.py" for folder in folders} <= names
    assert {
        "hf_private/methods/shared.py",
        "hf_private/methods/frost/reducer.py",
        "hf_private/methods/dpfp/forward_noise.py",
    } <= names
    templates = {f"hf_private/model_cards/{p.name}" for p in (ROOT / "model_cards").glob("*.md")}
    assert templates and templates <= names
    assert "hf_private/py.typed" in names
