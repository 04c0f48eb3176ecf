"""The package's plan, enforced: each room of `hf_private` imports only rooms below it, and no import circle exists.

A room is a sub-package (`trainer/`, `run/`, `data/`, ...) or a top-level module (`optimizer.py`, ...). The table
`LAYERS` is the house's floor plan, top to bottom (docs/design/architecture.md draws it): a room may import its own
modules and the rooms below it, never a room above it or beside it on its floor, so that each floor can be read
without the floors above. A new room must be placed in the table before its first import counts.

Every import statement counts - module level, class and function bodies, and `if TYPE_CHECKING:` blocks: a circle
closed only by a type-only import still means two files cannot be read apart (and annotations are read by tools and
people). Two files stand outside the table: `hf_private/__init__.py`, the public face that gathers names from every
floor, and `audit/__main__.py`, the entry point of `python -m hf_private.audit`, which runs the command line above
everything and is imported by no module.

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

#: the floors, top to bottom; rooms on one floor may not import each other
LAYERS: list[tuple[str, ...]] = [
    ("cli",),  # applications: hf-private-audit
    ("trainer",),  # Trainer's hooks: the mixin, privatize, publishing hooks, construction refusals
    ("run",),  # the run's privacy state: plan, ledger, streams, engine, stages, report
    ("clip_norm",),  # choosing C on public text (runs a throw-away private step)
    ("integrations",),  # trainer families (TRL) and their per-unit losses
    ("release",),  # what leaves the machine: artefacts, adapters, checkpoints, the card
    ("methods",),  # one folder per DP method, the method contract
    ("audit",),  # the privacy audit as a library
    ("optimizer",),  # the noisy step in named parts
    ("engine",),  # per-example gradients, one file per layer rule
    ("data",),  # units, sampling, chunks, packing, rows, labels
    ("evaluation",),  # held-out verdicts, collapse warning, metrics
    ("privacy",),  # plan, ledger, events, accountants, calibration, secret randomness
    ("models",),  # heads, model families, PEFT facts
    ("logs", "demos", "version"),
]
OUTSIDE_THE_PLAN = {PACKAGE, f"{PACKAGE}.audit.__main__"}
MAX_TOP_LEVEL_MODULES = 8


def discover_modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Dotted module name → file, for every .py file of `package` under `root` (a package's `__init__.py` is it)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """`name` if it is a module of the package, else its longest prefix that is one (None outside the package)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _edges_of(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import statement of `module`, wherever it stands."""
    is_package = path.name == "__init__.py"
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # relative: level 1 is the module's own package (a package's __init__ is its own package)
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
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


def room_of(module: str) -> str:
    """The room a module lives in: its sub-package, or itself for a top-level module."""
    return module.split(".")[1]


def upward_imports(
    graph: dict[str, dict[str, int]], layers: list[tuple[str, ...]], outside: set[str]
) -> list[tuple[str, str, int]]:
    """(module, imported module, line) for each import into a room on the same floor or above."""
    floor = {room: depth for depth, rooms in enumerate(layers) for room in rooms}
    found = []
    for module, targets in graph.items():
        if module in outside:
            continue
        for target, line in targets.items():
            here, there = room_of(module), room_of(target)
            if here != there and floor[here] >= floor[there]:
                found.append((module, target, line))
    return found


# ---------------------------------------------------------------- the package
def test_every_room_stands_on_a_floor_of_the_plan():
    rooms = {room_of(module) for module in import_graph(ROOT, PACKAGE) if module != PACKAGE}
    planned = {room for rooms_of_floor in LAYERS for room in rooms_of_floor}
    assert rooms - planned == set(), f"rooms missing from LAYERS (place them): {sorted(rooms - planned)}"
    assert planned - rooms == set(), f"LAYERS names rooms that do not exist: {sorted(planned - rooms)}"


def test_each_room_imports_only_rooms_below_it():
    graph = import_graph(ROOT, PACKAGE)
    upward = upward_imports(graph, LAYERS, OUTSIDE_THE_PLAN)
    assert upward == [], "imports that run up (or across a floor):\n" + "\n".join(
        f"  {m} imports {t} ({discover_modules(ROOT, PACKAGE)[m].relative_to(ROOT)}:{line})" for m, t, line in upward
    )


def test_no_import_circle_anywhere_type_only_imports_included():
    graph = import_graph(ROOT, PACKAGE)
    for module in sorted(graph):
        cycle = cycle_through(graph, module)
        assert cycle is None, "import circle:\n" + describe(graph, cycle, ROOT)


def test_the_top_level_is_a_table_of_contents():
    modules = sorted(path.name for path in (ROOT / PACKAGE).glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, f"{len(modules)} modules directly under {PACKAGE}/: {modules}"


# ---------------------------------------------------------------- the checker itself, on a made-up package
def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_checker_finds_a_cycle_closed_inside_a_function_body(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .trainer import Trainer\n",
            "pkg/trainer.py": "from .lib import helper\nclass Trainer: ...\n",
            "pkg/lib/__init__.py": "from .core import helper\n",
            "pkg/lib/core.py": "def helper():\n    from ..trainer import Trainer\n    return Trainer\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert cycle_through(graph, "pkg.trainer") == ["pkg.trainer", "pkg.lib", "pkg.lib.core", "pkg.trainer"]
    assert "pkg/lib/core.py:2" in describe(graph, cycle_through(graph, "pkg.trainer"), tmp_path)


@pytest.mark.parametrize(
    "source",
    [
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .trainer import Trainer\n",
        "import typing\nif typing.TYPE_CHECKING:\n    from pkg.trainer import Trainer\n",
    ],
)
def test_checker_counts_imports_made_only_for_type_checking(tmp_path, source):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/trainer.py": "from . import run\n", "pkg/run.py": source})
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.trainer"] == {"pkg.run": 1} and graph["pkg.run"] == {"pkg.trainer": 3}
    assert cycle_through(graph, "pkg.trainer") == ["pkg.trainer", "pkg.run", "pkg.trainer"]


def test_checker_finds_imports_that_run_up_or_across_a_floor(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .top import App\n",  # the public face: outside the plan
            "pkg/top.py": "from .low import x\n",
            "pkg/mid/__init__.py": "",
            "pkg/mid/a.py": "from ..low import x\nfrom . import b\n",  # down, and inside its own room: fine
            "pkg/mid/b.py": "def f():\n    from ..top import App\n",  # up, inside a function body
            "pkg/low.py": "from .side import y\n",  # across its floor
            "pkg/side.py": "y = 1\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    layers = [("top",), ("mid",), ("low", "side")]
    assert upward_imports(graph, layers, {"pkg"}) == [("pkg.low", "pkg.side", 1), ("pkg.mid.b", "pkg.top", 2)]


def test_checker_resolves_submodules_without_implicit_parent_edges(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .trainer import Trainer\n",
            "pkg/trainer.py": "import pkg.lib.core\nfrom pkg.lib import other, NAME\nfrom . import lib as _\n",
            "pkg/lib/__init__.py": "NAME = 1\n",
            "pkg/lib/core.py": "from . import NAME\n",  # pkg.lib, a package importing nothing
            "pkg/lib/other.py": "from .. import trainer\n",  # pkg.trainer (a submodule), not pkg
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.trainer"] == {"pkg.lib.core": 1, "pkg.lib.other": 2, "pkg.lib": 2}
    assert graph["pkg.lib.core"] == {"pkg.lib": 1} and graph["pkg.lib.other"] == {"pkg.trainer": 1}
    assert cycle_through(graph, "pkg.trainer") == ["pkg.trainer", "pkg.lib.other", "pkg.trainer"]
