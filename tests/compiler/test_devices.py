"""Module placement (`on cpu`, `on cuda:N`), one process: the copies the devices pass puts at a
placed module's boundary, what the ledger, `explain` and the program say of them, the tensors
that stay where the rule puts them (through `program.pt` and ZeRO's units), and the located
errors. Training with it is tests/cli/test_run_devices.py; real copies, tests/gpu/."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from plans import data_parallel, plan

from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.estimate import estimate
from meshplan.compiler.executable import load_executable, save_executable, to_executable
from meshplan.compiler.load import load_model
from meshplan.compiler.lower import build_rank_program, place, placed_names
from meshplan.compiler.print_explain import explain
from meshplan.compiler.print_ledger import ledger_table
from meshplan.compiler.print_program import annotated_code
from meshplan.dsl import PlanError, check_text
from meshplan.main import main
from meshplan.runtime.device_copy import DeviceCopy
from meshplan.runtime.zero_nodes import ZeroGather

LLAMA = "meshplan.examples.models.llama:build"  # 4 layers, hidden 64, vocabulary 256
GPT = "meshplan.examples.models.gpt:build"  # the embedding is the LM head: one tied parameter
ON_CPU = "\n    lm_head:      on cpu\n    embed_tokens: on cpu\n"
B, T, H, V = 2, 16, 64, 256


@functools.cache
def compiled(zero: int | None = 0, rules: str = ON_CPU, mesh: str = "dp=2", spec: str = LLAMA):
    """`rules` compiled under `mesh`, with a `data_parallel` block of `zero` (None: none)."""
    text = plan(rules, mesh=mesh, extra=data_parallel(zero=zero) if zero is not None else "")
    return compile_plan(check_text(text, "p.plan"), with_token_shape(load_model(spec), batch=B, seq=T))


def refusal(rules: str, *, mesh: str = "dp=2", extra: str = "", spec: str = LLAMA) -> str:
    text = plan(rules, mesh=mesh, extra=extra)
    with pytest.raises(PlanError) as info:
        compile_plan(
            check_text(text, "p.plan"), with_token_shape(load_model(spec), batch=B, seq=T), dynamic=False
        )
    return info.value.render()


def copies(c) -> dict[str, str]:
    return {
        str(n.target): c.graph.get_submodule(str(n.target)).to_device
        for n in c.graph.graph.nodes
        if n.op == "call_module" and isinstance(c.graph.get_submodule(str(n.target)), DeviceCopy)
    }


def test_activations_cross_the_boundary_through_one_copy_each() -> None:
    c = compiled()
    # the token ids to the host for the embedding, its output back; the head's input to the
    # host, the logits back
    assert copies(c) == {"to_host": "cpu", "to_device": "device", "to_host_1": "cpu", "to_device_1": "device"}
    assert placed_names(c.graph) == {"embed_tokens.weight": "cpu", "lm_head.weight": "cpu"}
    linear = next(n for n in c.graph.graph.nodes if n.args and str(n.args[-1]) == "lm_head_weight")
    assert str(linear.args[0]) == "to_host_1"


def test_the_ledger_counts_each_copy_both_ways_with_its_bytes() -> None:
    rows = {(r.node, r.phase, r.op): r.bytes for r in compiled().ledger.rows if r.kind == "device_copy"}
    assert rows == {
        ("to_host", "forward", "copy_to_host"): B * T * 8,  # int64 ids: no gradient comes back
        ("to_device", "forward", "copy_to_device"): B * T * H * 4,
        ("to_device", "backward", "copy_to_host"): B * T * H * 4,
        ("to_host_1", "forward", "copy_to_host"): B * T * H * 4,
        ("to_host_1", "backward", "copy_to_device"): B * T * H * 4,
        ("to_device_1", "forward", "copy_to_device"): B * T * V * 4,
        ("to_device_1", "backward", "copy_to_host"): B * T * V * 4,
    }
    summary = compiled().ledger.summary()
    total = (B * T * 8 + 4 * B * T * H * 4 + 2 * B * T * V * 4) / 1e6
    assert summary.endswith(f"; 7 device copies per step (4 forward, 3 backward), {total:.3f} MB")
    assert summary.startswith("2 collectives per step")  # the device's bucket and the host's


def test_the_host_parameters_are_reduced_apart_in_buckets_of_their_own() -> None:
    rows = {r.node: r.bytes for r in compiled().ledger.rows if r.kind == "dp_bucket"}
    assert rows["host bucket 0"] == 2 * V * H * 4  # the embedding and the head, nothing else
    every = sum(p.numel() for p in load_model(LLAMA).model.parameters()) * 4
    assert rows["bucket 0"] == every - rows["host bucket 0"]


def test_explain_and_the_program_show_the_copies() -> None:
    text = explain(compiled())
    assert "held on the host with their gradients and optimizer state: lm_head.weight" in text
    assert (
        "device copies per step: 1 copy_to_device forward (32.8 KB), 1 copy_to_host forward (8.2 KB), "
        "1 copy_to_device backward (8.2 KB), 1 copy_to_host backward (32.8 KB)"
    ) in text
    assert "parameters a device rule holds on the host are reduced apart, in buckets of their own" in text
    table = ledger_table(compiled())
    assert "forward   copy_to_device  host  (2, 16, 256)          32768      1  p.plan:4" in table
    code = annotated_code(compiled())
    assert "to_device_1 = self.to_device_1(linear" in code
    assert (
        "# copy to the rank's device (lm_head), (batch, seq, 256) 32,768 B; backward copies the gradient"
        in code
    )
    assert "lm_head_weight = self.lm_head.weight  # held on the host by a device rule" in code


def test_zero_leaves_the_host_parameters_out_of_its_units() -> None:
    c = compiled(zero=3)
    gathered = {p for m in c.graph.modules() if isinstance(m, ZeroGather) for p in m.params}
    assert gathered and not gathered & {"lm_head.weight", "embed_tokens.weight"}
    rows = [r for r in c.ledger.rows if r.node.startswith("host ")]
    # ZeRO-2 at most on the host: the gradient reduce-scattered, the parameters gathered after the step
    assert {(r.op, r.phase) for r in rows} == {
        ("reduce_scatter", "backward"),
        ("all_gather", "step"),
        ("all_reduce", "step"),
    }


def test_the_estimate_holds_the_placed_state_on_the_host() -> None:
    placed, plain = estimate(compiled()), estimate(compiled(rules="\n    norm: precision fp32\n"))
    head_and_embedding = 2 * V * H
    # 4 bytes each of parameter, gradient and the two moments (and AdamW's step counters)
    assert placed.ranks[0].host >= 16 * head_and_embedding
    assert plain.ranks[0].params - placed.ranks[0].params == 4 * head_and_embedding


def test_program_pt_keeps_where_each_tensor_lives(tmp_path: Path) -> None:
    path = tmp_path / "program.pt"
    save_executable(to_executable(compiled()), path)
    loaded = load_executable(path, load_model(LLAMA).model)
    assert placed_names(loaded.graph) == {"embed_tokens.weight": "cpu", "lm_head.weight": "cpu"}
    program = place(build_rank_program(loaded, load_model(LLAMA).model, 0), "cpu")
    bound = {m.to_device: m.target() for m in program.modules() if isinstance(m, DeviceCopy)}
    assert bound == {"cpu": torch.device("cpu"), "device": torch.device("cpu")}  # on a CPU: no-ops


def test_an_unplaced_copy_and_a_meta_tensor_pass_through() -> None:
    x = torch.ones(2)
    assert DeviceCopy("device")(x) is x  # never bound: the program was not placed
    assert DeviceCopy("cpu")(x) is x
    meta = torch.empty(2, device="meta")
    assert DeviceCopy("cuda:1")(meta) is meta  # the estimate's walk


# ---------------------------------------------------------------------------- refused, at the rule


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="this machine has a second CUDA device")
def test_on_cuda_1_without_that_device_is_a_located_error_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    path = tmp_path / "p.plan"
    path.write_text("mesh dp=1\n\nmodules {\n    lm_head: on cuda:1\n}\n")
    assert main(["check", str(path), "--model", LLAMA]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4:14: error: `on cuda:1` places modules on CUDA device 1, but this machine has" in err
    assert "        lm_head: on cuda:1\n                 ^~~~~~~~~\n" in err
    assert "hint: compile on the machine that runs the plan, or place the module `on cpu`" in err


def test_a_placed_module_that_communicates_is_refused() -> None:
    rendered = refusal(
        "\n    layers.*.mlp.{gate,up}_proj: column over tp\n    layers.*.mlp.down_proj: row over tp\n"
        "    layers.0.mlp: on cpu\n",
        mesh="tp=2",
    )
    assert (
        "p.plan:6:19: error: `layers.0.mlp.down_proj` is placed on cpu by `layers.0.mlp: on cpu` but "
        "communicates over `tp` (all_reduce)"
    ) in rendered
    assert "p.plan:5:5: note: the rule that splits it" in rendered


def test_a_vocab_parallel_head_on_the_host_computes_its_shard_there() -> None:
    """The head's f and the vocab-parallel loss run on the device; the head's shard of the
    logits is computed on the host, between two copies."""
    c = compiled(None, "\n    lm_head: vocab over tp\n    lm_head: on cpu\n", "tp=2")
    assert copies(c) == {"to_host": "cpu", "to_device": "device"}
    rows = {(r.node, r.phase): r.shape for r in c.ledger.rows if r.kind == "device_copy"}
    assert rows[("to_device", "forward")] == (B, T, V // 2)  # this rank's vocabulary shard


def test_a_weight_tied_across_the_boundary_is_refused() -> None:
    rendered = refusal("\n    lm_head: on cpu\n", spec=GPT)
    assert "p.plan:4:14: error: weight `wte.weight` would be read on two devices" in rendered


def test_under_a_pipeline_it_is_refused() -> None:
    rendered = refusal(
        "\n    embed_tokens: on cpu\n", mesh="pp=2", extra="\npipeline over pp {\n    schedule = gpipe\n}\n"
    )
    assert "p.plan:4:19: error: device placement under a pipeline is not lowered yet" in rendered
    assert rendered.count("error:") == 1


def test_on_cuda_without_an_index_is_the_rank_s_device() -> None:
    """`on cuda` carves a module out of a placed parent: it runs where the rank runs."""
    c = compiled(rules="\n    layers.0: on cpu\n    layers.0.mlp: on cuda\n")
    placed = placed_names(c.graph)
    assert "layers.0.self_attn.q_proj.weight" in placed and "layers.0.mlp.up_proj.weight" not in placed
