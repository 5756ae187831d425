"""docs/ARCHITECTURE.md describes the house as it is: its module map lists every module of
cli/, dsl/, compiler/ and runtime/, and nothing else, and its table of passes is
`compiler.compile.PASSES` in order."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ARCHITECTURE.md"
FOLDERS = ("dsl", "compiler", "runtime", "cli")


def module_map(text: str) -> dict[str, set[str]]:
    """folder -> the modules its table under `## Module map` lists (first cell, in backticks)."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, set[str]] = {}
    for block in re.split(r"^### ", section, flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        folder = heading.strip().strip("`").rstrip("/")
        listed[folder] = set(re.findall(r"^\| `([^`]+)` \|", body, flags=re.M))
    return listed


def test_the_module_map_is_the_tree() -> None:
    listed = module_map(DOC.read_text(encoding="utf-8"))
    assert set(listed) == set(FOLDERS), f"one table per folder: {sorted(listed)}"
    problems = []
    for folder in FOLDERS:
        tree = {p.relative_to(REPO / folder).as_posix() for p in (REPO / folder).rglob("*.py")}
        assert len(tree) > 5, f"found almost no modules under {folder}/: the check would prove nothing"
        problems += [f"{folder}/{m} is not in the module map" for m in sorted(tree - listed[folder])]
        problems += [
            f"the module map lists {folder}/{m}, which does not exist" for m in sorted(listed[folder] - tree)
        ]
    assert not problems, "\n".join(problems)


def test_the_map_reader_finds_rows_under_their_folder() -> None:
    text = "## Module map\n\n### `dsl/`\n\n| module | owns |\n|---|---|\n| `ast.py` | the tree |\n\n## Next\n| `x.py` | no |\n"
    assert module_map(text) == {"dsl": {"ast.py"}}


def test_the_architecture_lists_the_passes_in_order() -> None:
    """The table of passes is `compiler.compile.PASSES`, in order."""
    from meshplan.compiler.compile import PASSES

    table = DOC.read_text(encoding="utf-8").split("### The passes", 1)[1].split("###", 1)[0]
    listed = [
        line.split("|")[2].strip().strip("`")
        for line in table.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ]
    assert listed == [p.name for p in PASSES]
