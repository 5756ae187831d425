"""Mixed precision: bf16/fp16 compute from fp32 master weights, fp32 regions, fp32 loss."""

import copy

import torch

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl import check_text
from meshplan.examples.models import llama
from meshplan.runtime.train import _update_scale

BF16 = """
mesh dp=1

modules {
    layers.*.{input,post_attention}_layernorm: precision fp32
    norm: precision fp32
}

precision {
    compute = bf16
}
"""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_bf16_program_matches_fp32_model_within_bf16_rounding():
    model = llama.build()
    inputs = llama.example_inputs()
    compiled = compile_plan(check_text(BF16, "bf16.plan"), ModelSource("llama", model, inputs))
    program = build_rank_program(compiled, model, rank=0)
    reference = copy.deepcopy(model)
    (loss,) = program(*inputs)
    loss.backward()
    ref_loss = reference(*inputs)
    ref_loss.backward()
    assert rel(loss, ref_loss) <= 1e-2
    ref = dict(reference.named_parameters())
    for name, p in program.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32  # master weights and their grads
        assert rel(p.grad, ref[name].grad) <= 5e-2, name


def test_casts_follow_regions():
    model = llama.build()
    compiled = compile_plan(
        check_text(BF16, "bf16.plan"), ModelSource("llama", model, llama.example_inputs())
    )
    code = compiled.graph.code
    assert "layers_0_self_attn_q_proj_weight_bf16 = torch.ops.aten._to_copy.default" in code
    assert "norm_weight_bf16" not in code  # an fp32 region uses its weight as is
    casts = [n for n in compiled.graph.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    loss_input = next(
        n for n in compiled.graph.graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default
    )
    assert loss_input.args[0] in casts and loss_input.args[0].kwargs["dtype"] is torch.float32


def test_tensor_parallel_collectives_carry_bf16():
    text = BF16.replace("mesh dp=1", "mesh tp=2").replace(
        "modules {",
        "modules {\n    layers.*.mlp.{gate,up}_proj: column over tp\n    layers.*.mlp.down_proj: row over tp",
    )
    model = llama.build()
    compiled = compile_plan(check_text(text, "t.plan"), ModelSource("llama", model, llama.example_inputs()))
    rows = [r for r in compiled.ledger.rows if r.shape == (2, 16, 64)]
    assert rows and all(r.bytes == 2 * 16 * 64 * 2 for r in rows)


def test_dynamic_loss_scale_halves_on_overflow_and_grows_after_good_steps():
    assert _update_scale(1024.0, 5, True, 10) == (512.0, 0)
    scale, good = 1024.0, 0
    for _ in range(10):
        scale, good = _update_scale(scale, good, False, 10)
    assert scale == 2048.0 and good == 0
    assert _update_scale(1.0, 0, True, 10) == (1.0, 0)  # never below 1
