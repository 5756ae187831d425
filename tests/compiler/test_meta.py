"""`compiler/meta.py` is the only door to meshplan's node facts: no other module of the compiler
or the CLI indexes a `.meta` with a `meshplan.*` key (a key constant, under any alias, or the
string itself); they call meta.py's accessors."""

from __future__ import annotations

import ast
from pathlib import Path

from meshplan.compiler import meta

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    name for name, value in vars(meta).items() if isinstance(value, str) and value.startswith("meshplan.")
}


def raw_accesses(source: str) -> list[int]:
    """The lines of `source` that index a `.meta` with a meshplan key: `x.meta[KEY]`,
    `x.meta.get(KEY)` (and `setdefault`, `pop`), `KEY in x.meta`, where KEY is one of meta.py's
    constants as imported here (from any module, under any alias) or a `"meshplan."` string."""
    tree = ast.parse(source)
    names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name in KEYS
    }

    def is_key(e: ast.expr) -> bool:
        if isinstance(e, ast.Constant):
            return isinstance(e.value, str) and e.value.startswith("meshplan.")
        if isinstance(e, ast.Attribute):  # meta.COLLECTIVE
            return e.attr in KEYS
        return isinstance(e, ast.Name) and e.id in names

    def is_meta(e: ast.expr) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == "meta") or (
            isinstance(e, ast.Name) and e.id == "meta"
        )

    def indexed_with(node: ast.AST) -> ast.expr | None:
        """The key a `.meta` is indexed with at `node`, if `node` indexes one."""
        if isinstance(node, ast.Subscript) and is_meta(node.value):
            return node.slice
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "setdefault", "pop")
            and is_meta(node.func.value)
            and node.args
        ):
            return node.args[0]
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], (ast.In, ast.NotIn))
            and is_meta(node.comparators[0])
        ):
            return node.left
        return None

    return sorted(n.lineno for n in ast.walk(tree) if (key := indexed_with(n)) is not None and is_key(key))


def test_scanner_finds_every_form_of_raw_access():
    source = """
from .meta import COLLECTIVE, MODULE as PATH_KEY
from .graph import PLACEMENT
from . import meta

a = node.meta[COLLECTIVE]
b = node.meta.get(PATH_KEY, "")
node.meta.setdefault(meta.PLACEMENT, {})
c = gm.meta["meshplan.stages"]
d = COLLECTIVE in node.meta
e = node.meta.get(PLACEMENT, {})
f = node.meta["val"]  # export's own: not meshplan's
g = meta.collective(node)
"""
    assert raw_accesses(source) == [6, 7, 8, 9, 10, 11]


def test_only_meta_py_touches_meshplan_facts():
    sources = [p for folder in ("compiler", "cli") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(sources) > 20
    found = {
        f"{p.relative_to(ROOT)}:{line}"
        for p in sources
        if p != ROOT / "compiler" / "meta.py"
        for line in raw_accesses(p.read_text())
    }
    assert not found, "read and write node facts through compiler/meta.py's accessors"
