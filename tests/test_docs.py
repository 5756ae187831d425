"""The documentation is tested: every plan it shows passes `meshplan check`, every command it
shows parses with meshplan's own argument parsers and runs, so a renamed flag, a stale plan or
a changed command fails here, not a reader.

What is read: README.md and every Markdown file under docs/, their fenced blocks. A `bash`
block's lines are commands (a `# comment` after one is the reader's, `&&` chains several); a
block holding a plan (tagged `plan`, or an untagged one whose first statement is `mesh`) is a
plan, and one that names its example file in its first comment (`# examples/llama_3d.plan:`)
must be that file's plan.

How commands run: each document's commands in order, in one folder of their own (the
repository's `examples/` linked into it), so a command may use what an earlier one made
(`compile -o build/x`, then `inspect build/x`; a run, then its `--resume`). A training run is
shortened (and started over where it does not `--resume`: the runs a page shows are
alternatives, most in their plan's default `--out`), its step counts (`--steps`, `--save-every`, `--log-every`, default 200 steps)
divided by `STEP_SCALE`, so that a resumed run still finds the checkpoint the first one saved.
A block is skipped only where the HTML comment right above it says why:
`<!-- docs-test: skip, needs several nodes -->`, `<!-- docs-test: skip, needs a GPU -->` or
`<!-- docs-test: skip, a benchmark (minutes) -->` (`bench/` runs those, not the tests); a
block whose commands end with another exit status says which (`<!-- docs-test: exits 1 -->`:
`meshplan diff` of two plans that differ); a
command naming files the reader brings (`my.plan`, `hf.py`) that no earlier command made is
skipped with that reason; the install commands (`pip`, `pytest`) are what CI runs itself. A
block with a title (```` ```python title="hf.py" ````, Material for MkDocs' spelling) is a file
the reader saves: it is written into the folder where the reader meets it, so the commands after
it can use it. A block of output right under a command block (only blank lines or markers
between) is what that command printed: each line it shows must be printed, in order (`...`
stands for what the page leaves out; `<!-- docs-test: numbers vary (why) -->` above it where
timings or rounding make the numbers the machine's), so a changed output fails here too.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gloo_pool import shared_processes

from meshplan.dsl import PlanError, check_text
from meshplan.runtime import launch

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
STEP_SCALE = 25
DEFAULT_STEPS = 200  # `meshplan run`'s
SKIP = re.compile(
    r"<!--\s*docs-test:\s*skip,\s*((?:needs several nodes|needs a GPU|a benchmark)[^>]*?)\s*-->"
)
EXITS = re.compile(r"<!--\s*docs-test:\s*exits (\d+)")
NUMBER = r"[-+]?\d[\d,.]*(?:e[-+]?\d+)?"  # 7,905 / 5.5560 / 1.50e-04
MARKER = re.compile(r"^\s*<!--\s*docs-test:")
INSTALL = ("pip", "pytest")
# arguments that name what a command writes: never required to exist before it
OUTPUT_FLAGS = ("-o", "--out", "--export", ">")


@dataclass(frozen=True)
class Block:
    document: Path
    line: int  # of the opening fence
    info: str  # the fence's tag: bash, python, plan, or ""
    text: str
    skip: str | None  # the reason the comment above it gives
    exits: int = 0  # the exit status its commands end with (`<!-- docs-test: exits 1 -->`)
    title: str | None = None  # ```python title="hf.py"```: the file the reader saves it as
    follows: bool = False  # right after the block before it (blank lines and markers between)
    numbers_vary: bool = False  # an output whose numbers are the machine's (`docs-test: numbers vary`)

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def blocks(document: Path) -> list[Block]:
    found, lines = [], document.read_text().splitlines()
    i, last_end = 0, None
    while i < len(lines):
        fence = re.match(r"^(```+)\s*(\S*)(?:.*?\btitle=\"([^\"]+)\")?", lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip, exits = SKIP.search(above), EXITS.search(above)
        text = "\n".join(lines[i + 1 : end])
        between = lines[last_end + 1 : i] if last_end is not None else ["prose"]
        follows = all(not line.strip() or MARKER.match(line) for line in between)
        found.append(
            Block(
                document,
                i + 1,
                fence.group(2),
                text,
                skip and skip.group(1),
                int(exits.group(1)) if exits else 0,
                fence.group(3),
                follows,
                "numbers vary" in above,
            )
        )
        i, last_end = end + 1, end
    return found


ALL_BLOCKS = [b for d in DOCUMENTS for b in blocks(d)]


def is_plan(block: Block) -> bool:
    if block.info == "plan":
        return True
    statements = [line for line in block.text.splitlines() if line.strip() and not line.startswith("#")]
    return block.info == "" and bool(statements) and statements[0].startswith("mesh ")


@dataclass(frozen=True)
class Command:
    block: Block
    argv: tuple[str, ...]
    line: int

    @property
    def where(self) -> str:
        return f"{self.block.document.relative_to(ROOT)}:{self.line}"


def commands(block: Block) -> list[Command]:
    """A bash block's commands: each line (with `\\` continuations), its comment dropped, `&&`
    chains split."""
    found, pending, start = [], "", 0
    for offset, line in enumerate(block.text.splitlines(), start=block.line + 1):
        if not pending:
            start = offset
        pending += line.rstrip("\\") + " "
        if line.endswith("\\"):
            continue
        words = shlex.split(pending, comments=True)
        pending = ""
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(Command(block, tuple(words[:cut]), start))
            words = words[cut + 1 :]
    return found


ALL_COMMANDS = [c for b in ALL_BLOCKS if b.info == "bash" for c in commands(b)]


# ---------------------------------------------------------------------------- plans


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if is_plan(b)], ids=lambda b: b.where)
def test_every_plan_shown_checks(block: Block) -> None:
    plan = check_text(block.text, path=block.where)  # raises PlanError with the located message
    assert plan.mesh.axes
    named = re.match(r"#\s*(examples/\S+\.plan)", block.text)
    if named:
        assert statements(block.text) == statements((ROOT / named.group(1)).read_text()), (
            f"{block.where} is not {named.group(1)}"
        )


def statements(plan: str) -> list[str]:
    """A plan's lines without comments and blank lines: what it says, not how it explains it."""
    return [kept for line in plan.splitlines() if (kept := line.partition("#")[0].rstrip())]


# ---------------------------------------------------------------------------- commands, parsed


def meshplan_argv(command: Command) -> list[str] | None:
    """The arguments after `meshplan` (`torchrun ... -m meshplan.run` is `run`), or None."""
    argv = list(command.argv)
    if argv[:1] == ["meshplan"]:
        return argv[1:]
    if argv[:1] == ["torchrun"] and "meshplan.run" in argv:
        return ["run", *argv[argv.index("meshplan.run") + 1 :]]
    return None


@pytest.mark.parametrize(
    "command", [c for c in ALL_COMMANDS if meshplan_argv(c) is not None], ids=lambda c: c.where
)
def test_every_command_shown_parses(command: Command) -> None:
    """meshplan's own parsers take the command as shown: no renamed command or flag."""
    argv = _before_redirect(meshplan_argv(command) or [])
    assert parses(argv), f"{command.where}: `meshplan {shlex.join(argv)}` does not parse"


def parses(argv: list[str]) -> bool:
    from meshplan.main import build_parser
    from meshplan.options import parse

    try:
        if argv[0] == "run":
            parse(argv[1:])
        else:
            build_parser().parse_args(argv)
    except SystemExit:
        return False
    return True


def help_examples() -> list[tuple[str, list[str]]]:
    """Every command's `--help` examples: (command, the example's words after `meshplan`)."""
    from meshplan.main import build_parser

    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for name, parser in sub.choices.items():
        for line in (parser.epilog or "").splitlines()[1:]:  # under "example:"
            words = shlex.split(line, comments=True)
            if words[:1] == ["meshplan"]:
                found.append((name, words[1:]))
    return found


def test_every_help_example_parses_and_names_files_that_exist() -> None:
    """`meshplan COMMAND --help` shows examples: each one parses, and the examples it names are there."""
    examples = help_examples()
    assert {name for name, _ in examples} >= {"check", "explain", "compile", "run", "verify", "suggest"}
    for name, argv in examples:
        assert parses(_before_redirect(argv)), f"`meshplan {name} --help`: {shlex.join(argv)}"
        for word in argv:
            path = word.partition(":")[0]
            assert not path.startswith("examples/") or "*" in path or (ROOT / path).exists(), word


def test_the_checks_catch_a_renamed_flag_and_a_stale_plan(tmp_path: Path, capsys) -> None:
    """The tests above can fail: a flag the parsers do not know, a plan the checker refuses."""
    page = Block(ROOT / "README.md", 1, "bash", "meshplan run examples/tiny_dp.plan --stepz 3  # typo", None)
    (typo,) = commands(page)
    assert typo.argv == ("meshplan", "run", "examples/tiny_dp.plan", "--stepz", "3")
    assert not parses(list(typo.argv[1:])) and parses(["check", "examples/tiny_dp.plan"])
    with pytest.raises(PlanError):
        check_text("mesh tp=2\nmodules {\n    q_proj: colum over tp\n}\n")
    assert statements("mesh tp=2  # two\n\n# a comment\n") == ["mesh tp=2"]
    page = tmp_path / "page.md"
    page.write_text(
        'Save it:\n\n```python title="hf.py"\nx = 1\n```\n\n```bash\nmeshplan check my.plan\n```\n'
    )
    saved, shown = blocks(page)
    assert (saved.title, saved.text, shown.title) == ("hf.py", "x = 1", None)
    # an output shown under a command: its lines, in order, or the test names the one missing
    printed = "hf.plan: ok\n  mesh       tp=2  (2 ranks)\nstep 3/50  loss 5.1  4,210 tok/s\n"
    assert shows("hf.plan: ok\n...\n  mesh tp=2 ...", printed, numbers_vary=False) is None
    assert shows("  mesh tp=4  (4 ranks)", printed, numbers_vary=False) == "  mesh tp=4  (4 ranks)"
    assert shows("step 1/50  loss 5.5560  7,905 tok/s", printed, numbers_vary=True) is None
    assert shows("step 1/50  loss 5.5  7 tok/s", printed, numbers_vary=False) is not None
    capsys.readouterr()  # argparse's own message


def _before_redirect(argv: list[str]) -> list[str]:
    return argv[: argv.index(">")] if ">" in argv else argv


# ---------------------------------------------------------------------------- commands, run


def shortened(argv: list[str]) -> list[str]:
    """A `meshplan run` at `STEP_SCALE` times fewer steps (see the module docstring)."""
    argv = list(argv)
    for flag in ("--steps", "--save-every", "--log-every"):
        if flag in argv:
            i = argv.index(flag) + 1
            argv[i] = str(max(1, math.ceil(int(argv[i]) / STEP_SCALE)))
    if "--steps" not in argv:
        argv += ["--steps", str(DEFAULT_STEPS // STEP_SCALE)]
    # the commands of a page are alternatives, each starting its own run in the default --out,
    # except the one that continues a run
    return argv if "--resume" in argv else [*argv, "--overwrite"]


def readers_files(argv: list[str], cwd: Path) -> list[str]:
    """The files a command reads that are not there: the reader's own."""
    missing = []
    for before, word in zip(["", *argv], argv, strict=False):
        if before in OUTPUT_FLAGS or word.startswith("-"):
            continue
        path = word.partition(":")[0]
        if re.search(r"\.(plan|py|pt|safetensors)$|/$", path) and not (cwd / path).exists():
            missing.append(path)
    return missing


def runnable(document: Path) -> list[Command | Block]:
    """The document's commands, and the files it has the reader save (a block with a `title`),
    in the order a reader meets them."""
    steps: list[Command | Block] = []
    previous = None
    for block in (b for b in ALL_BLOCKS if b.document == document):
        if block.info == "bash":
            steps += commands(block)
        elif block.title or is_output(block, previous):
            steps.append(block)
        previous = block
    return steps


def is_output(block: Block, previous: Block | None) -> bool:
    """Whether `block` shows what the command block right above it printed."""
    return (
        previous is not None
        and previous.info == "bash"
        and block.follows
        and block.info in ("", "text", "console")
        and not block.title
        and not is_plan(block)
    )


def shows(shown: str, printed: str, *, numbers_vary: bool) -> str | None:
    """None when every line `shown` appears in `printed`, in order (`...`, a line of it or in a
    line, stands for what the page leaves out; spacing is not compared, nor, where they vary,
    numbers, nor then the width of a table's rules, which follows its numbers); else the first
    line that does not."""

    def normal(line: str) -> str:
        line = " ".join(line.split())
        return re.sub("─+", "─", line) if numbers_vary else line

    lines = [normal(line) for line in printed.splitlines()]
    at = 0
    for line in shown.splitlines():
        want = normal(line)
        if not want or want == "...":
            continue
        pattern = ".*".join(  # `...` in a line: what the page leaves out of it
            NUMBER.join(re.escape(p) for p in (re.split(NUMBER, piece) if numbers_vary else [piece]))
            for piece in want.split("...")
        )
        found = next((i for i in range(at, len(lines)) if re.fullmatch(pattern, lines[i])), None)
        if found is None:
            return line
        at = found + 1
    return None


# the documents whose commands run here; the others' in tests/test_docs_run.py: `--dist loadfile`
# gives a module to one worker, and the documents' runs together are the suite's longest chain
RUN_HERE = (
    "docs/tutorial.md",
    "docs/how-to/weights.md",
    "docs/how-to/faults.md",
    "docs/how-to/tensorboard.md",
)


def run_here(document: Path) -> bool:
    return str(document.relative_to(ROOT)) in RUN_HERE


@pytest.mark.slow
@pytest.mark.parametrize(
    "document", [d for d in DOCUMENTS if run_here(d)], ids=lambda d: str(d.relative_to(ROOT))
)
def test_every_command_shown_runs(document: Path, tmp_path: Path, monkeypatch, capfd) -> None:
    run_document(document, tmp_path, monkeypatch, capfd)


def run_document(document: Path, tmp_path: Path, monkeypatch, capfd) -> None:
    """Each command of the document, in order, ends as the document says (see the module
    docstring). `meshplan` runs in this process, as its console script would (`main`), the rest
    as processes; measured hardware goes to a folder of the test's own."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("MESHPLAN_CONFIG", str(tmp_path / "config"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # `python -m bench...` from here
    skipped, timings, ran = [], [], set()
    printed: str | None = None  # what the last command run printed
    for command in runnable(document):
        if isinstance(command, Block) and command.title:  # a file the reader saves
            (tmp_path / str(command.title)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / str(command.title)).write_text(command.text + "\n")
            continue
        if isinstance(command, Block):  # what the command above printed, as the page shows it
            if printed is not None:
                missing = shows(command.text, printed, numbers_vary=command.numbers_vary)
                assert missing is None, f"{command.where}: not printed: {missing!r}\n{printed}"
            continue
        printed = None
        argv = list(command.argv)
        if command.block.skip:
            skipped.append(f"{command.where}: {command.block.skip}")
            continue
        if argv[0] in INSTALL or tuple(argv) in ran:
            continue  # the install and the tests (CI runs them as the README says), or shown twice
        ran.add(tuple(argv))
        missing = readers_files(argv, tmp_path)
        if missing:
            skipped.append(f"{command.where}: uses the reader's own {', '.join(missing)}")
            continue
        mp = meshplan_argv(command)
        if mp is not None and mp[0] == "run":
            argv = [*argv[: len(argv) - len(mp) + 1], *shortened(mp[1:])]
        out = None
        if ">" in argv:
            out, argv = tmp_path / argv[argv.index(">") + 1], argv[: argv.index(">")]
        started = time.monotonic()
        status, stdout, stderr = execute(argv, capfd)
        assert status == command.block.exits, f"{command.where}: {shlex.join(argv)}\n{stdout}\n{stderr}"
        printed = stdout + stderr
        timings.append(f"{time.monotonic() - started:5.1f} s  {command.where}")
        if out is not None:
            out.write_text(stdout)
    print("\n".join([*skipped, *timings]))


def execute(argv: list[str], capfd) -> tuple[int, str, str]:
    """Run one command: its exit status, stdout and stderr."""
    from meshplan.main import main

    capfd.readouterr()
    if argv[0] == "meshplan":
        with kept_processes_here():
            status = main(argv[1:])
        return (status, *capfd.readouterr())
    program = [sys.executable] if argv[0] == "python" else [argv[0]]
    done = subprocess.run([*program, *argv[1:]], capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout, done.stderr


@contextlib.contextmanager
def kept_processes_here() -> Iterator[None]:
    """Within: the ranks `meshplan verify` spawns are the session's kept gloo processes
    (tests/gloo_pool.py, as tests/cli/test_verify.py runs it), not new ones that import torch
    again; each job runs in this folder, as new processes would (`--model hf.py:build` is
    relative to it). `run` still starts torchrun and its workers."""
    folder = os.getcwd()
    with shared_processes():
        kept = launch.spawn
        launch.spawn = lambda fn, world_size, args=(), **kw: kept(  # type: ignore[assignment]
            _in_folder, world_size, (folder, fn, args), **kw
        )
        try:
            yield
        finally:
            launch.spawn = kept


def _in_folder(rank: int, world_size: int, folder: str, fn, args: tuple):
    """A job on a kept process, run in `folder`; the process's own folder back after it."""
    back = os.getcwd()
    os.chdir(folder)
    try:
        return fn(rank, world_size, *args)
    finally:
        os.chdir(back)


# ---------------------------------------------------------------------------- the generated reference


def test_the_generated_reference_names_every_command_and_statement() -> None:
    """docs/hooks.py writes the reference pages' generated parts from meshplan's own parsers and
    grammar: every subcommand, every option, every statement and every table's name is there,
    and every marker a page holds names a part the hook knows."""
    import importlib.util

    from meshplan.dsl.settings import COMPRESS_METHODS
    from meshplan.grammar import OPTIMIZERS, SCHEDULES, grammar_text
    from meshplan.main import build_parser

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)

    cli = hooks.generate("cli")
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in [*sub.choices, "run"]:
        assert f"## meshplan {name}\n" in cli, f"`meshplan {name}` is not in the CLI reference"
    for name, parser in hooks.subcommands().items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:  # hidden on purpose (the launcher's own)
                continue
            for flag in action.option_strings:
                assert flag in cli or flag in ("-h", "--help"), f"`meshplan {name} {flag}` is not documented"

    grammar = hooks.generate("grammar")
    statements = re.findall(r"^_statement:(.*?)\n\n", grammar_text(), flags=re.M | re.S)[0]
    for statement in re.findall(r"\b[a-z_]+\b", statements):
        assert f"### `{statement}`" in grammar, f"statement `{statement}` is not in the language reference"
    for rule in re.findall(r"^[!?]?([a-z][a-z_]*):", grammar_text(), flags=re.M):
        assert re.search(rf"^[!?]?{rule}:", grammar, flags=re.M), f"grammar rule `{rule}` is not shown"

    tables = hooks.generate("tables")
    for name in [*SCHEDULES, *OPTIMIZERS, *COMPRESS_METHODS]:
        assert f"`{name}`" in tables, name

    for document in DOCUMENTS:
        for marker in hooks.MARKER.findall(document.read_text()):
            assert hooks.generate(marker), f"{document.relative_to(ROOT)}: empty generated part {marker!r}"
    with pytest.raises(ValueError, match="unknown generated part"):
        hooks.generate("nothing")
