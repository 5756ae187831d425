"""`meshplan estimate`'s step time: the walk prices what the model really runs (its FLOPs are
PyTorch's flop counter's on the real model), the layouts divide the work as they should, a
pipeline's bubble comes from its schedule, and hardware entries are read, measured and
refused as a user meets them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.estimate import estimate
from meshplan.compiler.hardware import TABLE, Hardware, Link, calibrate, hardware, write_entry
from meshplan.compiler.load import load_model, on_meta_inputs
from meshplan.compiler.step_time import ADAFACTOR_PASSES, OpCosts, collective_time, optimizer_state_bytes
from meshplan.dsl import check_text
from meshplan.examples.models.llama import build
from meshplan.grammar import OPTIMIZERS
from meshplan.main import main

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "examples/models/llama.py:build"

CPU = TABLE["cpu"]
PP = "mesh pp=2\n\npipeline over pp {{\n    schedule = {s}\n    microbatches = 4\n}}\n"


def test_collectives_cost_what_a_ring_moves():
    link = Link(bandwidth=1e9, latency=1e-5)
    # all-reduce: 2 (n-1) steps moving 2 (n-1)/n of the tensor; all-gather half of that
    assert collective_time("all_reduce", 4e6, 4, link) == pytest.approx(6e-5 + 6e6 / 1e9)
    assert collective_time("all_gather", 4e6, 4, link) == pytest.approx(3e-5 + 3e6 / 1e9)
    assert collective_time("send", 4e6, 2, link) == pytest.approx(1e-5 + 4e6 / 1e9)
    assert collective_time("all_reduce", 4e6, 1, link) == 0.0
    # a link that measured an op's latency of its own (gloo's all-gather) prices its steps at it
    gloo = dataclasses.replace(link, latencies={"all_gather": 1e-4})
    assert collective_time("all_gather", 4e6, 4, gloo) == pytest.approx(3e-4 + 3e6 / 1e9)
    assert collective_time("all_reduce", 4e6, 4, gloo) == collective_time("all_reduce", 4e6, 4, link)


def test_ranks_sharing_cores_slow_ops_and_the_collectives_others_compute_beside():
    """On a CPU of 2 cores, 4 ranks take turns: every op twice as long, and a collective of 2 of
    them (others computing meanwhile) too; one of all 4 wakes its ranks onto idle cores."""
    from meshplan.compiler.step_time import shared_cores, woken

    cpu = dataclasses.replace(hardware("cpu"), cores=2, crowding=1.0)
    assert shared_cores(cpu, 4) == 2.0 and shared_cores(cpu, 2) == 1.0
    assert woken(cpu, 4, 2) == 2.0 and woken(cpu, 4, 4) == 1.0 and woken(cpu, 2, 2) == 1.0
    assert woken(hardware("h100"), 64, 8) == 1.0  # a GPU's ranks have their own devices


def test_selective_checkpointing_costs_its_policy_on_every_op_twice():
    """torch's selective policy runs in Python for each op of a region, in the forward and again
    in backward's recomputation: the step is that much longer, and `--calibrate` measures it."""
    from meshplan.compiler.hardware import _selective_op
    from meshplan.compiler.passes.checkpoint import selective_ops

    text = "mesh dp=1\n\nmodules {\n    layers.*: checkpoint selective\n}\n"
    compiled = compiled_for(text)
    ops = selective_ops(compiled.graph)
    assert ops > 4 * 10  # every block's ops, 4 blocks
    free, policed = (
        estimate(compiled_for(text), hw=dataclasses.replace(CPU, selective_op=cost)).step_time
        for cost in (0.0, 1e-3)
    )
    assert free is not None and policed is not None
    # (the rank program's regions: the compiled graph's, less the few ops building it drops)
    assert policed - free == pytest.approx(2 * ops * 1e-3, rel=0.05)
    assert _selective_op(torch.device("cpu")) > 0
    # a pipeline's later stage receives a region's outputs as placeholders carrying its tag
    piped = text.replace("mesh dp=1", "mesh pp=2") + PP.format(s="1f1b").split("\n\n", 1)[1]
    free, policed = (
        estimate(compiled_for(piped, batch=4), hw=dataclasses.replace(CPU, selective_op=cost)).step_time
        for cost in (0.0, 1e-3)
    )
    assert free is not None and policed is not None and policed > free


def test_a_pipelines_hand_off_is_measured_through_the_pipeline():
    """`--calibrate`'s hand-off: two ranks' interleaved pipeline of small stages against its
    simulation: a message costs something, and less than the step; two such pipelines on two
    cores (a pipeline's data-parallel replicas on a CPU with fewer cores than ranks) as well."""
    from meshplan.compiler.step_time import crowding
    from meshplan.runtime.handoff_cost import can_share_cores, measure

    latency = measure(rounds=1)
    assert 0 < latency < 0.05
    if can_share_cores():
        two_cores = dataclasses.replace(CPU, cores=2, crowding=1.0)
        assert 0 < measure(rounds=1, pipelines=2, crowded=crowding(two_cores, 4, 2)) < 0.1


def test_pipelines_that_share_the_cores_with_their_replicas_wait_the_shared_hand_off():
    """dp=2 x pp=2 on a CPU of 2 cores: the two pipelines run apart until the step's end and
    wake each other's ranks' turns, so their messages wait the shared hand-off; one pipeline
    of 4 ranks (its turns ordered by its schedule), or dp x pp on a core a rank, does not."""
    dp_pp = "mesh dp=2, pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 4\n}\n"
    dp_pp += "\ndata_parallel over dp {\n    zero = 1\n}\n"
    pp4 = "mesh pp=4\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 4\n}\n"
    link = Link(bandwidth=1e9, latency=1e-4, handoff=1e-3)
    cpu = dataclasses.replace(CPU, cores=2, crowding=1.0, intra=link, inter=link)
    shared = dataclasses.replace(link, shared_handoff=5e-3)

    def step(plan: str, hw: Hardware) -> float:
        time = estimate(compiled_for(plan), hw=hw).step_time
        assert time is not None
        return time

    slower = dataclasses.replace(cpu, intra=shared, inter=shared)
    # the first microbatch's forward message and the last one's backward are on every path (the
    # other stage meanwhile computes with a core of its own: the step grows by a little less)
    assert step(dp_pp, slower) > step(dp_pp, cpu) + 4e-3
    assert step(pp4, slower) == step(pp4, cpu)
    four_cores = dataclasses.replace(slower, cores=4)
    assert step(dp_pp, four_cores) == step(dp_pp, dataclasses.replace(cpu, cores=4))


def test_the_optimizer_step_moves_the_state_of_the_plans_optimizer():
    """Per fp32 parameter element: gradient read, parameter read and written (12 B), then each
    moment read and written (8 B a moment): AdamW 28, Lion and SGD with momentum 20, plain SGD 12."""
    from meshplan.dsl.optimizer import OptimizerSpec

    params = {"w": torch.zeros(10, 100, requires_grad=True), "frozen": torch.zeros(7)}

    def per_element(kind: str, **args: float) -> float:
        spec = OptimizerSpec(kind, {**OPTIMIZERS[kind], **args})
        total, tensors = optimizer_state_bytes(params, zero=0, group_size=lambda name: 1, spec=spec)
        assert tensors == 1  # the frozen one is not stepped
        return total / 1000

    assert per_element("adamw") == 28 and per_element("lion") == 20
    assert per_element("sgd", momentum=0.9) == 20 and per_element("sgd") == 12
    assert per_element("adafactor") == 12 + 4 * ADAFACTOR_PASSES


def test_the_walk_counts_the_flops_the_model_runs():
    """One process's step: the FLOPs priced on meta tensors are the flop counter's on the real
    model's forward and backward, on the same batch (attention in PyTorch's math kernel, whose
    matmuls the counter sees; its CPU kernel it does not count)."""
    est = estimate(compiled_for("mesh dp=1\n", batch=2, seq=16), hw=CPU)
    model = build()
    ids = torch.randint(0, 256, (2, 16))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, ids).backward()
    assert est.ranks[0].time is not None
    assert est.ranks[0].time.flops == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_tensor_parallel_ranks_share_the_matmuls():
    whole = estimate(compiled_for("mesh dp=1\n", batch=4, seq=32), hw=CPU).ranks[0].time
    split = estimate(compiled_for(_read("examples/llama_tp.plan"), batch=4, seq=32), hw=CPU).ranks
    assert whole is not None and all(r.time is not None for r in split)
    per_rank = [r.time.flops for r in split if r.time is not None]
    assert per_rank[0] == pytest.approx(per_rank[1])
    assert sum(per_rank) == pytest.approx(whole.flops, rel=0.05)  # the work divided, not repeated
    assert split[0].time is not None and split[0].time.issued  # and collectives priced for it
    assert split[0].time.communication > 0


def test_a_bigger_batch_and_a_faster_device_move_the_time_the_right_way():
    small = estimate(compiled_for("mesh dp=1\n", batch=2, seq=32), hw=CPU).step_time
    large = estimate(compiled_for("mesh dp=1\n", batch=8, seq=32), hw=CPU).step_time
    h100 = estimate(compiled_for("mesh dp=1\n", batch=8, seq=32), hw=TABLE["h100"]).step_time
    assert small is not None and large is not None and h100 is not None
    assert small < large and h100 < large


def test_pipeline_ranks_wait_for_the_bubble_their_schedule_leaves():
    gpipe = estimate(compiled_for(PP.format(s="gpipe")), hw=CPU)
    ofob = estimate(compiled_for(PP.format(s="1f1b")), hw=CPU)
    # one process running the same four microbatches one after the other
    accumulated = "mesh dp=1\n\ntrain {\n    gradient_accumulation = 4\n}\n"
    one = estimate(compiled_for(accumulated), hw=CPU).ranks[0].time
    for est in (gpipe, ofob):
        first, last = (r.time for r in est.ranks)
        assert first is not None and last is not None and one is not None
        assert first.idle > 0 and last.idle > 0
        assert est.step_time == pytest.approx(first.compute + first.idle + first.communication, rel=0.2)
        # two ranks, four microbatches: about (m + p - 1) / m of half the one process's compute
        assert one.compute / 2 < est.step_time < 0.75 * one.total
    assert ofob.step_time == pytest.approx(gpipe.step_time, rel=0.1)  # the same bubble, less memory


def test_pipeline_ranks_sharing_one_core_take_turns_and_leave_it_no_bubble():
    """On one core, two pipeline ranks take turns while both compute, and in the bubble the one
    that computes has the core alone: the step is the whole model's work, as one process doing
    the four microbatches takes; on a device each (no cores shared) the stages overlap."""
    accumulated = "mesh dp=1\n\ntrain {\n    gradient_accumulation = 4\n}\n"
    one_core = dataclasses.replace(CPU, cores=1, crowding=1.0)
    shared = estimate(compiled_for(PP.format(s="1f1b")), hw=one_core).step_time
    one = estimate(compiled_for(accumulated), hw=one_core).ranks[0].time
    apart = estimate(compiled_for(PP.format(s="1f1b")), hw=dataclasses.replace(CPU, cores=None)).step_time
    assert one is not None and shared is not None and apart is not None
    assert shared == pytest.approx(one.total, rel=0.05)
    assert apart < 0.75 * shared


def test_a_split_backward_recomputes_a_checkpointed_stage_in_both_halves():
    """torch's checkpoint recomputes a region once per backward pass, and zero-bubble's input
    and weight gradients are two passes: a rank's work under it is 1F1B's plus one more
    recomputation a microbatch, what checkpointing adds to 1F1B's. Without checkpointing the
    two schedules do the same work (only its order differs). Priced without a per-op cost: the
    checkpoint's own bookkeeping (a detach of each tensor it recomputes, without grad mode) is
    counted once, its recomputed ops twice."""
    # a device each (every rank's work its own), ops priced by their FLOPs and bytes alone
    apart = dataclasses.replace(CPU, cores=None, op_overhead=0.0)
    kept = "\nmodules {\n    layers.*: checkpoint\n}\n"

    def work(schedule: str, extra: str = "") -> list[float]:
        est = estimate(compiled_for(PP.format(s=schedule) + extra), hw=apart)
        return [r.time.compute + r.time.communication for r in est.ranks if r.time is not None]

    plain, checkpointed = work("1f1b"), work("1f1b", kept)
    assert work("zero_bubble") == pytest.approx(plain, rel=1e-9)
    for once, twice, none in zip(checkpointed, work("zero_bubble", kept), plain, strict=True):
        assert once > none
        assert twice - once == pytest.approx(once - none, rel=0.02)


def test_the_command_prices_the_step_and_refuses_unknown_hardware(capsys, tmp_path):
    argv = ["estimate", "examples/llama_tp.plan", "--model", LLAMA, "--batch", "2", "--seq", "16"]
    assert main([*argv, "--hardware", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] > 0 and out["hardware"]["name"] == "h100"
    assert {"compute", "communication", "optimizer", "idle", "flops"} <= set(out["ranks"][0]["time"])
    assert main([*argv, "--hardware", "h100"]) == 0
    text = capsys.readouterr().out
    assert "step " in text and "compute" in text and "on h100 (NVIDIA H100 SXM datasheet)" in text
    assert main([*argv, "--hardware", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown hardware 'tpu': one of h100, h200, a100, cpu" in err and "Traceback" not in err
    bad = tmp_path / "mine.json"
    bad.write_text('{"name": "mine", "flops": {}}')
    assert main([*argv, "--hardware", str(bad)]) == 2
    assert "mine.json: not a hardware entry" in capsys.readouterr().err


def test_a_measured_entry_replaces_the_datasheet_and_prices_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CONFIG", str(tmp_path))
    measured = calibrate("cpu", links=False, rounds=1).hardware
    assert measured.name == "cpu" and measured.flops["float32"] > 1e8 and measured.op_overhead > 0
    assert "measured by `meshplan estimate --calibrate`" in measured.source
    path = write_entry(measured)
    assert path == tmp_path / "hardware" / "cpu.json"
    assert hardware("cpu") == measured  # what --hardware cpu now prices with
    faster = dataclasses.replace(measured, name="twice", flops={k: 2 * v for k, v in measured.flops.items()})
    write_entry(faster)
    assert hardware("twice").flops["float32"] == 2 * measured.flops["float32"]
    assert Hardware.from_json(json.loads(path.read_text())) == measured


def test_a_slow_moment_of_the_machine_is_outvoted_by_the_calibrations_other_rounds(monkeypatch):
    """A shared machine has slow seconds: each figure is the median of three rounds, so one
    round measured at half speed moves none of them."""
    import meshplan.compiler.hardware as hardware_module

    quiet = {
        "flops": {name: 1e11 for name in hardware_module.DTYPES},
        "bandwidth": 2e10,
        "cache": 2**20,
        "cache_bandwidth": 8e10,
        "overhead": 5e-6,
        "selective": 1e-5,
        "step_overhead": 2e-4,
        "optimizer_tensor": 1e-5,
    }
    slow = {k: {n: f / 2 for n, f in v.items()} if isinstance(v, dict) else v * 2 for k, v in quiet.items()}
    rounds = iter([slow, quiet, dict(quiet, overhead=6e-6)])
    monkeypatch.setattr(hardware_module, "_device_figures", lambda dev, loop: next(rounds))
    hw = calibrate("cpu", links=False).hardware
    assert hw.flops == quiet["flops"] and hw.op_overhead == 6e-6 and hw.memory_bandwidth == 2e10
    assert hw.cache_bandwidth == 8e10 and hw.optimizer_tensor == 1e-5


def test_the_loop_and_a_block_are_measured_through_what_runs_them(monkeypatch):
    """`--calibrate`'s two measurements of what a roofline misses: the training loop's own time
    (`train` itself, with few and with many parameters: one more tensor costs time, and so
    does the step), and a transformer block's ops, whose fitted bandwidth makes the block's
    priced time what it measured."""
    from meshplan.compiler import hardware as hardware_module
    from meshplan.compiler.hardware import _Block
    from meshplan.compiler.step_time import fit_block
    from meshplan.runtime.loop_cost import measure

    per_step, per_tensor = measure(torch.device("cpu"))
    assert per_step > 0 and per_tensor > 0
    measured = calibrate("cpu", links=False, rounds=1).hardware
    hw, said = fit_block(measured, torch.device("cpu"), rounds=1)
    # the fit searches from 100 MB/s to the faster of the two copies `calibrate` timed
    top = max(measured.cache_bandwidth, measured.memory_bandwidth)
    assert 0 < hw.attention <= 1 and 1e8 <= hw.cache_bandwidth <= top
    assert set(said) == {"attention", "block ops"}

    # the fit's own equation, free of the machine's noise: a clock that reads what the ops cost
    # on a machine whose ops within cache run at 3 GB/s; the block priced at the fitted
    # figures takes what that clock read
    def priced(fn, at: Hardware) -> float:
        costs = OpCosts(at)

        class Priced(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                costs(func, args, kwargs or {}, out, "")
                return out

        with Priced():
            fn()
        return costs._current.compute

    measured = dataclasses.replace(measured, cache_bandwidth=5e10, memory_bandwidth=2e10)
    machine = dataclasses.replace(measured, attention=0.5, cache_bandwidth=3e9)
    monkeypatch.setattr(hardware_module, "_timed", lambda fn, device: priced(fn, machine))
    hw, _ = fit_block(measured, torch.device("cpu"), rounds=1)
    model = torch.nn.Sequential(*[_Block(64) for _ in range(4)])
    x = torch.randn(4, 64, 64)

    def step() -> None:
        model(x).sum().backward()

    assert priced(step, hw) == pytest.approx(priced(step, machine), rel=1e-3)
    assert hw.cache_bandwidth < measured.cache_bandwidth


def test_the_loop_waits_for_the_loss_and_the_norm_over_the_axes_that_split_them():
    """Beside the engine's collectives, `meshplan run` all-reduces the loss over the batch axes
    and the gradient norm's squares over every axis that cuts a parameter and the pipeline's;
    a ring's exchange is priced once, as its send."""
    from meshplan.compiler.estimate import _loop_reductions

    dp_tp = _read("examples/llama_tp.plan").replace("mesh tp=2", "mesh dp=2, tp=2")
    dp_tp = compiled_for(dp_tp + "\ndata_parallel over dp {\n    zero = 0\n}\n")
    assert sorted(_loop_reductions(dp_tp, dict(build().named_parameters()))) == ["dp", "tp"]
    pp = compiled_for(PP.format(s="1f1b"))
    assert _loop_reductions(pp, {}) == ["pp"]
    assert _loop_reductions(compiled_for("mesh dp=1\n"), dict(build().named_parameters())) == []
    ring = "mesh cp=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n}\n"
    slow_sends = dataclasses.replace(CPU, intra=Link(1e9, 1e-5, send_latency=1.0), inter=Link(1e9, 1e-5, 1.0))
    fast_sends = dataclasses.replace(slow_sends, intra=Link(1e9, 1e-5, 0.0), inter=Link(1e9, 1e-5, 0.0))
    slow, fast = (estimate(compiled_for(ring), hw=hw).ranks[0].time for hw in (slow_sends, fast_sends))
    assert slow is not None and fast is not None
    sends = round(slow.issued["send"] - fast.issued["send"])  # one second each
    # a ring of two: each of the 4 layers shifts its keys and values once forward; backward
    # shifts them with their gradients, then the gradients home. A shift's sends are one batch
    # (`batch_isend_irecv`): its latency is paid once, not once a tensor
    assert sends == 4 * 3
    assert "recv" not in slow.issued  # each send's receive beside it: not priced again


def compiled_for(text: str, batch: int = 2, seq: int = 16):
    plan = check_text(text, "step.plan")
    source = on_meta_inputs(with_token_shape(load_model(LLAMA, shapes_only=True), batch=batch, seq=seq))
    return compile_plan(plan, source, world_size=plan.mesh.world_size, dynamic=False)  # as `estimate` does


def _read(path: str) -> str:
    return (ROOT / path).read_text()
