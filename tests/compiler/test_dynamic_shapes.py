"""One compiled program serves every batch and sequence length its splits divide.

The graph is captured with the token inputs' batch and sequence dims as symbols: view sizes
read them at run time (`sym_size`), a sequence cut over the tensor-parallel ranks is
divided by a node of its own, and what must divide (the sequence under sequence
parallelism) is checked against the symbols when the program runs. A program compiled once
at (2, 16) matches the unpartitioned model in float64 at other shapes; a shape its splits do
not divide is one error naming the plan rule; a model or pass that needs concrete shapes is
compiled for the example's, with a warning, never for a shape it would get wrong.
"""

from __future__ import annotations

import operator
import tempfile
from pathlib import Path

import pytest
import torch
from gloo_pool import spawn
from plans import GPT2_RULES, GPT2_SEQUENCE, llama_rules, llama_sequence, plan

from meshplan.compiler.capture import SEQ, with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.executable import load_executable, save_executable, to_executable
from meshplan.compiler.load import load_model
from meshplan.dsl import check_text

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LLAMA = f"{ROOT}/examples/models/llama.py:build"
HF_LLAMA = f"{HERE}/hf_factories.py:hf_llama"
LLAMA_SP = (ROOT / "examples/llama_tp.plan").read_text()  # tp=2, the norms on sequence shards
HF_LLAMA_SP = plan(llama_rules("model.") + llama_sequence("model."))
SEQUENCE_VIEW = f"{HERE}/shape_factories.py:sequence_view"
SEQUENCE_VIEW_SP = plan(
    "\n    up: column over tp\n    down: row over tp\n    norm: sequence over tp\n"
    "    embed: vocab over tp\n    head: vocab over tp\n"
)
# (batch, seq) at which the program compiled at (2, 16) runs: other batches, other lengths
# (each even: the sequence is cut over tp=2), a batch of one
SHAPES = ((2, 16), (3, 24), (1, 10), (4, 6))


def _compile(text: str, spec: str, world_size: int = 2, batch: int = 2, seq: int = 16):
    source = with_token_shape(load_model(spec), batch=batch, seq=seq)
    return source, compile_plan(check_text(text, "dynamic.plan", world_size=world_size), source)


def parity_at_shapes(rank: int, world_size: int, plan_text: str, model_spec: str) -> list[dict]:
    """Compile once at (2, 16) in float64, then at each of `SHAPES` run one forward and backward
    of this rank's program and of the unpartitioned model on the same tokens: the relative
    difference of the loss and the worst of a gradient shard."""
    from meshplan.compiler.capture import bind_inputs
    from meshplan.compiler.graph import find_loss
    from meshplan.compiler.lower import build_rank_program, local_shard
    from meshplan.compiler.passes.precision import cast_floating
    from meshplan.runtime.mesh import init_mesh
    from meshplan.session import partial_grad_sync

    source = with_token_shape(load_model(model_spec), batch=2, seq=16)
    cast_floating(source.model, torch.float64)
    path = str(Path(tempfile.gettempdir()) / "dynamic.plan")
    compiled = compile_plan(check_text(plan_text, path, world_size=world_size), source, world_size=world_size)
    assert compiled.shapes is not None, [w.message for w in compiled.warnings]
    mesh = init_mesh(compiled.layout)
    coords = compiled.layout.coords(rank)
    reference = source.model
    results = []
    for batch, seq in SHAPES:
        run = with_token_shape(source, batch=batch, seq=seq)
        reference.zero_grad(set_to_none=True)
        ref_loss = find_loss(reference(*run.args, **run.kwargs))
        ref_loss.backward()
        program = build_rank_program(compiled, reference, rank, mesh)
        sync = partial_grad_sync(compiled, program, mesh)
        outputs = program(*bind_inputs(reference, compiled.graph, run.args, run.kwargs))
        loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        loss.backward()
        sync.finish()  # the weight gradients partial over tp (sequence-parallel norms), summed
        full = dict(reference.named_parameters(remove_duplicate=False))
        floor = 1e-6 * float(
            torch.cat([p.grad.flatten() for p in full.values() if p.grad is not None]).norm()
        )
        worst = 0.0
        for name, local in program.named_parameters(remove_duplicate=False):
            expected = local_shard(
                full[name].grad, compiled.param_placements.get(name, {}), coords, compiled.layout
            )
            worst = max(worst, float((local.grad - expected).norm()) / max(float(expected.norm()), floor))
        results.append(
            {
                "shape": (batch, seq),
                "loss": abs(float(loss.detach()) - float(ref_loss.detach())) / abs(float(ref_loss.detach())),
                "grad": worst,
            }
        )
    return results


def cases(rank: int, world_size: int) -> dict[str, list[dict]]:
    return {
        "llama_sp": parity_at_shapes(rank, world_size, LLAMA_SP, LLAMA),
        "hf_llama_sp": parity_at_shapes(rank, world_size, HF_LLAMA_SP, HF_LLAMA),
        # a view of sequence shards sized by the whole sequence: divided at run time
        "sequence_view": parity_at_shapes(rank, world_size, SEQUENCE_VIEW_SP, SEQUENCE_VIEW),
    }


@pytest.mark.slow
def test_one_program_matches_the_model_at_every_shape_it_serves():
    pytest.importorskip("transformers")
    for by_case in spawn(cases, 2, (), timeout_s=300):
        for case, rows in by_case.items():
            assert [r["shape"] for r in rows] == list(SHAPES)
            for r in rows:
                # HF's loss casts the logits to float32 inside
                bound = 1e-6 if case.startswith("hf") else 1e-12
                assert r["loss"] <= bound and r["grad"] <= max(bound, 1e-10), (case, r)


def test_the_sequence_cut_is_divided_at_run_time_and_must_divide():
    _, compiled = _compile(LLAMA_SP, LLAMA)
    shapes = compiled.shapes
    assert shapes is not None and shapes.example == (2, 16) and shapes.max_seq == 128
    (cut,) = shapes.divisible
    assert (cut.size, cut.by, cut.where) == (SEQ, 2, "dynamic.plan:19")
    assert "sequence over tp" in cut.why
    # the whole sequence (a sym_size node) over tp: one floordiv node, used by no view here,
    # since the example Llama views q, k and v only after they are gathered
    assert shapes.problems(3, 24) == [] and shapes.problems(1, 2) == []
    (problem,) = shapes.problems(2, 15)
    assert problem.startswith("--seq 15 does not divide by 2: `layers.*.{input,post_attention}_layernorm")
    assert problem.endswith("(dynamic.plan:19)")
    assert shapes.problems(2, 130) == ["--seq 130 is longer than the model's 128 positions"]
    assert shapes.multiples() == (1, 2)


def test_a_view_of_sequence_shards_reads_the_run_s_length_over_the_axis():
    _, compiled = _compile(SEQUENCE_VIEW_SP, SEQUENCE_VIEW)
    assert compiled.shapes is not None
    graph = compiled.graph.graph
    (view,) = [n for n in graph.nodes if n.target is torch.ops.aten.view.default]
    batch, seq, heads, dim = view.args[1]
    assert (heads, dim) == (4, 16) and str(batch.target) == "aten.sym_size.int"
    assert seq.target is operator.floordiv and seq.args[1] == 2  # T // tp, computed per call
    assert str(seq.args[0].target) == "aten.sym_size.int"


def test_without_sequence_parallelism_any_shape_runs():
    _, compiled = _compile(plan(llama_rules()), LLAMA)
    assert compiled.shapes is not None and compiled.shapes.divisible == ()
    assert compiled.shapes.problems(5, 7) == []


def test_a_seq_that_the_split_does_not_divide_is_a_located_error_at_compile():
    from meshplan.dsl import PlanError

    with pytest.raises(PlanError) as info:
        _compile(LLAMA_SP, LLAMA, seq=15)
    (error,) = info.value.errors
    assert error.span.line == 19  # the `sequence` rule, not an internal lint error
    assert "cuts dim 1 (size 15) into 2 shards over `tp`, and 15 does not divide by 2" in error.message


def test_the_ledger_is_of_the_example_shape():
    _, dynamic = _compile(LLAMA_SP, LLAMA)
    source = with_token_shape(load_model(LLAMA), batch=2, seq=16)
    static = compile_plan(check_text(LLAMA_SP, "dynamic.plan", world_size=2), source, dynamic=False)
    assert static.shapes is None
    assert dynamic.ledger.rows == static.ledger.rows


def test_program_pt_keeps_the_shapes_it_serves(tmp_path: Path):
    source, compiled = _compile(LLAMA_SP, LLAMA)
    save_executable(to_executable(compiled), tmp_path / "program.pt")
    loaded = load_executable(tmp_path / "program.pt", source.model)
    assert loaded.token_shape == (2, 16) and loaded.shapes == compiled.shapes
    assert loaded.shape_problems(4, 32) == []
    assert "--seq 9 does not divide by 2" in loaded.shape_problems(4, 9)[0]


def test_a_model_flattening_sequence_shards_with_the_batch_is_compiled_for_its_example_shape():
    """GPT-2's Conv1D flattens (B, T/n, H) into (B*T/n, H): blocks of T per sequence, whose
    count is the batch. Not symbolic yet: compiled for the example shape, and said."""
    pytest.importorskip("transformers")
    _, compiled = _compile(plan(GPT2_RULES + GPT2_SEQUENCE), f"{HERE}/hf_factories.py:hf_gpt2")
    assert compiled.shapes is None
    (warning,) = [w for w in compiled.warnings if "compiled for --batch 2 --seq 16 only" in w.message]
    assert warning.severity == "warning"
    executable = to_executable(compiled)
    assert executable.shape_problems(2, 16) == []
    assert executable.shape_problems(4, 16) == [
        "it was compiled for --batch 2 --seq 16 only, not --batch 4 --seq 16"
    ]


def test_a_size_one_example_is_captured_static():
    _, compiled = _compile(plan(llama_rules()), LLAMA, batch=1)
    assert compiled.shapes is None
    assert any("has a size 1" in w.message for w in compiled.warnings)
