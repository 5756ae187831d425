"""Weight gradients partial over a context or tensor axis are summed by the gradient sync, in
its buckets, rather than by one all-reduce per weight in backward
(`compiler/passes/tensor_parallel/grad_sums.py`). Numerics: every context and
sequence-parallel verify and run test trains through these sums (tests/cli/test_verify.py,
tests/cli/test_run_context.py); here, the program and its ledger."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.print_explain import explain
from meshplan.dsl import check_text
from meshplan.examples.models import llama
from meshplan.runtime.collectives import CopyToAxis

CONTEXT = "mesh dp=2, cp=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n}\n"


def _compile(text: str, model: nn.Module | None = None):
    model = model if model is not None else llama.build()
    source = ModelSource("m", model, llama.example_inputs(seq=16))
    return compile_plan(check_text(text, "p.plan"), source, dynamic=False)


def _fs(compiled, axis: str) -> int:
    """The f's (identity forward, all-reduce backward) over `axis` in the program."""
    return sum(
        1
        for n in compiled.graph.graph.nodes
        if n.op == "call_module"
        and isinstance(m := compiled.graph.get_submodule(str(n.target)), CopyToAxis)
        and m.axis == axis
    )


def test_under_context_parallelism_every_weight_is_summed_in_the_data_parallel_buckets():
    """Every weight computes with this rank's sequence shard: no f per weight over cp is left;
    the gradients go in the buckets of dp x cp (averaged over dp, summed over cp), one
    all-reduce per step where there was one per weight and micro-step."""
    params = [n for n, p in llama.build().named_parameters() if p.requires_grad]
    for block, axes in (("", "cp"), ("\ndata_parallel over dp {\n}\n", "dp x cp")):
        compiled = _compile(CONTEXT + block)  # without a data-parallel block: a bucket over cp
        assert compiled.grad_sums == dict.fromkeys(params, ("cp",))
        assert _fs(compiled, "cp") == 0
        rows = [r for r in compiled.ledger.rows if r.phase == "backward" and r.op == "all_reduce"]
        assert [(r.axis, r.count) for r in rows] == [(axes, 1)]
        assert rows[0].bytes == sum(p.numel() for p in llama.build().parameters()) * 4
    zero3 = _compile(CONTEXT + "\ndata_parallel over dp {\n    zero = 3\n}\n")
    text = explain(zero3)
    assert (
        "each rank keeps 1/4 of the parameters, gradients and optimizer state of 39 weights (over dp x cp)"
        in text
    )
    assert f"    {len(params)} of {len(params)} summed over cp by the gradient sync" in text
    assert {r.axis for r in zero3.ledger.rows if r.kind in ("zero_gather", "zero_bucket")} == {"dp x cp"}


def test_sequence_parallel_norms_are_summed_over_tp_with_their_own_group():
    """The norms between sequence-parallel regions: partial over tp, summed there in buckets of
    dp x tp; the split weights stay averaged over dp alone."""
    text = (
        "mesh dp=2, tp=2\n\nmodules {\n"
        "    layers.*.self_attn.{q,k,v}_proj: column over tp\n    layers.*.self_attn.o_proj: row over tp\n"
        "    layers.*.mlp.{gate,up}_proj: column over tp\n    layers.*.mlp.down_proj: row over tp\n"
        "    layers.*.{input,post_attention}_layernorm: sequence over tp\n}\n\n"
        "data_parallel over dp {\n    zero = 2\n}\n"
    )
    compiled = _compile(text)
    # (layer 0's input norm reads the embedding's output whole: its gradient is whole)
    norms = {f"layers.{i}.{n}" for i in range(4) for n in ("input_layernorm", "post_attention_layernorm")}
    assert {f"{n}.weight" for n in norms - {"layers.0.input_layernorm"}} <= set(compiled.grad_sums)
    assert "layers.0.input_layernorm.weight" not in compiled.grad_sums
    assert all(axes == ("tp",) for axes in compiled.grad_sums.values())
    assert not any("proj" in name for name in compiled.grad_sums)  # split over tp: whole gradients
    assert {r.axis for r in compiled.ledger.rows if r.kind == "zero_bucket"} == {"dp", "dp x tp"}
    assert not [
        r
        for r in compiled.ledger.rows
        if r.axis == "tp" and r.op == "all_reduce" and r.phase == "backward" and r.shape == (64,)
    ]


class Temperature(nn.Module):
    """A weight read by sequence-sharded compute and by the (whole) loss: its gradient is
    partial from the first use and whole from the second, so it keeps its f."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama.build()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids) * self.scale
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) * self.scale


def test_a_weight_also_read_whole_keeps_its_all_reduce():
    compiled = _compile(CONTEXT.replace("layers.", "model.layers."), Temperature())
    assert "scale" not in compiled.grad_sums
    assert "model.lm_head.weight" in compiled.grad_sums
    assert _fs(compiled, "cp") == 1  # the scale's, before the sharded logits
