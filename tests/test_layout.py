"""The package's layout: imports run one way between wings, no import cycle, and rooms stay small.

The wings (``kvsearch/storage/``, ``kvsearch/index/``, ...) and the shared top-level modules stand in ranks, bottom
first (:data:`RANKS`, the order ``docs/ARCHITECTURE.md`` draws). A module may import from its own wing and from
lower ranks, never from a higher rank nor from a sibling of its rank (siblings know nothing of each other), and the
module-level imports form no cycle. Every import counts for the ranks — at module level, inside functions and under
``if TYPE_CHECKING:`` (an annotation that names a higher module's class is a sign of an upward reference: hand the
lower module what it uses, typed by a small Protocol of its own) — except the few listed by name in
:data:`ALLOWED_UPWARD` with why. Only the imports that run when a module is imported (module level, not under
``TYPE_CHECKING``) count for the cycles.

The checker is tested on small planted trees too, so that a test that cannot fail does not pass for one.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvsearch"

# Bottom first. A rank's members are wings (subpackages) or top-level modules; "kvsearch" is the package's own
# __init__ (the public names), above everything.
RANKS: list[tuple[str, ...]] = [
    ("errors",),
    ("checks", "plot"),
    ("metadata",),
    ("results",),
    ("text",),
    ("datasets",),
    ("nn", "encoders"),
    ("inputs",),
    ("storage",),
    ("index",),
    ("retrieval",),
    ("generations",),
    ("view",),
    ("reads", "writes"),
    ("selection",),
    ("database",),
    ("contract",),  # the protocol both facades meet; what training, the CLI and integrations are written against
    ("distributed",),
    ("training",),
    ("cli", "integrations"),
    ("kvsearch", "__main__"),  # __main__: `python -m kvsearch`, the command line
]

# (importing module, imported module) -> why an upward import is fine there. Only imports inside functions for an
# optional extra belong here; an annotation that names a higher module's class is typed by a Protocol defined low.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

MAX_MODULE_LINES = 700
MAX_FACADE_LINES = 650  # kvsearch/database.py, docstrings included
MAX_CLASS_LINES = 600


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. "kvsearch.storage.store"
    target: str  # the imported module, e.g. "kvsearch.storage.chunks"
    line: int
    top_level: bool  # runs when the module is imported: at module level, not inside a function nor TYPE_CHECKING


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, top_level: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every import node under ``node``, with whether it runs when the module is imported.

    Imports under ``if TYPE_CHECKING:`` are found too (they name what the module knows of, so they count for the
    ranks) but never run (so they make no cycle); the ``else`` branch of such a block runs.
    """
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for checked in child.body:  # for annotations only: never runs
                yield from _walk_one(checked, False)
            for other in child.orelse:  # the else branch runs
                yield from _walk_one(other, top_level)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, top_level
            continue
        inner = top_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def _walk_one(node: ast.AST, top_level: bool) -> Iterator[tuple[ast.AST, bool]]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, top_level
    else:
        yield from _walk(node, top_level)


def imports(root: Path) -> list[Import]:
    """Every import of a module of the package, by any module of it (relative imports resolved)."""
    known = modules(root)
    package = root.name
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, top_level in _walk(tree, True):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                # "from pkg import mod" imports the module pkg.mod; "from mod import name" the module mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                if target == package or target.startswith(package + "."):
                    while target not in known and "." in target:
                        target = target.rsplit(".", 1)[0]  # "import kvsearch.x.y" of a name inside a module
                    found.append(Import(name, target, node.lineno, top_level))
    return found


def unit_of(module: str) -> str:
    """The wing or top-level module a module belongs to: kvsearch.storage.store -> storage."""
    parts = module.split(".")
    return parts[0] if len(parts) == 1 else parts[1]


def rank_of(unit: str, ranks: list[tuple[str, ...]]) -> int:
    for rank, members in enumerate(ranks):
        if unit in members:
            return rank
    raise KeyError(unit)


def violations(root: Path, ranks: list[tuple[str, ...]], allowed: dict[tuple[str, str], str]) -> list[str]:
    """What breaks the order: unplaced modules, upward or sibling imports, and module-level cycles."""
    out = [
        f"{m}: its wing {unit_of(m)!r} has no rank (place it in RANKS)"
        for m in modules(root)
        if not any(unit_of(m) in members for members in ranks)
    ]
    if out:
        return out
    edges: dict[str, set[str]] = {m: set() for m in modules(root)}
    for imp in imports(root):
        a, b = unit_of(imp.source), unit_of(imp.target)
        if a != b and rank_of(b, ranks) >= rank_of(a, ranks) and (imp.source, imp.target) not in allowed:
            how = "above it" if rank_of(b, ranks) > rank_of(a, ranks) else "its sibling"
            out.append(f"{imp.source}:{imp.line} imports {imp.target} ({b!r} is {how}; {a!r} must not know it)")
        if imp.top_level and imp.target != imp.source:
            edges[imp.source].add(imp.target)
    out += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(edges)]
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected part of the graph that has one (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found = []
    for start in sorted(edges):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return found


def class_lengths(path: Path) -> Iterator[tuple[str, int]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            yield node.name, node.end_lineno - node.lineno + 1


# --------------------------------------------------------------------------- the package


def test_imports_run_one_way_and_have_no_cycle() -> None:
    found = violations(PACKAGE, RANKS, ALLOWED_UPWARD)
    assert not found, "\n".join(found)


def test_each_wing_has_a_docstring_that_says_what_it_owns() -> None:
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "knows nothing of" in doc, f"{init}: say what the wing owns and what it knows nothing of"
        assert len(init.read_text().splitlines()) <= 40, f"{init} should stay a short face of its wing"


def test_rooms_stay_small() -> None:
    too_big = []
    for name, path in modules(PACKAGE).items():
        lines = len(path.read_text().splitlines())
        limit = MAX_FACADE_LINES if name == "kvsearch.database" else MAX_MODULE_LINES
        if lines > limit:
            too_big.append(f"{name}: {lines} lines (at most {limit})")
        too_big += [
            f"{name}.{cls}: {n} lines (at most {MAX_CLASS_LINES})"
            for cls, n in class_lengths(path)
            if n > MAX_CLASS_LINES
        ]
    assert not too_big, "split by job:\n" + "\n".join(too_big)


# --------------------------------------------------------------------------- the checker itself, on planted trees


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "kvsearch"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


TYPE_CHECKING_BLOCK = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
PLANT_RANKS = [("errors",), ("storage",), ("database",), ("cli", "integrations"), ("kvsearch",)]


def test_checker_accepts_downward_imports(tmp_path: Path) -> None:
    root = plant(
        tmp_path,
        {
            "errors.py": "",
            "storage/__init__.py": "",
            "storage/store.py": "from kvsearch.errors import X\nfrom kvsearch.storage import chunks\n",
            "storage/chunks.py": "import kvsearch.errors\n",
            "database.py": "from kvsearch.storage.store import Store\n",
            "cli/__init__.py": "from kvsearch.cli.main import main\n",
            "cli/main.py": "def main():\n    from kvsearch.database import Database\n",
        },
    )
    assert violations(root, PLANT_RANKS, {}) == []


@pytest.mark.parametrize(
    "files, expected",
    [
        # a planted upward import at module level
        ({"storage/store.py": "from kvsearch.database import Database\n"}, "'database' is above it"),
        # ... and inside a function (a cycle dodged by a lazy import is still an upward dependency)
        ({"storage/store.py": "def f():\n    from kvsearch.database import D\n"}, "'database' is above it"),
        # ... as a relative import
        ({"storage/store.py": "from ..database import Database\n"}, "'database' is above it"),
        # ... under TYPE_CHECKING (an annotation naming a higher module's class: an upward reference)
        ({"storage/store.py": TYPE_CHECKING_BLOCK + "    from kvsearch.database import D\n"}, "'database' is above it"),
        (
            {"storage/store.py": "import typing\nif typing.TYPE_CHECKING:\n    import kvsearch.database\n"},
            "is above it",
        ),
        # a sibling of the same rank
        ({"cli/main.py": "import kvsearch.integrations.lc\n", "integrations/lc.py": ""}, "its sibling"),
        # a cycle inside one wing
        (
            {
                "storage/store.py": "from kvsearch.storage import chunks\n",
                "storage/chunks.py": "import kvsearch.storage.store\n",
            },
            "import cycle",
        ),
        # a module of a wing that has no rank
        ({"ann/__init__.py": ""}, "has no rank"),
    ],
)
def test_checker_fails_on_a_planted_import(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    base = {
        "errors.py": "",
        "storage/__init__.py": "",
        "storage/store.py": "",
        "storage/chunks.py": "",
        "database.py": "",
        "cli/__init__.py": "",
        "cli/main.py": "",
        "integrations/__init__.py": "",
    }
    root = plant(tmp_path, {**base, **files})
    found = violations(root, PLANT_RANKS, {})
    assert any(expected in v for v in found), found


def test_checker_finds_type_checking_imports_and_skips_listed_exceptions(tmp_path: Path) -> None:
    files = {
        "errors.py": "",
        "storage/__init__.py": "",
        "storage/store.py": "import typing\nif typing.TYPE_CHECKING:\n    from kvsearch.database import D\n",
        "storage/chunks.py": "def plot():\n    import kvsearch.database\n",
        "database.py": "",
    }
    root = plant(tmp_path, files)
    found = violations(root, PLANT_RANKS, {})
    assert len(found) == 2, found  # the TYPE_CHECKING one and the lazy one, until it is listed with a reason
    assert any(v.startswith("kvsearch.storage.store:3 imports kvsearch.database") for v in found), found
    allowed = {("kvsearch.storage.chunks", "kvsearch.database"): "an optional extra"}
    found = violations(root, PLANT_RANKS, allowed)
    assert len(found) == 1 and found[0].startswith("kvsearch.storage.store:3"), found
    allowed[("kvsearch.storage.store", "kvsearch.database")] = "listed by name with why"
    assert violations(root, PLANT_RANKS, allowed) == []


def test_type_checking_imports_make_no_cycle(tmp_path: Path) -> None:
    # they never run: a module-level import one way and a TYPE_CHECKING one back is no cycle (nor is the else branch
    # of a TYPE_CHECKING block skipped: it runs)
    files = {
        "errors.py": "",
        "storage/__init__.py": "",
        "storage/store.py": "from kvsearch.storage import chunks\n",
        "storage/chunks.py": TYPE_CHECKING_BLOCK + "    from kvsearch.storage.store import S\n",
        "database.py": "",
    }
    root = plant(tmp_path, files)
    assert violations(root, PLANT_RANKS, {}) == []
    files["storage/chunks.py"] += "else:\n    import kvsearch.storage.store\n"
    root = plant(tmp_path / "else", files)
    assert any("import cycle" in v for v in violations(root, PLANT_RANKS, {}))
