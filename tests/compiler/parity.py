"""One forward and backward of a compiled program on gloo ranks against the unpartitioned model.

    spawn(grad_parity, 2, (plan_text, "tests/compiler/factories.py:dropless_moe", "float64"))

Every rank builds the full model (the factory is seeded), compiles the plan for the example
inputs' shapes (`dynamic=False`: one shape is run, and a symbolic compile costs 2.5 times as
much on every rank; programs with symbolic shapes are trained by the `verify` and run tests),
binds its shards and runs the model's example inputs through both; it returns the relative difference of the
loss and the worst relative difference of a gradient (shard against the matching slice of
the full gradient). In float64 a correct program is exact up to rounding (about 1e-15).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def grad_parity(rank: int, world_size: int, plan_text: str, model_spec: str, dtype: str) -> dict:
    from meshplan.compiler.capture import bind_inputs
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.graph import find_loss
    from meshplan.compiler.load import load_model
    from meshplan.compiler.lower import build_rank_program, local_shard
    from meshplan.compiler.passes.precision import cast_floating
    from meshplan.dsl import check_text
    from meshplan.runtime.mesh import init_mesh
    from meshplan.session import partial_grad_sync

    source = load_model(model_spec)
    cast_floating(source.model, getattr(torch, dtype))
    plan = check_text(plan_text, str(Path(tempfile.gettempdir()) / "parity.plan"), world_size=world_size)
    compiled = compile_plan(plan, source, world_size=world_size, dynamic=False)
    mesh = init_mesh(compiled.layout)
    program = build_rank_program(compiled, source.model, rank, mesh)
    sync = partial_grad_sync(compiled, program, mesh)  # weight gradients partial over an axis, summed

    reference = source.model
    out = reference(*source.args, **source.kwargs)
    ref_loss = find_loss(out)
    ref_loss.backward()
    outputs = program(*bind_inputs(reference, compiled.graph, source.args, source.kwargs))
    loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    loss.backward()
    sync.finish()

    coords = compiled.layout.coords(rank)
    full = dict(reference.named_parameters(remove_duplicate=False))
    # a gradient that is zero up to rounding (a key bias under softmax) is compared with the
    # model's whole gradient instead of with itself
    floor = 1e-6 * float(torch.cat([p.grad.flatten() for p in full.values() if p.grad is not None]).norm())
    worst, worst_name = 0.0, ""
    for name, local in program.named_parameters(remove_duplicate=False):
        expected = local_shard(
            full[name].grad, compiled.param_placements.get(name, {}), coords, compiled.layout
        )
        diff = float((local.grad - expected).norm()) / max(float(expected.norm()), floor)
        if diff > worst:
            worst, worst_name = diff, name
    return {
        "loss": abs(float(loss.detach()) - float(ref_loss.detach())) / abs(float(ref_loss.detach())),
        "grad": worst,
        "worst": worst_name,
        "collectives": sorted({str(n.target) for n in compiled.graph.graph.nodes if n.op == "call_module"}),
    }
