"""The graph invariants `compile_plan` checks after every pass: each compiled graph of the suite
passes them (every compile runs the lint); here, each invariant catches the bug it is for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx

from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.lint import GraphLintError, lint
from meshplan.compiler.load import load_model
from meshplan.compiler.meta import PLACEMENT
from meshplan.compiler.placement import Shard
from meshplan.dsl.check import check_text
from meshplan.runtime.mesh import MeshLayout
from meshplan.runtime.zero_nodes import ZeroRelease

ROOT = Path(__file__).resolve().parents[2]
GPT = "meshplan.examples.models.gpt:build"
aten = torch.ops.aten


def compiled(text: str, world_size: int):
    plan = check_text(text, world_size=world_size)
    return compile_plan(plan, with_token_shape(load_model(GPT), batch=2, seq=16), world_size=world_size)


@pytest.fixture
def zero3():
    return compiled("mesh dp=2\ndata_parallel over dp {\n    zero = 3\n}\n", 2)


@pytest.fixture
def tp2():
    return compiled((ROOT / "examples/gpt_tp.plan").read_text(), 2)


def release_of(gm: fx.GraphModule, unit: str) -> fx.Node:
    return next(
        n
        for n in gm.graph.nodes
        if n.op == "call_module"
        and isinstance(module := gm.get_submodule(str(n.target)), ZeroRelease)
        and module.unit == unit
    )


def test_compiled_graphs_pass(zero3, tp2) -> None:
    lint(zero3.graph, zero3.layout, after="test")
    lint(tp2.graph, tp2.layout, after="test")


def test_a_parameter_view_read_after_its_release(zero3) -> None:
    """The bug class of a sequence-parallel bias read after its layer was freed."""
    gm = zero3.graph
    release = release_of(gm, "h.1")
    weight = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "h.1.mlp.fc.weight")
    with gm.graph.inserting_after(release):
        view = gm.graph.call_function(aten.t.default, (weight,))
        with gm.graph.inserting_after(view):
            gm.graph.call_function(aten.sum.default, (view,))
    with pytest.raises(GraphLintError, match=r"after the zero pass: .*reads a parameter of `h\.1` outside"):
        lint(gm, zero3.layout, after="zero")


def test_a_parameter_handed_to_its_release(zero3) -> None:
    gm = zero3.graph
    release = release_of(gm, "h.2")
    bias = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "h.2.mlp.fc.bias")
    release.args = (*release.args, bias)
    with pytest.raises(
        GraphLintError, match=r"shares a parameter's storage and is handed to `h\.2`'s release"
    ):
        lint(gm, zero3.layout, after="zero")


def test_a_collective_over_an_axis_the_mesh_lacks(tp2) -> None:
    with pytest.raises(GraphLintError, match="runs over `tp`, which the mesh"):
        lint(tp2.graph, MeshLayout(("dp",), (2,)), after="tensor-parallel")


def test_a_shard_that_does_not_fit_its_tensor(tp2) -> None:
    node = next(n for n in tp2.graph.graph.nodes if n.op == "get_attr" and n.target == "h.0.mlp.fc.weight")
    node.meta[PLACEMENT] = {"tp": Shard(2)}
    with pytest.raises(GraphLintError, match=r"is Shard\(2\) but has 2 dims"):
        lint(tp2.graph, tp2.layout, after="tensor-parallel")
    node.meta[PLACEMENT] = {"tp": Shard(0, padded=255)}  # the weight has 256 rows
    with pytest.raises(GraphLintError, match=r"Shard\(0, padded=255\) over `tp` \(size 2\) but dim 0 is 256"):
        lint(tp2.graph, tp2.layout, after="tensor-parallel")
