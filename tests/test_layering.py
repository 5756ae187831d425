"""The layering rules (STYLE.md, docs/ARCHITECTURE.md): `dsl` imports neither torch nor
`compiler` nor `runtime`; `runtime` imports neither `dsl` nor `compiler`, nor `examples` nor
the command line; `compiler` imports from `runtime` only the library compiled programs are
made of (collectives, device copies, the experts unit and stacked expert lists, ZeRO nodes, the mesh, how tensors are cut and parameters grouped,
pipeline schedules),
never the training loop, the engines, checkpoints or export; only `cli` composes them all.

Checked statically on every .py file under dsl/, compiler/ and runtime/ (so a lazy import inside
a function counts too), and at run time for the promise users see: `import meshplan.dsl`
does not load torch. The compiler never reaches up to the package root (`meshplan`: the command
line's home), the runtime draws no terminal UI (`rich`: the command line's), and no module
of the package is in an import cycle, counting imports inside functions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]

# the command line's modules and packages (`cli/` is the root package `meshplan`)
CLI = tuple(
    f"meshplan.{p.stem}"
    for p in sorted((REPO / "cli").iterdir())
    if (p.suffix == ".py" and p.stem != "__init__" and p.stem != "__main__") or (p / "__init__.py").is_file()
)
# folder -> its import name: the package's modules, whose imports must form no cycle
FOLDERS = {
    "cli": "meshplan",
    "dsl": "meshplan.dsl",
    "compiler": "meshplan.compiler",
    "runtime": "meshplan.runtime",
}
# what compiled programs are made of: the only runtime modules the compiler may import
PROGRAM_LIBRARY = {
    "collectives",
    "device_copy",
    "shared_cast",
    "experts",
    "expert_list",
    "hollow",
    "linears",
    "ring_attention",
    "zero_nodes",
    "mesh",
    "shards",
    "buckets",
    "schedules",
    "watchdog",  # what the collectives tell as they wait (and how they write a size)
    "__init__",
}
RUNTIME_ENGINE = tuple(
    f"meshplan.runtime.{p.stem}"
    for p in sorted((REPO / "runtime").glob("*.py"))
    if p.stem not in PROGRAM_LIBRARY
)

# folder -> (its import name, the import names it must not use, with their submodules)
RULES = {
    "dsl": ("meshplan.dsl", ("torch", "meshplan.compiler", "meshplan.runtime", "compiler", "runtime")),
    "runtime": (
        "meshplan.runtime",
        (
            "meshplan.dsl",
            "meshplan.compiler",
            "dsl",
            "compiler",
            "meshplan.examples",
            "examples",
            "rich",
            *CLI,
        ),
    ),
    "compiler": ("meshplan.compiler", (*RUNTIME_ENGINE, "meshplan.examples", *CLI)),
}


def imported_modules(source: str, module: str, *, is_package: bool, run_time: bool = False) -> set[str]:
    """Every module a source file imports, relative imports resolved against `module`,
    including `importlib.import_module("...")` / `__import__("...")` with a literal name.
    `run_time`: only those that run, not those for annotations under `if TYPE_CHECKING:`."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    tree = ast.parse(source)
    if run_time:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.If)
                and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
            ):
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                prefix = f"{base}.{node.module}" if node.module else base
            else:
                prefix = node.module or ""
            names.add(prefix)
            # `from meshplan import compiler` imports the module meshplan.compiler
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def _violations(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


def root_uses(source: str, module: str, *, is_package: bool) -> list[str]:
    """What a file takes from the package root `meshplan` itself (`from meshplan import
    __version__`, `import meshplan`), as opposed to its subpackages (`from meshplan import dsl`)."""
    subpackages = {f.split(".")[1] for f in FOLDERS.values() if "." in f} | {"grammar", "examples"}
    subpackages |= {name.split(".")[1] for name in CLI}
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "meshplan"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(
                    [*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])]
                )
            if base == "meshplan":
                found += [f"meshplan.{a.name}" for a in node.names if a.name not in subpackages]
    return found


def _module_name(path: Path, folder: str, package: str) -> tuple[str, bool]:
    rel = path.relative_to(REPO / folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts]), path.name == "__init__.py"


@pytest.mark.parametrize("folder", sorted(RULES))
def test_layering_static(folder: str) -> None:
    package, forbidden = RULES[folder]
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/: the check would prove nothing"
    problems = []
    for path in files:
        module, is_package = _module_name(path, folder, package)
        names = imported_modules(path.read_text(encoding="utf-8"), module, is_package=is_package)
        problems += [f"{path.relative_to(REPO)} imports {name}" for name in _violations(names, forbidden)]
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_the_compiler_never_imports_the_package_root() -> None:
    problems = []
    for path in sorted((REPO / "compiler").rglob("*.py")):
        module, is_package = _module_name(path, "compiler", "meshplan.compiler")
        uses = root_uses(path.read_text(encoding="utf-8"), module, is_package=is_package)
        problems += [f"{path.relative_to(REPO)} imports {name}" for name in uses]
    assert not problems, "the compiler reaches up to the command line's root:\n" + "\n".join(problems)


def package_imports() -> nx.DiGraph:
    """Module -> the package's modules it imports when it runs (anywhere in the file, not for
    annotations only), over every module of cli/, dsl/, compiler/ and runtime/. An imported name
    is credited to the longest module it names (`meshplan.compiler.capture.load_model` is
    `meshplan.compiler.capture`)."""
    files = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            files[_module_name(path, folder, package)] = path
    modules = {name for name, _ in files}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for (module, is_package), path in files.items():
        source = path.read_text(encoding="utf-8")
        for imported in imported_modules(source, module, is_package=is_package, run_time=True):
            name = imported
            while name and name not in modules:
                name = name.rpartition(".")[0]
            # a module's own package is imported before it in any case: `from . import ast` names
            # it only as where `ast` is found; `from . import Context` does use its `__init__`
            own_package = module.startswith(name + ".") and name == imported
            if name and name != module and not own_package:
                graph.add_edge(module, name)
    return graph


MAX_LINES = 700  # a module past this holds more than one idea: split it by idea, not by count


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {
        path.relative_to(REPO): len(path.read_text(encoding="utf-8").splitlines())
        for folder in FOLDERS
        for path in (REPO / folder).rglob("*.py")
    }
    assert len(sizes) > 50, "found almost no modules: the check would prove nothing"
    over = sorted(f"{path}: {n} lines" for path, n in sizes.items() if n > MAX_LINES)
    assert not over, f"modules over {MAX_LINES} lines:\n" + "\n".join(over)


def test_no_module_is_in_an_import_cycle() -> None:
    graph = package_imports()
    assert graph.number_of_edges() > 100, "the scanner found almost no imports: the check would prove nothing"
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle_through_an_import_inside_a_function() -> None:
    a = imported_modules(
        "def f():\n    from meshplan.run import cmd_run\n", "meshplan.main", is_package=False
    )
    b = imported_modules("from meshplan.main import main\n", "meshplan.run", is_package=False)
    graph = nx.DiGraph([("meshplan.main", "meshplan.run")] * ("meshplan.run" in a))
    graph.add_edges_from([("meshplan.run", "meshplan.main")] * ("meshplan.main" in b))
    assert not nx.is_directed_acyclic_graph(graph)


@pytest.mark.parametrize(
    ("source", "module", "found"),
    [
        ("import torch", "meshplan.dsl.parser", ["torch"]),
        ("import torch.nn as nn", "meshplan.dsl.parser", ["torch.nn"]),
        ("from torch import fx", "meshplan.dsl.parser", ["torch", "torch.fx"]),
        ("def f():\n    import torch\n", "meshplan.dsl.parser", ["torch"]),
        (
            "from ..compiler import capture",
            "meshplan.dsl.parser",
            ["meshplan.compiler", "meshplan.compiler.capture"],
        ),
        ("from .. import runtime", "meshplan.dsl.parser", ["meshplan.runtime"]),
        ("from meshplan import compiler", "meshplan.dsl.check", ["meshplan.compiler"]),
        ("importlib.import_module('torch')", "meshplan.dsl.check", ["torch"]),
        ("from . import ast", "meshplan.dsl.parser", []),
        ("import torchvision", "meshplan.dsl.parser", []),  # a prefix of the name is not the package
        ("from meshplan.dsl.errors import Span", "meshplan.dsl.check", []),
    ],
)
def test_the_import_scanner_sees_forbidden_imports(source: str, module: str, found: list[str]) -> None:
    """The static check is only as good as its scanner: it must see every spelling."""
    names = imported_modules(source, module, is_package=False)
    assert _violations(names, RULES["dsl"][1]) == found


def test_the_scanner_resolves_relative_imports_from_packages_and_modules() -> None:
    # in meshplan/runtime/__init__.py and in meshplan/runtime/mesh.py alike, `..` is `meshplan`
    for module, is_package in [("meshplan.runtime", True), ("meshplan.runtime.mesh", False)]:
        names = imported_modules("from ..dsl import parse", module, is_package=is_package)
        assert _violations(names, RULES["runtime"][1]) == ["meshplan.dsl", "meshplan.dsl.parse"]
    names = imported_modules("from . import mesh", "meshplan.runtime", is_package=True)
    assert names == {"meshplan.runtime", "meshplan.runtime.mesh"}


def test_importing_and_using_the_dsl_does_not_load_torch() -> None:
    examples = sorted((REPO / "examples").glob("*.plan"))
    assert examples
    script = textwrap.dedent(
        f"""
        import sys
        import meshplan.dsl
        from meshplan.dsl import load_plan, parse
        from meshplan.dsl.fmt import format_plan
        for path in {[str(p) for p in examples]!r}:
            plan = load_plan(path)
            text = open(path, encoding="utf-8").read()
            format_plan(parse(text), text)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or
                        m.startswith(("meshplan.compiler", "meshplan.runtime")))
        print(loaded)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd="/", check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_command_line_parses_and_formats_without_loading_torch() -> None:
    """`meshplan fmt` and `--help` are the language's: its parser (every command's options) is
    built, and a plan formatted, without torch (2.4 s of a 2.8 s `fmt --check` until a command's
    default and `verify`'s module were read from torch's side)."""
    script = textwrap.dedent(
        f"""
        import contextlib, io, sys
        from meshplan.main import build_parser, main
        build_parser().format_help()
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["fmt", "--check", {str(REPO / "examples" / "tiny_dp.plan")!r}]) == 0
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd="/", check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_compiler_may_use_the_program_library_but_not_the_engines() -> None:
    forbidden = RULES["compiler"][1]
    uses = imported_modules(
        "from meshplan.runtime.collectives import COLLECTIVES\nfrom meshplan.runtime.shards import Cut\n"
        "from meshplan.runtime.train import make_optimizer\nfrom ..runtime import zero\n",
        "meshplan.compiler.compile",
        is_package=False,
    )
    assert _violations(uses, forbidden) == [
        "meshplan.runtime.train",
        "meshplan.runtime.train.make_optimizer",
        "meshplan.runtime.zero",
    ]
