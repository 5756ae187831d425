"""`meshplan estimate`: each rank's bytes from the compiled program on meta tensors, checked
against the arithmetic of the engines (16 bytes a parameter for fp32 AdamW, divided as ZeRO
divides it) and, once, against what `meshplan run` measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.estimate import estimate
from meshplan.compiler.load import load_model, on_meta_inputs
from meshplan.compiler.print_explain import explain
from meshplan.dsl import check_text
from meshplan.examples.models.llama import build
from meshplan.main import main

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "examples/models/llama.py:build"
PARAMS = list(build().parameters())
N = sum(p.numel() for p in PARAMS)
ZERO = "mesh dp=2\n\ndata_parallel over dp {{\n    zero = {z}\n}}\n"


def compiled_for(text: str, batch: int = 2, seq: int = 16):
    plan = check_text(text, "estimate.plan")
    source = on_meta_inputs(with_token_shape(load_model(LLAMA, shapes_only=True), batch=batch, seq=seq))
    return compile_plan(plan, source, world_size=plan.mesh.world_size, dynamic=False)  # as `estimate` does


@pytest.fixture(scope="module")
def zero_plans():
    return {z: estimate(compiled_for(ZERO.format(z=z))) for z in (0, 1, 2, 3)}


def test_one_replica_holds_16_bytes_a_parameter(zero_plans):
    r = zero_plans[0].ranks[0]
    assert (r.params, r.grads) == (4 * N, 4 * N)
    assert r.optimizer == 8 * N + 4 * len(PARAMS)  # both moments and a step counter per tensor
    assert r.state == 16 * N + 4 * len(PARAMS)  # what test_memory_metrics measures
    assert r.activations > 0 and r.peak > r.params + r.optimizer + r.activations


@pytest.mark.parametrize(
    ("zero", "params", "grads"), [(1, 4 * N, 4 * N), (2, 4 * N, 2 * N), (3, 2 * N, 2 * N)]
)
def test_zero_divides_the_state_over_dp(zero_plans, zero, params, grads):
    r = zero_plans[zero].ranks[1]
    # flats are padded to the group: within a few elements a flat
    assert abs(r.params - params) <= 64 and abs(r.grads - grads) <= 64
    counters = r.optimizer - 8 * N // 2
    assert 0 <= counters - 4 < 4 * len(PARAMS) + 64
    assert [ranks for ranks, _ in zero_plans[zero].classes()] == [[0, 1]]
    if zero == 3:
        assert r.buffers > 0  # the gathered units


def test_optimizer_on_disk_is_counted_in_files_with_two_flats_on_the_host():
    """`offload = optimizer:disk` (ZeRO-1, small buckets: many flats): the fp32 master and both
    moments of this rank's half in files, as `runtime/disk_offload.py` writes them; on the host
    only the largest 2 flats' of it, what a step holds at once."""
    text = ZERO.format(z=1).replace("}", "    bucket = 16KB\n    offload = optimizer:disk\n}")
    r = estimate(compiled_for(text)).ranks[0]
    assert abs(r.disk - 12 * N // 2) <= 12 * 64  # padded to the group: a few elements a flat
    largest = max(16_000 // 4, *(p.numel() for p in PARAMS))  # a flat: a bucket, or one larger param
    assert 0 < r.host <= 2 * 12 * (largest // 2 + 64)
    assert r.optimizer == 0
    said = explain(compiled_for(text))
    assert "offload = optimizer:disk: each rank's fp32 masters and optimizer moments live in files" in said
    assert "so at most 2 flats' state is in host memory" in said


def test_pipeline_ranks_hold_their_stages_and_the_microbatches_in_flight():
    est = estimate(
        compiled_for("mesh pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 4\n}\n")
    )
    first, last = est.ranks
    assert (first.stages, last.stages) == ((0,), (1,))
    assert first.params + last.params >= 4 * N  # together every parameter; a tied one on both
    # 1F1B: the first stage keeps two microbatches' activations, the last one
    assert first.activations > last.activations > 0
    assert [r for r, _ in est.classes()] == [[0], [1]]


def test_the_command_prints_classes_json_and_a_verdict(capsys):
    plan = str(ROOT / "examples/llama_tp.plan")
    argv = ["estimate", plan, "--model", LLAMA, "--batch", "2", "--seq", "16"]
    assert main([*argv, "--json", "--memory", "1GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["ranks"]] == [0, 1] and out["fits"] is True
    keys = {"rank", "params", "grads", "optimizer", "activations", "buffers", "peak"}
    assert keys <= set(out["ranks"][0]) and out["assumptions"]["mesh"] == {"tp": 2}
    assert main([*argv, "--memory", "1MiB"]) == 3
    text = capsys.readouterr().out
    assert "ranks 0-1" in text and "does NOT fit in 1.00 MiB" in text and "checkpoint" in text


def test_bad_input_is_one_located_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "examples/tiny_dp.plan", "--model", LLAMA, "--memory", "80 gigs"])
    assert exit_.value.code == 2
    assert "argument --memory: expected a size such as 80GiB" in capsys.readouterr().err
    plan = tmp_path / "bad.plan"
    plan.write_text("mesh tp=2\n\nmodules {\n    nothing.here: column over tp\n}\n")
    assert main(["estimate", str(plan), "--model", LLAMA]) == 2
    err = capsys.readouterr().err
    assert "bad.plan:4" in err and "Traceback" not in err


def test_a_model_that_reads_its_values_outside_an_experts_rule_is_a_located_error(capsys, tmp_path):
    """The example MoE routes with `.tolist()`: under an `experts` rule meshplan prices the
    routing itself; without one the walk (on shapes alone) cannot run that line, and says so."""
    plan = tmp_path / "dp2.plan"
    plan.write_text("mesh dp=2\n")
    assert (
        main(
            ["estimate", str(plan), "--model", "examples/models/moe.py:build", "--batch", "2", "--seq", "16"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "examples/models/moe.py:" in err and "the model reads a tensor's values (`counts = " in err
    assert "Traceback" not in err and err.count("error:") == 1


def test_a_rank_keeps_its_stages_microbatches_from_forward_to_backward_and_a_split_backward_more():
    """`most_kept` walks a rank's actions: 1F1B's last stage keeps one microbatch; interleaved
    ranks add their virtual stages' at the moments they overlap (not each stage's own most);
    under ZB-H1 the last stage keeps activations until W and, from I to W, what W starts from."""
    from meshplan.compiler.liveness import most_kept
    from meshplan.runtime.schedules import build

    one_f_one_b = build("1f1b", 2, 4, None)
    assert most_kept(one_f_one_b, 1, {1: 10}, {1: 0}) == 10
    assert most_kept(one_f_one_b, 0, {0: 10}, {0: 0}) == 20  # (p - r) microbatches
    interleaved = build("interleaved", 2, 4, 2)
    stages = [s for s in range(4) if interleaved.owner[s] == 0]
    both = most_kept(interleaved, 0, dict.fromkeys(stages, 10), dict.fromkeys(stages, 0))
    each = sum(most_kept(interleaved, 0, {s: 10}, {s: 0}) for s in stages)
    assert 0 < both <= each
    zb = build("zero_bubble", 2, 4, None)
    without = most_kept(zb, 1, {1: 10}, {1: 0})
    assert most_kept(zb, 1, {1: 10}, {1: 1}) > without >= 10


@pytest.mark.parametrize("checkpointed", [False, True])
def test_attention_keeps_what_its_kernels_keep_not_seq_squared(checkpointed):
    """On meta, SDPA would run its math path and keep seq x seq probabilities for backward; the
    flash kernels the runs use keep the output and a log-sum-exp per row. Doubling the sequence
    then doubles what the blocks keep (the scores would quadruple), checkpointed or not (the
    recomputation runs the same kernel, or checkpoint refuses its different shapes)."""
    text = "mesh dp=1\n" + ("\nmodules {\n    layers.*: checkpoint\n}\n" if checkpointed else "")
    kept = [estimate(compiled_for(text, batch=2, seq=seq)).ranks[0].activations for seq in (64, 128)]
    assert 1.9 < kept[1] / kept[0] < 2.2, kept


@pytest.mark.parametrize("compress", ["", "    compress = bf16\n"], ids=["exact", "bf16"])
def test_hsdp_holds_a_shard_of_its_group_not_of_every_data_rank(compress):
    """`data_parallel over node x dp` with `zero = 2 over dp` on 2 x 2 ranks: half the state on a
    rank, not a quarter; under `compress = bf16` the flat's residual (whole) and HSDP's second
    one (of the shard) too."""
    text = f"mesh node=2, dp=2\n\ndata_parallel over node x dp {{\n    zero = 2 over dp\n{compress}}}\n"
    r = estimate(compiled_for(text)).ranks[3]
    residuals = (4 * N + 2 * N) if compress else 0
    assert abs(r.params - 4 * N) <= 64 and abs(r.grads - (2 * N + residuals)) <= 128
    assert abs(r.optimizer - 8 * N // 2) <= 4 * len(PARAMS) + 64
