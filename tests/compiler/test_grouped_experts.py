"""Experts called on rows the model permuted by expert itself, `experts(x, num_tokens_per_expert)`
(torchtitan's `GroupedExperts`, Megatron's grouped MLP; the model: tests/compiler/grouped_experts.py),
split over an expert axis: one experts unit whose rows carry their expert (`units.py`), dispatched
and combined by the unit's all-to-alls, the model's own module run on each rank's experts with
rows regrouped by expert and their counts (`runtime/experts.py`, `grouped`).

The parity tests run the compiled program on gloo ranks, each on its own slice of the batch, in
float64, beside the unpartitioned model on the whole batch: loss and every gradient (averaged
over the data axes as `meshplan run` averages them) equal to float64 rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import shared_processes, spawn

from meshplan.compiler.compile import Compiled, compile_plan
from meshplan.compiler.load import load_model
from meshplan.compiler.placement import Shard
from meshplan.dsl import PlanError, check_text

HERE = Path(__file__).resolve().parent
MODEL = f"{HERE}/grouped_experts.py:build"
EP = "mesh ep=2\n\nmodules {\n    layers.*.moe.experts: experts over ep (top_k=2)\n}\n"
DP_EP = "mesh dp=2, ep=2\n\nmodules {\n    layers.*.moe.experts: experts over ep (top_k=2)\n}\n\ndata_parallel over dp {\n}\n"
EP_TP = (
    "mesh ep=2, tp=2\n\nmodules {\n    layers.*.moe.experts: experts over ep (top_k=2)\n"
    "    layers.*.moe.experts.{w1,w3}: column over tp\n    layers.*.moe.experts.w2: row over tp\n}\n"
)


def _compile(text: str, factory: str = "build", *, dynamic: bool = True) -> Compiled:
    source = load_model(f"{HERE}/grouped_experts.py:{factory}")
    return compile_plan(check_text(text, "p.plan"), source, dynamic=dynamic)


def _errors(text: str, factory: str = "build") -> str:
    """The errors compiling `text` reports: a symbolic compile's are the example shape's
    (`compile_plan` compiles for it again to tell), so compiled for it alone (one capture)."""
    with pytest.raises(PlanError) as info:
        _compile(text, factory, dynamic=False)
    return info.value.render()


def test_grouped_experts_are_one_unit_with_their_experts_split():
    """Each layer's experts one `ExpertParallel` over `ep` that knows its module takes counts;
    w1, w2, w3 Shard(0); the all-to-alls those of the N k permuted rows (2 x 16 tokens, top-2),
    as for Hugging Face's layout; `top_k=2` checked against the router's top-k."""
    compiled = _compile(DP_EP)
    units = [
        n for n in compiled.graph.graph.nodes if n.op == "call_module" and str(n.target).startswith("experts")
    ]
    assert [str(n.target) for n in units] == ["experts_ep_0", "experts_ep_1"]
    assert compiled.graph.experts_ep_0.grouped
    assert {n: p for n, p in compiled.param_placements.items() if p} == {
        f"layers.{i}.moe.experts.{w}": {"ep": Shard(0)} for i in (0, 1) for w in ("w1", "w2", "w3")
    }
    rows = [(r.phase, r.shape, r.bytes, r.count) for r in compiled.ledger.rows if r.node == "experts_ep_0"]
    assert rows == [
        ("forward", (4,), 32, 1),
        ("forward", (64, 64), 16384, 2),
        ("backward", (64, 64), 16384, 2),
    ]
    assert "but the model routes each token of `layers.0.moe.experts` and 1 more like it to 2 experts" in (
        _errors(EP.replace("top_k=2", "top_k=3"))
    )


def test_what_the_grouped_layout_cannot_do_is_a_located_error():
    """A capacity needs each row's (token, slot) pair, which only the model's permutation knows;
    experts held in a dict of modules (Switch Transformers) are not stacked."""
    assert _errors(EP.replace("top_k=2", "top_k=2, capacity_factor=1.25")).splitlines()[0] == (
        "p.plan:4:53: error: expert capacity (`capacity_factor`) for `layers.0.moe.experts` and 1 more like "
        "it is not lowered: it is called on rows the model grouped by expert itself, so which "
        "(token, slot) pair each row is, and so which to drop, is the model's"
    )
    assert _errors(EP, "switch").splitlines()[0] == (
        "p.plan:4:5: error: `layers.0.moe.experts` cannot be split over `ep`: its experts are a dict of "
        "modules (Switch Transformers' layout), which meshplan does not stack: keep them in an "
        "nn.ModuleList the block indexes, or stacked on dim 0 of 3-D parameters"
    )


def test_tensor_rules_split_each_grouped_expert():
    """w1, w3 (E, dim, hidden) column: their dim 2; w2 (E, hidden, dim) row: its dim 1; the split
    tried on the model's own grouped code first."""
    compiled = _compile(EP_TP)
    placed = compiled.param_placements
    assert {w: placed[f"layers.1.moe.experts.{w}"] for w in ("w1", "w3", "w2")} == {
        "w1": {"tp": Shard(2), "ep": Shard(0)},
        "w3": {"tp": Shard(2), "ep": Shard(0)},
        "w2": {"tp": Shard(1), "ep": Shard(0)},
    }


def _parity(rank: int, world_size: int, plan_text: str, model_spec: str, batch: int) -> dict:
    """One forward and backward of the compiled program on this rank's slice of the batch,
    gradients averaged over the data axes (`partial_grad_sync`, as `run` does), against the
    float64 model on the whole batch: relative differences of the loss and the worst gradient."""
    import torch.distributed as dist

    from meshplan.compiler.capture import bind_inputs
    from meshplan.compiler.lower import build_rank_program, local_shard
    from meshplan.compiler.passes.precision import cast_floating
    from meshplan.examples.models.llama import example_inputs
    from meshplan.runtime.mesh import init_mesh
    from meshplan.session import partial_grad_sync

    source = load_model(model_spec)
    cast_floating(source.model, torch.float64)
    compiled = compile_plan(
        check_text(plan_text, "p.plan", world_size=world_size), source, world_size=world_size
    )
    mesh = init_mesh(compiled.layout)
    program = build_rank_program(compiled, source.model, rank, mesh)
    sync = partial_grad_sync(compiled, program, mesh, data=compiled.plan.batch_axes)
    layout, coords = compiled.layout, compiled.layout.coords(rank)
    data = 0  # this rank's place among the data ranks
    for axis in compiled.plan.batch_axes:
        data = data * layout.size(axis) + coords[axis]
    ranks = _data_ranks(compiled)
    input_ids, labels = example_inputs(batch=batch, seq=16, seed=3)
    per = batch // ranks
    mine = slice(data * per, (data + 1) * per)

    reference = source.model
    ref_loss = reference(input_ids, labels)
    ref_loss.backward()
    loss = program(*bind_inputs(reference, compiled.graph, (input_ids[mine], labels[mine]), {}))[0]
    loss.backward()
    sync.finish()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= world_size  # every rank holds a data rank's loss, or a copy of it over a tensor axis

    full = dict(reference.named_parameters())
    worst, worst_name = 0.0, ""
    for name, local in program.named_parameters():
        expected = local_shard(full[name].grad, compiled.param_placements.get(name, {}), coords, layout)
        diff = float((local.grad - expected).norm()) / float(expected.norm())
        if diff > worst:
            worst, worst_name = diff, name
    units = [m for m in program.modules() if type(m).__name__ == "ExpertParallel"]
    return {
        "loss": abs(float(mean) - float(ref_loss.detach())) / float(ref_loss.detach()),
        "grad": worst,
        "worst": worst_name,
        "grouped": all(u.grouped for u in units) and len(units) == 2,
        "routed": sum(int(u.take_tokens().sum()) for u in units),
    }


def _data_ranks(compiled: Compiled) -> int:
    return int(torch.tensor([compiled.layout.size(a) for a in compiled.plan.batch_axes]).prod())


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "world"), [(EP, 2), (DP_EP, 4), (EP_TP, 4)], ids=["ep", "dp-ep", "ep-tp"])
def test_grouped_experts_train_as_the_whole_model(plan: str, world: int):
    results = spawn(_parity, world, (plan, MODEL, 4))
    for r in results:
        assert r["grouped"], r
        assert r["loss"] < 1e-14 and r["grad"] < 1e-13, r
    # every (token, slot) pair of the 4 x 16 tokens routed once per layer, by the rank whose token
    # it is (over a tensor axis every rank of it routes its copy of the same rows)
    copies = 2 if "tp" in plan else 1
    assert sum(r["routed"] for r in results) == copies * 2 * 4 * 16 * 2


VERIFIED = {
    # ZeRO-2 over dp x ep, a checkpointed layer (its all-to-alls again in backward)
    "dp-ep-zero2": "mesh dp=2, ep=2\n\nmodules {\n    layers.*.moe.experts: experts over ep (top_k=2)\n"
    "    layers.1: checkpoint\n}\n\ndata_parallel over dp {\n    zero = 2\n}\n",
    # each expert's matrices over tp inside ep, attention over tp with sequence-parallel norms,
    # a router z-loss found through the walk's gathers of the routing
    "ep-tp-sp": "mesh ep=2, tp=2\n\nmodules {\n    layers.*.attention.{q,k,v}_proj: column over tp\n"
    "    layers.*.attention.o_proj: row over tp\n    layers.*.*_norm: sequence over tp\n"
    "    layers.*.moe.experts: experts over ep (top_k=2, z_loss=1e-2)\n"
    "    layers.*.moe.experts.{w1,w3}: column over tp\n    layers.*.moe.experts.w2: row over tp\n}\n",
    # the experts borrowing the tensor axis: each tp rank routes its split of the permuted rows
    "borrow-tp": "mesh dp=2, tp=2\n\nmodules {\n    layers.*.attention.{q,k,v}_proj: column over tp\n"
    "    layers.*.attention.o_proj: row over tp\n    layers.*.moe.experts: experts over tp (top_k=2)\n}\n\n"
    "data_parallel over dp {\n}\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VERIFIED))
def test_meshplan_verify_passes(tmp_path: Path, name: str):
    from meshplan.verify import render, verify

    plan = tmp_path / f"{name}.plan"
    plan.write_text(VERIFIED[name])
    with shared_processes():
        report = verify(str(plan), MODEL, steps=2)
    assert report.ok, render(report)
    assert report.float64, report.why_not_float64


@pytest.mark.slow
def test_meshplan_verify_passes_with_the_grouped_matmul(tmp_path: Path):
    """`torch._grouped_mm` has no float64 kernel on CPU: verify's float64 reference computes it
    as the loop of matmuls it is (`cli/float64_kernels.py`, held to the kernel in float32), so the
    model is held to float64 as the dense ones are, not to fixed bounds."""
    from meshplan.verify import render, verify

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    plan = tmp_path / "ep.plan"
    plan.write_text(EP)
    with shared_processes():  # its ranks on the session's kept processes, as the other cases'
        report = verify(str(plan), f"{HERE}/grouped_experts.py:build_grouped_mm", steps=2)
    assert report.ok and report.float64, render(report)
