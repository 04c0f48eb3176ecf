"""The documentation's claims that code can check: every python block in docs/ runs offline as written (here, or in
the test its marker names), its list of supported layers is the engine's, and the README links only to pages that
exist.

A python block in docs/ is preceded by one marker line, an HTML comment that mkdocs does not render:

* `<!-- doc-test: run -->`: executed here, unchanged, in a temporary directory;
* `<!-- doc-test: run by tests/<package>/test_x.py -->`: executed by that test (it holds assertions about what the
  block produced, e.g. a trained model's card), which must name the page;
* `<!-- doc-test: skip: <why> -->`: not run (the network, a GPU); the page must say so in words.

A block without a marker fails, so a new example is either tested or visibly excused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hf_private.engine import supported_layer_names
from tests.support.helpers import DOCS, doc_blocks, run_doc_block

ROOT = DOCS.parent
PAGES = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
BLOCKS = [(page, index, match["marker"]) for page in PAGES for index, match in enumerate(doc_blocks(page))]
RUN = [(page, index) for page, index, marker in BLOCKS if marker == "run"]
RUN_BY = [(page, marker.removeprefix("run by ")) for page, _, marker in BLOCKS if (marker or "").startswith("run by ")]


def test_every_python_block_is_marked():
    """Each block says how it is tested: run here, run by a named test, or skipped with a reason."""
    assert BLOCKS, "no python block found under docs/"
    unmarked = [(page, index) for page, index, marker in BLOCKS if marker is None]
    assert not unmarked, f"python blocks without a `<!-- doc-test: ... -->` marker: {unmarked}"
    bad = [
        (page, marker)
        for page, _, marker in BLOCKS
        if marker != "run" and not marker.startswith("run by ") and not re.fullmatch(r"skip: \S.*", marker)
    ]
    assert not bad, f"unknown markers (run | run by tests/... | skip: <why>): {bad}"


@pytest.mark.parametrize(("page", "index"), RUN, ids=[f"{page}#{index}" for page, index in RUN])
def test_block_runs_as_written(page, index, tmp_path, monkeypatch):
    """The block, pasted into a fresh interpreter, runs offline without an error (a config field renamed, a name no
    longer exported or a refused value fails here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the examples' models are tiny: more threads only synchronise
    try:
        run_doc_block(page, tmp_path, monkeypatch, index)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("page", "test_file"), RUN_BY, ids=[page for page, _ in RUN_BY])
def test_block_run_elsewhere_is_run_by_the_test_it_names(page, test_file):
    """The named test exists and reads the block from this page (`run_doc_block("<page>", ...)` or `doc_block`)."""
    source = (ROOT / test_file).read_text()
    assert f'"{page}"' in source and re.search(r"\b(run_doc_block|doc_block)\(", source), (page, test_file)


def test_a_skipped_block_is_said_to_be_skipped_on_its_page():
    """Readers see which examples no test runs: the page says so in words ("the docs' tests do not run it")."""
    for page, index, marker in BLOCKS:
        if (marker or "").startswith("skip: "):
            assert "tests do not run it" in " ".join((DOCS / page).read_text().split()), (page, index)


def test_the_supported_layer_list_is_the_engines():
    """Each layer type the engine has a dedicated rule for is named in the "Supported:" list of the models guide."""
    text = (DOCS / "guides" / "models.md").read_text()
    supported = " ".join(re.search(r"Supported:(.*?)\n2\. ", text, re.S).group(1).split())
    for name in supported_layer_names():
        assert re.search(rf"`(nn\.)?{name}`", supported), f"{name} is supported but not in the docs' list"


def test_every_page_is_in_the_nav_and_every_readme_link_into_docs_exists():
    """mkdocs.yml's nav lists every page (mkdocs would only warn), and the README's links into docs/ resolve."""
    nav = (ROOT / "mkdocs.yml").read_text()
    assert [page for page in PAGES if f": {page}\n" not in nav] == []
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert links and [link for link in links if not (ROOT / link).is_file()] == []


def test_docs_images_resolve():
    """Every image a page shows exists under docs/ (mkdocs serves nothing outside it)."""
    for page in PAGES:
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (DOCS / page).read_text()):
            assert (DOCS / page).parent.joinpath(image).resolve().is_file(), (page, image)


def test_a_marker_is_invisible_in_the_rendered_page():
    """The marker is an HTML comment on its own line, so the rendered page shows only the code."""
    for page in PAGES:
        for line in (DOCS / page).read_text().splitlines():
            if "doc-test:" in line:
                assert re.fullmatch(r"<!-- doc-test: [^\n]*? -->", line), (page, line)


def test_one_methods_page_per_method_folder():
    """docs/methods/ has one page per folder of hf_private/methods/, named as the folder."""
    methods = sorted(
        path.name
        for path in (ROOT / "hf_private" / "methods").iterdir()
        if path.is_dir() and (path / "__init__.py").exists()
    )
    assert sorted(Path(page).stem for page in PAGES if page.startswith("methods/")) == methods
