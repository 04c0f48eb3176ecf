"""No runtime import cycle goes through `hf_private.trainer.mixin`.

The trainer is the top of the package: the library pieces it uses (privacy, engine, audit, card, ...) must not
import it back, or importing any of them starts a half-initialised trainer (a circle the audit CLI once closed:
trainer → audit → trainer). Python resolves such circles only while every import stays inside a function body, so
the graph here counts imports at module level *and* in function bodies; only those under `if TYPE_CHECKING:` (never
executed) are left out. Modules are discovered from the files, so modules added later are checked too.

Edges are what the code names, nothing implicit: `import a.b` and `from a import b` (b a submodule) are edges to
`a.b`; `from a import name` is an edge to `a`; importing `a.b` is not counted as an edge to the package `a`.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "hf_private"
TRAINER = f"{PACKAGE}.trainer.mixin"


def discover_modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Dotted module name → file, for every .py file of `package` under `root` (a package's `__init__.py` is it)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING` (any module attribute of that name)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Every import statement that can run: module level, class and function bodies; not under TYPE_CHECKING."""

    def __init__(self):
        self.found: list[ast.Import | ast.ImportFrom] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for statement in node.orelse:  # the `else:` of a TYPE_CHECKING block does run
                self.visit(statement)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append(node)


def _known(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """`name` if it is a module of the package, else its longest prefix that is one (None outside the package)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _edges_of(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import `module` can run."""
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    is_package = path.name == "__init__.py"
    edges = []
    for node in visitor.found:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                # relative: level 1 is the module's own package (a package's __init__ is its own package)
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            resolved = _known(target, modules)
            if resolved is not None and resolved != module:
                edges.append((resolved, node.lineno))
    return edges


def import_graph(root: pathlib.Path, package: str) -> dict[str, dict[str, int]]:
    """module → {imported module: line of the first such import}, within `package`."""
    modules = discover_modules(root, package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        graph[module] = {}
        for target, line in _edges_of(module, path, modules):
            graph[module].setdefault(target, line)
    return graph


def shortest_path(graph: dict[str, dict[str, int]], start: str, goal: str) -> list[str] | None:
    """Breadth-first: the shortest chain of imports from `start` that reaches `goal`, or None."""
    previous: dict[str, str | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        current = queue.popleft()
        for following in sorted(graph.get(current, {})):
            if following == goal:
                path = [goal, current]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return path[::-1]
            if following not in previous:
                previous[following] = current
                queue.append(following)
    return None


def cycle_through(graph: dict[str, dict[str, int]], module: str) -> list[str] | None:
    """A shortest import cycle from `module` back to itself, as [module, ..., module], or None."""
    return shortest_path(graph, module, module)


def describe(graph: dict[str, dict[str, int]], chain: list[str], root: pathlib.Path) -> str:
    """One line per import of the chain, with the file and line that makes it."""
    lines = [" → ".join(chain)]
    for source, target in zip(chain, chain[1:], strict=False):
        path = discover_modules(root, source.split(".")[0])[source].relative_to(root)
        lines.append(f"  {source} imports {target} ({path}:{graph[source][target]})")
    return "\n".join(lines)


# ---------------------------------------------------------------- the package
def test_no_import_cycle_goes_through_the_trainer():
    graph = import_graph(ROOT, PACKAGE)
    assert TRAINER in graph, f"{TRAINER} not found under {ROOT / PACKAGE}"
    cycle = cycle_through(graph, TRAINER)
    assert cycle is None, "Import cycle through the trainer:\n" + describe(graph, cycle, ROOT)


@pytest.mark.parametrize("module", ["run.privacy_run", "run.method_view", "trainer.preflight", "methods"])
def test_the_run_and_what_methods_see_import_nothing_of_the_trainer(module):
    """The run's privacy state, the method's view of it, the construction checks and the methods stand apart from the
    Trainer glue: the glue imports them, never the other way round."""
    graph = import_graph(ROOT, PACKAGE)
    name = f"{PACKAGE}.{module}"
    assert name in graph, f"{name} not found under {ROOT / PACKAGE}"
    chain = shortest_path(graph, name, TRAINER)
    assert chain is None, f"{name} reaches {TRAINER}:\n" + describe(graph, chain, ROOT)


def test_audit_library_does_not_reach_the_trainer_or_its_command_line():
    """`hf_private.audit` is the library the trainer and the card use; only audit.cli (and __main__) drive a run."""
    graph = import_graph(ROOT, PACKAGE)
    library = [m for m in graph if m.split(".")[:2] == [PACKAGE, "audit"] and m != f"{PACKAGE}.audit.__main__"]
    assert f"{PACKAGE}.audit" in library
    for module in library:
        for forbidden in (TRAINER, f"{PACKAGE}.cli.audit"):
            chain = shortest_path(graph, module, forbidden)
            assert chain is None, f"{module} reaches {forbidden}:\n" + describe(graph, chain, ROOT)


# ---------------------------------------------------------------- the checker itself, on a made-up package
def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_checker_finds_a_cycle_closed_inside_a_function_body(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .trainer import Trainer\n",
        "pkg/trainer.py": "from .lib import helper\nclass Trainer: ...\n",
        "pkg/lib/__init__.py": "from .core import helper\n",
        "pkg/lib/core.py": "def helper():\n    from ..trainer import Trainer\n    return Trainer\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert cycle_through(graph, "pkg.trainer") == ["pkg.trainer", "pkg.lib", "pkg.lib.core", "pkg.trainer"]
    assert "pkg/lib/core.py:2" in describe(graph, cycle_through(graph, "pkg.trainer"), tmp_path)


@pytest.mark.parametrize("source", [
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .trainer import Trainer\n",
    "import typing\nif typing.TYPE_CHECKING:\n    from pkg.trainer import Trainer\n",
])
def test_checker_ignores_imports_only_for_type_checking(tmp_path, source):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/trainer.py": "from . import run\n", "pkg/run.py": source})
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.trainer"] == {"pkg.run": 1} and graph["pkg.run"] == {}
    assert cycle_through(graph, "pkg.trainer") is None


def test_checker_resolves_submodules_without_implicit_parent_edges(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .trainer import Trainer\n",
        "pkg/trainer.py": "import pkg.lib.core\nfrom pkg.lib import other, NAME\nfrom . import lib as _\n",
        "pkg/lib/__init__.py": "NAME = 1\n",
        "pkg/lib/core.py": "from . import NAME\n",  # pkg.lib, a package importing nothing
        "pkg/lib/other.py": "from .. import trainer\n",  # pkg.trainer (a submodule), not pkg
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.trainer"] == {"pkg.lib.core": 1, "pkg.lib.other": 2, "pkg.lib": 2}
    assert graph["pkg.lib.core"] == {"pkg.lib": 1} and graph["pkg.lib.other"] == {"pkg.trainer": 1}
    assert cycle_through(graph, "pkg.trainer") == ["pkg.trainer", "pkg.lib.other", "pkg.trainer"]
