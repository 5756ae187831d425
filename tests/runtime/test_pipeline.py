"""Pipeline stages and their schedules on gloo, against the unpartitioned model.

The example Llama is compiled once, cut into stages (balanced automatically, or at given
cuts), and each pipeline rank runs its stages' action list (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZBV)
over the microbatches of one batch. The loss and every parameter's gradient must be those
of the whole model on the whole batch, run in the same test.
"""

from __future__ import annotations

import pytest
import torch
from gloo_pool import spawn

from meshplan.compiler.capture import bind_inputs, with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import load_model
from meshplan.compiler.lower import build_rank_program
from meshplan.compiler.stages import Cut, StageError, balanced_cuts, cut_stages
from meshplan.dsl import check_text
from meshplan.examples.models.llama import build, example_inputs
from meshplan.runtime import schedules
from meshplan.runtime.pipeline import PipelineStep, split_microbatches

BATCH, MICRO, SEQ = 8, 4, 16  # 4 microbatches of 2 sequences


def _compiled(pp: int):
    source = with_token_shape(
        load_model("meshplan.examples.models.llama:build"), batch=BATCH // MICRO, seq=SEQ
    )
    return compile_plan(
        check_text(f"mesh pp={pp}\n", path="pp.plan"), source, world_size=pp, dynamic=False
    ), source


def _reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = build()
    input_ids, labels = example_inputs(BATCH, SEQ, seed=3)
    loss = model(input_ids, labels)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def worker(rank: int, world_size: int, schedule_name: str, chunks: int) -> tuple[float, dict]:
    import torch.distributed as dist

    compiled, source = _compiled(world_size)
    stages = cut_stages(compiled.graph, balanced_cuts(compiled.graph, source.model, world_size * chunks))
    program = build_rank_program(compiled, source.model, rank)
    programs = stages.programs(program)
    schedule = schedules.build(schedule_name, world_size, MICRO, chunks)  # checked before it runs
    mine = {s: programs[s] for s in range(stages.count) if schedule.owner[s] == rank}
    step = PipelineStep(
        mine,
        schedule,
        rank=rank,
        ranks=list(range(world_size)),
        group=None,
    )
    input_ids, labels = example_inputs(BATCH, SEQ, seed=3)
    inputs = bind_inputs(source.model, program, (input_ids, labels), {})
    loss = step.run(split_microbatches(inputs, MICRO))
    dist.all_reduce(loss)
    grads = {}
    for stage in mine.values():
        for name, p in stage.named_parameters():
            grads[name] = p.grad.numpy().copy()  # plain pickling: tensors would pass by shared memory
    return float(loss), grads


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "chunks"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("zbv", 2)]
)
def test_pipeline_matches_one_device(schedule: str, chunks: int) -> None:
    results = spawn(worker, 2, (schedule, chunks))
    want_loss, want_grads = _reference()
    seen: set[str] = set()
    for loss, grads in results:
        assert loss == pytest.approx(want_loss, rel=1e-5)
        for name, grad in grads.items():
            assert name not in seen, f"{name} is held by two pipeline ranks"
            seen.add(name)
            torch.testing.assert_close(
                torch.from_numpy(grad), want_grads[name], rtol=1e-4, atol=1e-6, msg=name
            )
    assert seen == set(want_grads), "every parameter lives on exactly one pipeline rank"


def test_stage_chain_is_the_program() -> None:
    """Run in one process, the stages chained are the program: same loss, bit for bit."""
    compiled, source = _compiled(1)
    program = build_rank_program(compiled, source.model, 0)
    inputs = bind_inputs(source.model, program, source.args, source.kwargs)
    for cuts in ([Cut("before", "layers.1")], [Cut("after", "layers.0"), Cut("before", "layers.3")]):
        stages = cut_stages(compiled.graph, cuts)
        values: tuple = ()
        for s, stage in enumerate(stages.programs(program)):
            values = stage(*inputs, *values)
            if s < stages.count - 1:
                assert len(values) == len(stages.sends(s))
        assert torch.equal(values[0], program(*inputs)[0])
        # only the hidden state crosses: rotary tables and masks are recomputed per stage
        assert all(len(r) == 1 for r in stages.receives[1:]), stages.receives


def test_balanced_cuts_weigh_the_head() -> None:
    """The LM head's matmul is the costliest op: balancing moves a layer off the last stage."""
    compiled, source = _compiled(1)
    cuts = balanced_cuts(compiled.graph, source.model, 2)
    stages = cut_stages(compiled.graph, cuts)
    assert cuts == [Cut("before", "layers.2")]
    assert max(stages.cost) / sum(stages.cost) < 0.6
    with pytest.raises(StageError, match="5 stages, but `layers` has 4 layers"):
        balanced_cuts(compiled.graph, source.model, 5)
    with pytest.raises(StageError, match="leave a stage with no operation"):
        cut_stages(compiled.graph, [Cut("before", "layers.1"), Cut("after", "layers.0")])


def test_explain_shows_the_stages_and_the_cuts_to_freeze_them() -> None:
    """`explain` lists each stage with its rank, modules and share of the FLOPs, and the chosen
    cuts as plan text; pasted into the plan, those cuts make the same stages."""
    from pathlib import Path

    from meshplan.compiler.print_explain import explain

    root = Path(__file__).resolve().parents[2]
    text = (root / "examples/llama_pipeline.plan").read_text()
    source = with_token_shape(load_model("meshplan.examples.models.llama:build"), batch=2, seq=SEQ)
    compiled = compile_plan(check_text(text, "p.plan"), source, world_size=4, dynamic=False)
    shown = explain(compiled)
    assert "4 stages balanced automatically by FLOPs" in shown
    assert "stage 0 on rank 0: embed_tokens, layers.0  (23% of the FLOPs; receives the inputs)" in shown
    assert "stage 3 on rank 1: layers.3, norm, lm_head  (31% of the FLOPs" in shown
    cuts = [line.strip() for line in shown.splitlines() if line.strip().startswith("cut ")]
    assert cuts == ["cut before layers.1", "cut before layers.2", "cut before layers.3"]
    frozen = text.replace("microbatches = 4", "microbatches = 4\n    " + "\n    ".join(cuts))
    again = compile_plan(check_text(frozen, "p.plan"), source, world_size=4, dynamic=False)
    assert again.graph.meta["meshplan.stages"] == compiled.graph.meta["meshplan.stages"]
    assert "at the plan's cuts" in explain(again)


WEIGHTY = """from meshplan.examples.models import llama


def build():
    return llama.build(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4)
"""


def _bf16_worker(rank: int, world_size: int, factory: str, schedule_name: str, share: bool) -> tuple:
    """One bf16 step of `schedule_name` on a weight-heavy Llama: loss, gradients, and the tensor
    bytes live when the step's first backward starts (what its forwards keep)."""
    import torch.distributed as dist

    from meshplan.compiler.liveness import LiveBytes
    from meshplan.compiler.lower import shared_cast_stages

    source = with_token_shape(load_model(factory), batch=BATCH // MICRO, seq=SEQ)
    text = f"mesh pp={world_size}\n\nprecision {{\n    compute = bf16\n}}\n"
    compiled = compile_plan(check_text(text, path="pp.plan"), source, world_size=world_size, dynamic=False)
    stages = cut_stages(compiled.graph, balanced_cuts(compiled.graph, source.model, world_size))
    program = build_rank_program(compiled, source.model, rank)
    schedule = schedules.build(schedule_name, world_size, MICRO, 1)
    programs = stages.programs(program, share_casts=shared_cast_stages(schedule) if share else ())
    mine = {s: programs[s] for s in range(stages.count) if schedule.owner[s] == rank}
    step = PipelineStep(mine, schedule, rank=rank, ranks=list(range(world_size)), group=None)
    inputs = bind_inputs(source.model, program, example_inputs(BATCH, SEQ, seed=3), {})
    tracker = LiveBytes(lambda: "")
    kept: list[int] = []
    backward = torch.autograd.backward

    def first_backward(*args, **kwargs):
        kept.append(tracker.live)
        return backward(*args, **kwargs)

    torch.autograd.backward = first_backward  # the pipeline calls it for every B
    try:
        with tracker:
            loss = step.run(split_microbatches(inputs, MICRO))
    finally:
        torch.autograd.backward = backward  # the process runs other jobs after this one
    dist.all_reduce(loss)
    grads = {n: p.grad.float().numpy().copy() for st in mine.values() for n, p in st.named_parameters()}
    return float(loss), grads, kept[0]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_weights_cast_is_made_once_a_step_for_the_microbatches_in_flight(tmp_path, schedule: str) -> None:
    """Under bf16, stage 0 keeps several microbatches in flight (GPipe all 4, 1F1B 2): its
    weights' bf16 casts are made once for them (`runtime/shared_cast.py`), the numbers bit for bit
    the same, and what the forwards keep for the first backward is 3 (GPipe) or 1 (1F1B) bf16
    copies of the stage's weights fewer. (ZB-H1's split backward is held to bit identity with
    shared casts by `test_pipeline_matches_one_device` and the verify matrix.)"""
    (tmp_path / "weighty.py").write_text(WEIGHTY)
    factory = f"{tmp_path / 'weighty.py'}:build"
    apart = spawn(_bf16_worker, 2, (factory, schedule, False))
    shared = spawn(_bf16_worker, 2, (factory, schedule, True))
    for (loss_a, grads_a, _), (loss_s, grads_s, _) in zip(apart, shared, strict=True):
        assert loss_a == loss_s
        for name, grad in grads_a.items():
            assert (grad == grads_s[name]).all(), name
    # stage 0's weights in bf16 that an op keeps for backward (the embedding's lookup keeps its ids)
    stage0 = sum(g.size for name, g in apart[0][1].items() if "embed_tokens" not in name) * 2
    fewer = {"gpipe": 3, "1f1b": 1}[schedule] * stage0
    assert 0.95 * fewer <= apart[0][2] - shared[0][2] <= 1.05 * fewer, (apart[0][2], shared[0][2], stage0)
