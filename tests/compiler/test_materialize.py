"""A model built on the meta device: each rank's pieces initialized by the model's own code,
the same values whatever the layout (`compiler/materialize.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_factories import hf_llama, hf_llama_meta
from plans import llama_rules
from runs import meshplan_run
from torch import nn

from meshplan.compiler.materialize import MaterializeError, MetaWeights, is_meta

HERE = Path(__file__).parent
META_LLAMA = f"{HERE}/hf_factories.py:hf_llama_meta"


def test_hugging_face_init_gives_every_tensor_its_model_s_values():
    eager, model = hf_llama(), hf_llama_meta()
    assert is_meta(model) and not is_meta(eager)
    weights = MetaWeights(model, seed=0)
    names = list(dict(model.named_parameters()))
    full = {name: weights.full(name).clone() for name in weights.grouped(names)}
    std = model.config.initializer_range
    q = full["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - std) < 0.1 * std and abs(q.mean().item()) < 0.1 * std
    assert torch.equal(full["model.norm.weight"], torch.ones(64))
    # a buffer the model computes (rotary frequencies): recomputed by Hugging Face's init
    assert torch.equal(weights.full("model.rotary_emb.inv_freq"), eager.model.rotary_emb.inv_freq)
    assert all(t.is_meta for t in model.parameters())  # the model itself stays on meta


def test_values_depend_on_the_seed_and_the_module_not_on_the_order_visited():
    names = list(dict(hf_llama_meta().named_parameters()))
    forward = MetaWeights(hf_llama_meta(), seed=3)
    backward = MetaWeights(hf_llama_meta(), seed=3)
    first = {n: forward.full(n).clone() for n in forward.grouped(names)}
    last = {n: backward.full(n).clone() for n in reversed(backward.grouped(names))}
    assert all(torch.equal(first[n], last[n]) for n in names)
    other = MetaWeights(hf_llama_meta(), seed=4)
    name = "model.layers.1.mlp.up_proj.weight"
    assert not torch.equal(other.full(name), first[name])
    # each module its own stream: two layers' same weights differ
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], first[name])


class Scaled(nn.Module):
    """A parameter of its own and no initializer for it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))
        self.proj = nn.Linear(4, 4)


def test_a_tensor_the_model_does_not_initialize_is_named():
    with torch.device("meta"):
        model = Scaled()
    weights = MetaWeights(model, seed=0)
    assert weights.full("proj.weight").isfinite().all()  # nn.Linear's reset_parameters
    with pytest.raises(
        MaterializeError,
        match=r"`scale`: the model is built on the meta device .* \(Scaled has no `reset_parameters\(\)`\)",
    ):
        weights.full("scale")


class WholeInit(nn.Module):
    """torchtitan's convention: one `init_weights()` for the whole model, no per-module one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 3))
        self.register_buffer("table", torch.empty(3))

    def init_weights(self) -> None:
        nn.init.normal_(self.w, std=0.5)
        self.table.copy_(torch.arange(3.0))


def test_a_model_with_only_a_whole_model_init_is_initialized_by_it():
    with torch.device("meta"):
        model = WholeInit()
    weights = MetaWeights(model, seed=0)
    assert torch.equal(weights.full("table"), torch.arange(3.0))
    torch.manual_seed(0)
    assert torch.equal(weights.full("w"), torch.empty(3, 3).normal_(std=0.5))


TP = "\nmodules {" + llama_rules("model.") + "}\n"
LAYOUTS = {
    "tp=2": "mesh tp=2\n" + TP,
    "dp=2 x tp=2, ZeRO-3": "mesh dp=2, tp=2\n\ndata_parallel over dp {\n    zero = 3\n}\n" + TP,
    "pp=2": "mesh pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 2\n}\n",
    # a pipeline rank's hollow parameters are its stages' only
    "dp=2 x pp=2, ZeRO-3": "mesh dp=2, pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 2\n}\n"
    "\ndata_parallel over dp {\n    zero = 3\n}\n",
}


@pytest.mark.slow
def test_a_meta_built_llama_starts_from_the_same_loss_under_every_layout(tmp_path):
    """Four sequences a step in each: `--batch` is per data rank, and per microbatch under a
    pipeline."""

    def first_loss(name: str, text: str, batch: int) -> float:
        plan = tmp_path / f"{name.replace(' ', '').replace(',', '')}.plan"
        plan.write_text(text)
        argv = [str(plan), "--model", META_LLAMA, "--steps", "1", "--batch", str(batch), "--seq", "16"]
        return meshplan_run(*argv, "--out", str(tmp_path / plan.stem))[0][0]["loss"]

    one = first_loss("dp=1", "mesh dp=1\n", 4)
    for (name, text), batch in zip(LAYOUTS.items(), (4, 2, 2, 1), strict=True):
        assert first_loss(name, text, batch) == pytest.approx(one, rel=1e-5), name


def test_a_whole_model_materialized_for_verify_has_the_ranks_values_and_keeps_its_ties():
    from meshplan.compiler.materialize import materialize_model

    model = materialize_model(hf_llama_meta(), seed=5)
    weights = MetaWeights(hf_llama_meta(), seed=5)
    assert not is_meta(model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights.full(name)), name
    tied = hf_llama_meta()
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    materialize_model(tied, seed=5)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_a_pipeline_rank_builds_only_the_tensors_of_its_stages():
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.compiler.lower import build_rank_program, stage_names
    from meshplan.dsl import check_text
    from meshplan.runtime.schedules import build

    source = on_meta_inputs(with_token_shape(load_model(META_LLAMA), batch=2, seq=16))
    compiled = compile_plan(check_text(LAYOUTS["pp=2"]), source)
    schedule = build("1f1b", 2, 2, None)
    first, last = (stage_names(compiled, r, axis="pp", schedule=schedule) for r in (0, 1))
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
    program = build_rank_program(compiled, source.model, 1, keep=last)
    params = dict(program.named_parameters())
    assert params["model.embed_tokens.weight"].is_meta  # the first stage's: a shape here
    assert not params["lm_head.weight"].is_meta and params["lm_head.weight"].isfinite().all()


def test_under_zero3_each_parameter_is_made_when_its_flat_takes_it():
    """`build_rank_program(defer=True)` (what a ZeRO-3 rank does): every trainable parameter is
    hollow, no bytes, until the engine asks for it; then it is the piece the rank would have
    made at once. A frozen one is made at once (no engine takes it)."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.compiler.lower import build_rank_program, place
    from meshplan.dsl import check_text
    from meshplan.runtime.hollow import fill, is_deferred, is_hollow, value_of

    source = on_meta_inputs(with_token_shape(load_model(META_LLAMA), batch=2, seq=16))
    compiled = compile_plan(check_text(LAYOUTS["dp=2 x tp=2, ZeRO-3"]), source, world_size=4, dynamic=False)
    at_once = dict(build_rank_program(compiled, hf_llama_meta(), 3, seed=7).named_parameters())
    model = hf_llama_meta()
    model.model.norm.weight.requires_grad_(False)
    program = place(build_rank_program(compiled, model, 3, seed=7, defer=True), "cpu")
    params = dict(program.named_parameters())
    assert not is_hollow(params["model.norm.weight"])
    hollow = {n: p for n, p in params.items() if n != "model.norm.weight"}
    assert all(is_hollow(p) and is_deferred(p) for p in hollow.values())
    assert sum(p.untyped_storage().nbytes() for p in hollow.values()) == 0
    for name, p in hollow.items():
        assert torch.equal(value_of(p), at_once[name]), name
        assert not is_deferred(p)  # made once: the flat keeps it
    again = place(build_rank_program(compiled, hf_llama_meta(), 3, seed=7, defer=True), "cpu")
    fill(again)  # what no engine took, made whole where it is
    for name, p in again.named_parameters():
        assert not is_hollow(p) and torch.equal(p, at_once[name]), name
