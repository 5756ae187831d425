"""Tensor and sequence parallelism over each tensor axis: placements, collectives, local shapes.

One walk per axis that tensor or context rules name, the context axes first (they cut the
token inputs, so a tensor axis's sequence shard is a cut inside theirs), then the tensor axes
in mesh order, with the same op rules (written for any axis): a walk sets its axis's entry of
every node's placements, keeps the others', and passes them through the collectives an
earlier walk inserted (they move data over their own axis only; one that moves a dim this
axis cuts inside it gets this axis's pieces gathered first). So `mesh tp=2, tq=2` with
attention over `tp` and the MLP over `tq` is two walks over one graph, and each collective's
ledger bytes are what a rank holds.

Requires: a normalized captured graph (`compiler.graph.normalize`) whose nodes carry
export's `val` and `nn_module_stack`, and the plan's resolved tensor/sequence rules.
Ensures: every tensor node has `meta["meshplan.placement"] = {axis: Placement}`; the
collectives the placements demand are `call_module` nodes (`copy_to_tp`, `all_reduce_tp`,
...) with `meta["meshplan.collective"]`; shape arguments of view/reshape/expand are local
sizes; vocab-parallel embedding and loss replace their aten ops. Parameters keep global
shapes in the graph's metadata: `lower` materializes each rank's shards.

Before (one attention input, q/k/v column, o_proj row):

    q = aten.linear(h, q_proj_weight); k = aten.linear(h, k_proj_weight); ...
    q = aten.view(q, [2, 16, 4, 16])
    out = aten.linear(attn, o_proj_weight, o_proj_bias)

After (tp=2):

    copy_to_tp = self.copy_to_tp(h)                      # f: one for q, k and v
    q = aten.linear(copy_to_tp, q_proj_weight); ...       # (B, T, H/2)
    q = aten.view(q, [2, 16, 2, 16])                      # local head count
    out = aten.linear(attn, o_proj_weight)                # partial sums
    all_reduce_tp = self.all_reduce_tp(out)               # g
    out = aten.add(all_reduce_tp, o_proj_bias)            # bias once, after the reduction

Placements are decided in one walk in graph order. A `Partial` is reduced right where
it is made: all-reduce to `Replicate`, or under sequence parallelism reduce-scatter to
`Shard(seq_dim)`, which is Megatron's choice and the analytical minimum.

Golden: `tests/compiler/golden/passes/tensor-parallel.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

from torch import fx

from meshplan.dsl.errors import Diagnostic

from .. import Context, Pass
from . import attention, experts, linear, pointwise, shapes  # noqa: F401  (each registers its op rules)
from .grad_sums import defer_weight_sums
from .matmul_attention import attention_as_sdpa
from .spec import ParamPlacement, TensorParallelError, TensorParallelSpec
from .tensor_rules import tensor_specs
from .walk import Walk
from .weights import weights

__all__ = ["PASS", "ParamPlacement", "TensorParallelError", "TensorParallelSpec", "run", "tensor_parallel"]


def tensor_parallel(gm: fx.GraphModule, spec: TensorParallelSpec) -> tuple[fx.GraphModule, list[Diagnostic]]:
    """Annotate placements, insert collectives, rewrite local shapes. Returns warnings and errors."""
    if spec.context_modules:  # ring and Ulysses replace an sdpa call: attention in matmuls becomes one
        attention_as_sdpa(gm, spec.context_modules)
    walk = Walk(gm, spec)
    walk.run()
    gm.graph.lint()
    gm.recompile()
    return gm, walk.diagnostics


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """The pass: parameter placements from the tensor rules (their problems are reported even
    when other rules have errors), then, on a plan without errors, one walk per context axis
    and then per tensor axis in mesh order. A walk keeps the placements the earlier ones gave
    (every node has one per axis) and passes them through the collectives they inserted,
    which move data over their own axis only."""
    ctx.tensor, found = tensor_specs(ctx.plan, ctx.resolution, ctx.source.model, ctx.layout, weights(gm))
    ctx.diagnostics += found
    if ctx.failed:
        return gm
    try:
        for spec in ctx.tensor:
            gm, found = tensor_parallel(gm, spec)
            ctx.diagnostics += found
            for name in defer_weight_sums(gm, spec.axis):  # summed by the gradient sync, in buckets
                ctx.grad_sums[name] = (*ctx.grad_sums.get(name, ()), spec.axis)
    except TensorParallelError as e:
        ctx.diagnostics.append(e.diagnostic)
    return gm


PASS = Pass(
    "tensor-parallel",
    run,
    requires="a normalized graph with export's `val` and module paths; tensor/sequence rules resolved",
    ensures="a placement per tensor node, the collectives it demands as nodes, local view sizes",
    checks_after_errors=True,
)
