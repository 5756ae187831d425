"""Mixed precision: compute in the plan's dtype, keep fp32 parameters, override regions.

Requires: a normalized graph captured from a copy of the model in the compute dtype (so
the model's own casts, like a norm's `.to(input_dtype)`, are recorded in that dtype; made
with `cast_floating`, which leaves complex and integer tensors alone),
before tensor parallelism (so collectives move the compute dtype's bytes); the plan's
`precision DTYPE` rules resolved to module paths.
Ensures: parameters and buffers are fp32 (the master weights: the rank program is built
from the fp32 model) and are cast where they are used, to the dtype of the region
using them; autograd returns fp32 gradients through the casts. Activations entering an
override region are cast to its dtype, and cast back where they leave it. The loss
(cross-entropy) is computed in fp32 from fp32 logits. Only floating-point tensors are
ever cast: a complex64 RoPE table stays complex64 under bf16 compute (a real dtype would
drop its imaginary half, the sines), and integer and bool tensors keep their dtype.

Before (`compute = bf16`, `norm: precision fp32`):

    w = self.layers.0.mlp.up_proj.weight
    y = aten.linear(x, w)
    n = aten.mul(self.norm.weight, aten.rsqrt(...))

After:

    w = self.layers.0.mlp.up_proj.weight
    to = aten._to_copy(w, dtype=bfloat16)            # fp32 master -> bf16 compute
    y = aten.linear(x, to)
    x_fp32 = aten._to_copy(x, dtype=float32)         # entering the fp32 region
    n = aten.mul(self.norm.weight, aten.rsqrt(...))  # norm weight stays fp32

Golden: `tests/compiler/golden/passes/precision.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import fx, nn

from meshplan.dsl import ast
from meshplan.dsl.check import Plan, PlanRule

from .. import meta
from ..graph import arg_node, innermost, module_path
from ..match import Resolution
from . import Context, Pass

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
aten = torch.ops.aten

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.log_softmax.int}


@dataclass(frozen=True)
class PrecisionSpec:
    compute: torch.dtype
    overrides: dict[str, tuple[torch.dtype, PlanRule]]  # module path -> (dtype, rule)

    def dtype_at(self, node: fx.Node) -> torch.dtype:
        """The dtype a node computes in: the innermost override region around it, else compute."""
        override = innermost(module_path(node), self.overrides)
        return override[0] if override is not None else self.compute


def cast_floating(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)` for floating-point parameters and buffers only, in place.

    `nn.Module.to(torch.bfloat16)` also casts complex tensors, to a real dtype: a complex64
    `freqs_cis` buffer would keep its cosines and lose its sines, with only a warning. Here a
    complex tensor keeps a complex dtype (complex128 beside float64, else its own), and
    integer and bool tensors are never touched.
    """
    complex_dtype = torch.complex128 if dtype == torch.float64 else None

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(dtype)
        if t.is_complex() and complex_dtype is not None:
            return t.to(complex_dtype)
        return t

    return model._apply(cast)


def mixed_precision(gm: fx.GraphModule, spec: PrecisionSpec) -> fx.GraphModule:
    """Insert the casts; a no-op for fp32 compute without overrides."""
    if spec.compute == torch.float32 and not spec.overrides:
        return gm
    graph = gm.graph
    casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}

    def cast(node: fx.Node, dtype: torch.dtype) -> fx.Node:
        assert _is_float_tensor(node), f"{node.name} is not a floating-point tensor"
        if _dtype(node) == dtype:
            return node
        key = (node, dtype)
        if key not in casts:
            with graph.inserting_after(node):
                new = graph.create_node(
                    "call_function",
                    aten._to_copy.default,
                    (node,),
                    {"dtype": dtype},
                    name=f"{node.name}_{_SHORT[dtype]}",
                )
            new.meta.update({k: v for k, v in node.meta.items() if k == "nn_module_stack"})
            meta.copy_facts(node, new, meta.MODULE)
            new.meta["val"] = node.meta["val"].to(dtype)
            casts[key] = new
        return casts[key]

    # parameters and buffers arrive in fp32 (the master weights)
    for node in graph.nodes:
        if node.op == "get_attr" and _is_float_tensor(node):
            node.meta["val"] = node.meta["val"].to(torch.float32)
    for node in list(graph.nodes):
        if node.op != "call_function" or node in casts.values():
            continue
        want = torch.float32 if node.target in _LOSSES else spec.dtype_at(node)
        for arg in node.all_input_nodes:
            if not _is_float_tensor(arg):
                continue
            crosses = arg.op == "get_attr" or (arg.op == "call_function" and spec.dtype_at(arg) != want)
            if crosses or node.target in _LOSSES:
                node.replace_input_with(arg, cast(arg, want))
        _retype(node)
    gm.recompile()
    return gm


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _is_float_tensor(node: fx.Node) -> bool:
    dtype = _dtype(node)
    return dtype is not None and dtype.is_floating_point


def _retype(node: fx.Node) -> None:
    """Refresh the recorded output dtype after its inputs' dtypes changed (shapes are unchanged).

    Ops that fix their output dtype (`to(float32)` in a norm, type_as) keep what export
    recorded; others follow their floating inputs.
    """
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return
    if node.target in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout):
        return
    if node.target is aten.type_as.default:
        node.meta["val"] = val.to(_dtype(arg_node(node, 1)) or val.dtype)
        return
    inputs = [d for d in map(_dtype, node.all_input_nodes) if d is not None and d.is_floating_point]
    if inputs:
        node.meta["val"] = val.to(functools.reduce(torch.promote_types, inputs))


def precision_spec(plan: Plan, resolution: Resolution) -> PrecisionSpec:
    overrides = {}
    for path, kinds in resolution.placements.items():
        rule = kinds.get("dtype")
        if rule is not None and isinstance(rule.action, ast.DtypeOverride):
            overrides[path] = (DTYPES[rule.action.dtype], rule)
    return PrecisionSpec(DTYPES[plan.precision.compute], overrides)


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    return mixed_precision(gm, precision_spec(ctx.plan, ctx.resolution))


PASS = Pass(
    "precision",
    run,
    requires="a graph captured in the compute dtype; `precision` rules resolved",
    ensures="fp32 parameters cast at each use to their region's dtype; an fp32 loss",
    checks_after_errors=True,
)
