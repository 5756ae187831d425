"""Mixed precision casts floating-point tensors only: complex RoPE stays complex under bf16.

A torchtitan-style Llama keeps its rotary table as a complex64 `freqs_cis` buffer. Cast to
bf16 it would lose its imaginary half (the sines) and train on with half of RoPE gone;
the loss at initialization would not show it (near-uniform predictions), the gradients of
the attention projections do.
"""

import copy

import torch
from torch import nn

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.compiler.passes.precision import cast_floating
from meshplan.dsl import check_text
from meshplan.examples.models import llama_complex

ONLY_PRECISION = """
mesh dp=1

precision {
    compute = bf16
}
"""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _compiled():
    model = llama_complex.build()
    inputs = llama_complex.example_inputs()
    compiled = compile_plan(
        check_text(ONLY_PRECISION, "bf16.plan"), ModelSource("llama_complex", model, inputs)
    )
    return model, inputs, compiled


def test_cast_floating_leaves_complex_integer_and_bool_tensors_alone():
    module = nn.Linear(2, 2)
    module.register_buffer("freqs_cis", torch.polar(torch.ones(3), torch.arange(3.0)))
    module.register_buffer("positions", torch.arange(3))
    module.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    cast_floating(module, torch.bfloat16)
    assert module.weight.dtype == module.bias.dtype == torch.bfloat16
    assert module.freqs_cis.dtype == torch.complex64
    assert torch.equal(module.freqs_cis.imag, torch.sin(torch.arange(3.0)))
    assert module.positions.dtype == torch.int64
    assert module.mask.dtype == torch.bool


def test_bf16_compute_keeps_the_rope_table_complex64():
    model, _, compiled = _compiled()
    assert compiled.captured.model.freqs_cis.dtype == torch.complex64  # captured in bf16, table untouched
    freqs = next(n for n in compiled.graph.graph.nodes if n.op == "get_attr" and n.target == "freqs_cis")
    assert freqs.meta["val"].dtype == torch.complex64
    assert all(user.target is not torch.ops.aten._to_copy.default for user in freqs.users)
    casts = [n for n in compiled.graph.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert all(n.args[0].meta["val"].dtype.is_floating_point for n in casts)
    program = build_rank_program(compiled, model, rank=0)
    assert program.freqs_cis.dtype == torch.complex64
    assert torch.equal(program.freqs_cis, model.freqs_cis)


def test_bf16_program_matches_the_eager_model_under_bf16_autocast():
    model, inputs, compiled = _compiled()
    program = build_rank_program(compiled, model, rank=0)
    (loss,) = program(*inputs)
    loss.backward()

    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, ref_loss = reference(*inputs)
    ref_loss.backward()

    assert loss.dtype == torch.float32
    assert rel(loss, ref_loss) <= 1e-2
    ref = dict(reference.named_parameters())
    for name, p in program.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32  # master weights and their grads
        # Without the sines of RoPE the query and key projections' gradients are ~45% off.
        assert rel(p.grad, ref[name].grad) <= 5e-2, name
