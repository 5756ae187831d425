"""The reference pages' generated parts, so the site cannot drift from the code.

A page holds a marker where a generated part goes (`<!-- generated: cli -->`), and mkdocs calls
`on_page_markdown` (mkdocs.yml: `hooks: [docs/hooks.py]`) to replace it:

    cli          every `meshplan` command and its options, from meshplan's own argument parsers
    grammar      every statement of the plan language, from grammar/plan.lark
    tables       the names the checker accepts: schedules, optimizers, compression, dtypes
    terminals    the grammar's terminals (NAME, INT, SIZE, PATTERN, ...)
    tensorboard  the metrics `run --tensorboard` writes and their tags

tests/test_docs.py calls `generate` itself and checks that every command and every statement is
there. This file is not part of the package: it runs where meshplan is installed.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from typing import Any

MARKER = re.compile(r"<!--\s*generated:\s*([a-z_]+)\s*-->")


def on_page_markdown(markdown: str, page: Any = None, config: Any = None, files: Any = None) -> str:
    """mkdocs' hook: each marker replaced by what it names."""
    return MARKER.sub(lambda m: generate(m.group(1)), markdown)


def generate(name: str) -> str:
    """The Markdown of one generated part (a `ValueError` names the known ones)."""
    if name not in GENERATORS:
        raise ValueError(f"unknown generated part {name!r}: one of {', '.join(GENERATORS)}")
    return GENERATORS[name]()


# ---------------------------------------------------------------------------- the CLI


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every `meshplan` subcommand's parser, `run` with the options `meshplan.options` defines."""
    from meshplan.main import build_parser
    from meshplan.options import build_parser as run_parser

    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = dict(sub.choices)
    run = run_parser()  # the subcommand's options, with their groups (torchrun's passed through)
    if "run" in commands:
        run.description, run.epilog = commands["run"].description, commands["run"].epilog
    commands["run"] = run
    return dict(sorted(commands.items(), key=lambda item: ORDER.index(item[0]) if item[0] in ORDER else 99))


# the order a reader meets them in the tutorial
ORDER = ["check", "explain", "compile", "inspect", "verify", "run", "estimate", "suggest", "diff", "fmt"]


def cli() -> str:
    out = []
    for name, parser in subcommands().items():
        # its prog is `meshplan NAME`; argparse indents the lines after the first under "usage: "
        usage = "\n".join(line[len("usage: ") :] for line in parser.format_usage().strip().splitlines())
        description = _escape(parser.description or "")
        out += [f"## meshplan {name}", "", description[:1].upper() + description[1:], ""]
        out += ["```text", usage, "```", ""]
        if parser.epilog:
            examples = parser.epilog.split("\n", 1)[-1]
            out += ["Examples:", "", "```text", _dedent(examples), "```", ""]
        for title, actions in _groups(parser):
            rows = [_option_row(a) for a in actions if a.help != argparse.SUPPRESS]
            if rows:
                out += [f"**{title}**", "", "| argument | meaning | default |", "|---|---|---|", *rows, ""]
    return "\n".join(out)


def _groups(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[argparse.Action]]]:
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        title = group.title or ""
        yield {"positional arguments": "Arguments", "options": "Options"}.get(title, title), actions


def _option_row(action: argparse.Action) -> str:
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    takes_value = action.nargs != 0
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    spelled = ", ".join(f"{o} {metavar}" if takes_value else o for o in action.option_strings) or metavar
    default = action.default
    hidden = default is None or default is False or default == argparse.SUPPRESS or isinstance(default, list)
    shown = "" if hidden else f"`{default}`"
    return f"| `{spelled}` | {_escape(action.help or '')} | {shown} |"


def _escape(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines)


# ---------------------------------------------------------------------------- the grammar


def grammar_rules() -> dict[str, tuple[str, list[str]]]:
    """plan.lark's rules: name -> (its definition, the comment lines right above it)."""
    from meshplan.grammar import grammar_text

    rules: dict[str, tuple[str, list[str]]] = {}
    comments: list[str] = []
    lines = grammar_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("//"):
            text = line[2:].strip()
            comments = [] if set(text) <= {"-", " "} or text.startswith("---") else [*comments, text]
            continue
        rule = re.match(r"^[!?]?([a-z_]+):", line)
        if rule is None:
            if not line.strip():
                comments = []
            continue
        body = [line]
        for more in lines[i + 1 :]:
            if not more.startswith(" "):
                break
            body.append(more)
        rules[rule.group(1)] = ("\n".join(body), comments)
        comments = []
    return rules


def _reachable(name: str, rules: dict[str, tuple[str, list[str]]]) -> list[str]:
    """The rules a statement uses, in grammar order, the shared `dtype` and `_over` included."""
    seen, todo = {name}, [name]
    while todo:
        text = rules[todo.pop()][0].split(":", 1)[1]
        for used in re.findall(r"\b([a-z_]+)\b", re.sub(r'"[^"]*"', "", text)):
            if used in rules and used not in seen:
                seen.add(used)
                todo.append(used)
    return [r for r in rules if r in seen]


def statements(rules: dict[str, tuple[str, list[str]]]) -> list[str]:
    """The statements a plan may hold, in the grammar's order (its `_statement` rule)."""
    return re.findall(r"\b[a-z_]+\b", rules["_statement"][0].split(":", 1)[1])


def grammar() -> str:
    rules = grammar_rules()
    out = ["A plan:", "", "```text", rules["start"][0], rules["_statement"][0], "```", ""]
    for statement in statements(rules):
        out += [f"### `{statement}`", "", "```text"]
        for rule in _reachable(statement, rules):
            text, comments = rules[rule]
            out += [*(f"// {c}" for c in comments), text]
        out += ["```", ""]
    return "\n".join(out)


def terminals() -> str:
    """plan.lark's terminals (NAME, INT, ...), each with the comment above it."""
    from meshplan.grammar import grammar_text

    out, comments = ["```text"], []
    for line in grammar_text().splitlines():
        if line.startswith("//") and not line.startswith("// ---"):
            comments.append(line)
        elif re.match(r"^[A-Z][A-Z_]*:", line) and not line.startswith("WS_INLINE"):
            out += [*comments, line]
            comments = []
        elif not line.strip():
            comments = []
    return "\n".join([*out, "```", ""])


def tables() -> str:
    from meshplan.dsl.settings import COMPRESS_METHODS, DTYPE_BITS
    from meshplan.grammar import OPTIMIZERS, SCHEDULES

    def args(defaults: dict[str, Any]) -> str:
        return ", ".join(f"`{k}={v:g}`" for k, v in defaults.items()) or "none"

    return "\n".join(
        [
            *_table("Pipeline schedules (`schedule = NAME`)", ["schedule"], [[f"`{s}`"] for s in SCHEDULES]),
            *_table(
                "Optimizers (`optimizer = NAME(KEY=VALUE, ...)`)",
                ["optimizer", "hyperparameters and defaults"],
                [[f"`{name}`", args(d)] for name, d in OPTIMIZERS.items()],
            ),
            *_table(
                "Gradient compression (`compress = NAME(KEY=VALUE, ...)`)",
                ["method", "arguments and defaults"],
                [[f"`{name}`", args(d)] for name, d in COMPRESS_METHODS.items()],
            ),
            *_table(
                "Dtypes (`compute`, `params`, `grads`, `reduce`, `precision DTYPE`)",
                ["dtype", "bits"],
                [[f"`{name}`", str(bits)] for name, bits in DTYPE_BITS.items()],
            ),
        ]
    )


def _table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return [*lines, *("| " + " | ".join(row) + " |" for row in rows), ""]


def tensorboard() -> str:
    from meshplan.tensorboard import SCALARS

    whose_words = {"run": "one curve for the run", "rank": "a run per rank"}
    rows = [[f"`{key}`", f"`{tag}`", whose_words[whose]] for key, (tag, whose) in SCALARS.items()]
    return "\n".join(_table("Scalars", ["metrics field", "TensorBoard tag", "written as"], rows))


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli,
    "grammar": grammar,
    "tables": tables,
    "terminals": terminals,
    "tensorboard": tensorboard,
}
