"""Each pass's effect, pinned: the graph before and after it, as a unified diff checked in at
`golden/passes/<pass>.diff`. A pass that changes what it emits fails here with the change;
if it is meant, regenerate and read the new diffs:

    MESHPLAN_ACCEPT=1 pytest -n0 tests/compiler/test_pass_golden.py

The graphs are watched through `compile_plan(..., observe=...)` as the real pipeline runs, so
each diff is a pass's rewrite of what the passes before it left (the overlap pass groups
the collectives the tensor-parallel pass inserted). One small plan per pass, on 2-layer
models, chosen so that the pass rewrites; plans shared by several passes compile once.
"""

from __future__ import annotations

import difflib
import functools
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from expect import expect
from plans import data_parallel, llama_rules, llama_sequence, plan
from torch import fx, nn

from meshplan.compiler.compile import PASSES, compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.meta import STAGE, STAGES
from meshplan.dsl import check_text
from meshplan.examples.models import llama, moe

GOLDEN = Path(__file__).resolve().parent / "golden" / "passes"
EXPERTS = "\n    layers.*.mlp.experts: experts over ep (top_k=2)\n"


@dataclass(frozen=True)
class Case:
    """A plan and the model it compiles for; `about` names the model in the golden's header."""

    text: str
    build: Callable[[], nn.Module]
    about: str


CASES = {
    "llama_tp_sp": Case(
        plan(llama_rules() + llama_sequence()),
        lambda: llama.build(num_hidden_layers=2),
        "examples/models/llama.py:build, 2 layers",
    ),
    # bf16 compute with an fp32 region, a checkpointed layer, ZeRO-3 gathering in bf16
    "llama_mixed_zero3": Case(
        plan(
            "\n    norm:     precision fp32\n    layers.1: checkpoint\n",
            mesh="dp=2",
            extra=data_parallel(zero=3),
        )
        + "\nprecision {\n    compute = bf16\n}\n",
        lambda: llama.build(num_hidden_layers=2),
        "examples/models/llama.py:build, 2 layers",
    ),
    "llama_pipeline": Case(
        "mesh pp=2\n\npipeline over pp {\n    microbatches = 2\n}\n",
        lambda: llama.build(num_hidden_layers=2),
        "examples/models/llama.py:build, 2 layers",
    ),
    # the LM head held on the host under data parallelism
    "llama_on_cpu": Case(
        plan("\n    lm_head: on cpu\n", mesh="dp=2", extra=data_parallel(zero=0)),
        lambda: llama.build(num_hidden_layers=2),
        "examples/models/llama.py:build, 2 layers",
    ),
    "moe_ep": Case(
        plan(EXPERTS, mesh="ep=2"),
        lambda: moe.build(num_hidden_layers=2),
        "examples/models/moe.py:build, 2 layers of 4 experts",
    ),
    "moe_listed_ep": Case(
        plan(EXPERTS, mesh="ep=2"),
        lambda: moe.build_listed(num_hidden_layers=2),
        "examples/models/moe.py:build_listed, 2 layers of 4 experts",
    ),
}

# pass -> the case whose compile it rewrites
CASE_OF = {
    "expert-rows": "moe_listed_ep",
    "precision": "llama_mixed_zero3",
    "tensor-parallel": "llama_tp_sp",
    "experts": "moe_ep",
    "devices": "llama_on_cpu",
    "checkpoint": "llama_mixed_zero3",
    "unsupported": "llama_mixed_zero3",
    "pipeline": "llama_pipeline",
    "zero": "llama_mixed_zero3",
    "overlap": "llama_tp_sp",
}


def render(gm: fx.GraphModule) -> str:
    """The program as text: its code, the code of each nested graph (checkpointed regions),
    each module its graphs call (collectives, ZeRO nodes, experts units) with its settings,
    and the pipeline's stages, which annotate the graph without rewriting it."""
    graphs = sorted((name, m) for name, m in gm.named_modules() if isinstance(m, fx.GraphModule))
    out: list[str] = []
    for name, sub in graphs:
        out.append(f"# graph {name or 'self'}")
        # without fx's `x = y = None` frees, which move with every node a pass adds
        out += [line.split(";  ")[0].rstrip() for line in sub.code.strip("\n").splitlines() if line.strip()]
    for name, sub in graphs:
        for target in sorted({str(n.target) for n in sub.graph.nodes if n.op == "call_module"}):
            module = sub.get_submodule(target)
            if not isinstance(module, fx.GraphModule):
                out.append(f"# {name + '.' if name else ''}{target}: {module!r}")
    if STAGES in gm.meta:
        out.append(f"# stages cut {gm.meta[STAGES]}")
    for name, sub in graphs:
        stages: dict[int, list[str]] = {}
        for node in sub.graph.nodes:
            if STAGE in node.meta:
                stages.setdefault(node.meta[STAGE], []).append(node.name)
        for stage, names in sorted(stages.items()):
            out += textwrap.wrap(
                " ".join(names),
                100,
                initial_indent=f"# {name or 'self'}: stage {stage}: ",
                subsequent_indent="#   ",
            )
    return "\n".join(out) + "\n"


@functools.cache
def steps(case: str) -> dict[str, str]:
    """The rendered graph after capture and after each pass that ran, for one case."""
    c = CASES[case]
    seen: dict[str, str] = {}

    def observe(step: str, gm: fx.GraphModule) -> None:
        if step == "capture":  # a fallback to the example's shapes compiles again from capture
            seen.clear()
        seen[step] = render(gm)  # now: the next pass rewrites the graph in place

    source = ModelSource(case, c.build(), llama.example_inputs(batch=2, seq=16))
    compile_plan(check_text(c.text, f"{case}.plan"), source, observe=observe)
    return seen


def pass_diff(name: str) -> str:
    """The golden text of a pass: a header naming the model and plan, then the unified diff of
    the graph before it (after the pass that ran before it) against the graph after it."""
    case, seen = CASES[CASE_OF[name]], steps(CASE_OF[name])
    order = list(seen)
    before = order[order.index(name) - 1]
    header = [f"# the {name} pass on {case.about}, compiled for (2, 16) tokens under:", "#"]
    header += [f"#   {line}".rstrip() for line in case.text.strip("\n").splitlines()]
    diff = difflib.unified_diff(
        seen[before].splitlines(), seen[name].splitlines(), f"after {before}", f"after {name}", lineterm=""
    )
    return "\n".join([*header, "", *diff]) + "\n"


@pytest.mark.parametrize("name", [p.name for p in PASSES])
def test_pass_golden(name: str) -> None:
    assert name in CASE_OF, f"no golden case for the {name} pass: add one to CASE_OF (a plan it rewrites)"
    text = pass_diff(name)
    changed = [line for line in text.splitlines() if line.startswith(("+", "-"))]
    if name == "unsupported":
        # a check, never a rewrite: its golden is a header and no diff, on purpose
        assert changed == []
    else:
        assert changed, f"the {name} pass changed nothing under its case: pick a plan it rewrites"
    expect(text, GOLDEN / f"{name}.diff")


@pytest.mark.parametrize("step", PASSES, ids=lambda p: p.name)
def test_each_pass_docstring_names_its_golden(step) -> None:
    """A reader of a pass finds its effect pinned: its module's docstring names the golden file."""
    module = sys.modules[step.run.__module__]
    assert f"golden/passes/{step.name}.diff" in (module.__doc__ or ""), module.__name__


def test_expect_fails_on_a_difference_and_on_a_missing_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MESHPLAN_ACCEPT", raising=False)
    golden = tmp_path / "x.diff"
    with pytest.raises(pytest.fail.Exception, match="does not exist"):
        expect("a\n", golden)
    assert not golden.exists()  # never written by a first run
    golden.write_text("a\nb\n")
    expect("a\nb\n", golden)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)-b\n\+c.*MESHPLAN_ACCEPT=1 pytest"):
        expect("a\nc\n", golden)
    monkeypatch.setenv("MESHPLAN_ACCEPT", "1")
    expect("a\nc\n", golden)
    assert golden.read_text() == "a\nc\n"


def test_rendering_has_no_addresses() -> None:
    """What varies between runs never reaches a golden file (an object's id, a temp path)."""
    text = "".join(pass_diff(name) for name in CASE_OF)
    assert not re.search(r"0x[0-9a-f]{6,}|/tmp/|pytest-of-", text)
