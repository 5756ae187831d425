"""The activation-checkpointing pass: what it outlines, identical numbers, less memory.

(Named test_checkpoint_pass.py: tests/runtime/test_checkpoint.py exists, and test folders
have no __init__.py, so basenames must differ.)

Single process for the pass's promises and numerics without tensor parallelism; the fake
process group for a tensor-parallel graph's regions and the collectives their
recomputation re-issues; two gloo processes for tensor-parallel numerics.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist
from gloo_pool import spawn
from torch import fx
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.compiler.meta import CheckpointRegion, checkpoint_region
from meshplan.compiler.passes.checkpoint import (
    CheckpointError,
    Region,
    checkpoint_regions,
    collective_nodes,
    regions_from,
)
from meshplan.dsl import check_text
from meshplan.examples.models import llama
from meshplan.runtime.mesh import init_mesh

aten = torch.ops.aten

TP_SP = """
mesh tp=2

modules {{
    layers.*.self_attn.{{q,k,v}}_proj:            column over tp
    layers.*.self_attn.o_proj:                  row over tp
    layers.*.mlp.{{gate,up}}_proj:                column over tp
    layers.*.mlp.down_proj:                     row over tp
    embed_tokens:                               vocab over tp
    lm_head:                                    vocab over tp
    layers.*.{{input,post_attention}}_layernorm: sequence over tp
    norm:                                       sequence over tp
{extra}}}
"""


def plan_text(rule: str | None) -> str:
    return f"mesh dp=1\n\nmodules {{\n    layers.*: {rule}\n}}\n" if rule else "mesh dp=1\n"


def compile_checkpointed(text: str, source: ModelSource):
    """compile_plan runs the checkpoint pass last, after tensor parallelism."""
    return compile_plan(check_text(text, "t.plan"), source)


@pytest.fixture(scope="module")
def source() -> ModelSource:
    torch.manual_seed(0)
    return ModelSource("llama", llama.build(), llama.example_inputs(), {})


@pytest.fixture(scope="module")
def programs(source):
    """Single-process rank programs (fresh parameters from the same model) per checkpoint rule."""
    out = {}
    for rule in (None, "checkpoint", "checkpoint every 2", "checkpoint selective"):
        compiled = compile_checkpointed(plan_text(rule), source)
        out[rule] = (compiled, build_rank_program(compiled, source.model, 0))
    return out


@pytest.fixture(scope="module")
def eager(source):
    model = copy.deepcopy(source.model)
    loss = model(*source.args)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def regions_of(gm: fx.GraphModule) -> dict[str, CheckpointRegion]:
    return {r.path: r for n in gm.graph.nodes if (r := checkpoint_region(n)) is not None}


# ---------------------------------------------------------------------------- what the pass builds


def test_every_k_takes_every_kth_match_from_the_first(programs):
    compiled, _ = programs["checkpoint every 2"]
    assert [r.path for r in regions_from(compiled.plan, compiled.resolution)] == ["layers.0", "layers.2"]
    assert list(regions_of(compiled.graph)) == ["layers.0", "layers.2"]


def test_modes_and_rules_are_on_the_call_node(programs):
    full, _ = programs["checkpoint"]
    selective, _ = programs["checkpoint selective"]
    assert list(regions_of(full.graph)) == [f"layers.{i}" for i in range(4)]
    info = regions_of(selective.graph)["layers.1"]
    assert info.mode == "selective" and info.target == "checkpoint_layers_1"
    assert info.rule is not None and info.rule.span.line == 4 and info.rule.pattern == "layers.*"
    assert {i.mode for i in regions_of(full.graph).values()} == {"full"}


def test_nested_regions_keep_the_outermost(source):
    text = "mesh dp=1\n\nmodules {\n    layers.*: checkpoint\n    layers.*.mlp: checkpoint selective\n}\n"
    compiled = compile_plan(check_text(text, "t.plan"), source)
    regions = regions_from(compiled.plan, compiled.resolution)
    assert [(r.path, r.mode) for r in regions] == [(f"layers.{i}", "full") for i in range(4)]


def test_printed_call_names_the_region_and_its_inputs(programs):
    compiled, _ = programs["checkpoint every 2"]
    code = compiled.graph.code
    assert "checkpoint_layers_0 = self.checkpoint_layers_0\n" in code
    assert (
        "layers_0 = torch.utils.checkpoint.checkpoint(checkpoint_layers_0, embedding, "
        "layers_0_input_layernorm_weight, layers_0_self_attn_q_proj_weight, " in code
    )
    assert "use_reentrant = False)" in code
    selective, _ = programs["checkpoint selective"]
    assert "use_reentrant = False, context_fn = SelectiveContext.SAVE_MATMULS)" in selective.graph.code
    # layers.1 is not checkpointed: its ops stay in the outer graph
    assert "linear_7 = torch.ops.aten.linear.default(mul_10, layers_1_self_attn_q_proj_weight)" in code


def test_regions_hold_no_parameters(programs, source):
    compiled, program = programs["checkpoint"]
    for name in regions_of(compiled.graph):
        region = compiled.graph.get_submodule("checkpoint_" + name.replace(".", "_"))
        assert not list(region.parameters()) and not list(region.buffers())
    # the rank program's parameters are exactly the model's, once each: optimizers see them all
    names = sorted(n for n, _ in program.named_parameters())
    assert names == sorted(n for n, _ in source.model.named_parameters())


def test_interleaved_region_is_refused():
    gm = fx.symbolic_trace(_Interleaved())
    for node in gm.graph.nodes:
        node.meta["meshplan.module"] = {"sin": "a", "cos": "b", "tanh": "a"}.get(node.name, "")
    with pytest.raises(CheckpointError, match="interleaved with `cos`"):
        checkpoint_regions(gm, [Region("a")])


class _Interleaved(torch.nn.Module):
    def forward(self, x):
        a1 = torch.sin(x)
        b = torch.cos(a1)  # another module's op, using region a's output, before a ends
        a2 = torch.tanh(b)
        return a2


# ---------------------------------------------------------------------------- numbers


def run(program, source, mode: TorchDispatchMode | None = None):
    """Loss and gradients of one step; `mode` (if given) watches the backward only."""
    for p in program.parameters():
        p.grad = None
    (loss,) = program(*source.args)
    if mode is None:
        loss.backward()
    else:
        with mode:
            loss.backward()
    return loss.detach(), {name: p.grad for name, p in program.named_parameters()}


@pytest.mark.parametrize("rule", ["checkpoint", "checkpoint every 2", "checkpoint selective"])
def test_checkpointed_numbers_are_bit_identical(programs, source, eager, rule):
    loss, grads = run(programs[rule][1], source)
    plain_loss, plain_grads = run(programs[None][1], source)
    eager_loss, eager_grads = eager
    assert torch.equal(loss, plain_loss) and torch.equal(loss, eager_loss)
    assert grads.keys() == plain_grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name
        assert torch.equal(grad, eager_grads[name]), name


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def test_selective_recomputes_fewer_ops_and_no_matmul(programs, source):
    counts = {}
    for rule in (None, "checkpoint", "checkpoint selective"):
        mode = CountOps()
        run(programs[rule][1], source, mode)
        counts[rule] = mode.ops
    recomputed = {rule: counts[rule].total() - counts[None].total() for rule in counts}
    assert 0 < recomputed["checkpoint selective"] < recomputed["checkpoint"]
    # backward's own matmuls only: selective keeps every forward matmul's output
    assert counts["checkpoint selective"][aten.mm.default] == counts[None][aten.mm.default]
    assert counts["checkpoint"][aten.mm.default] > counts[None][aten.mm.default]


class LiveActivations(TorchDispatchMode):
    """Bytes of the storages made during forward that are still alive after it: what
    autograd keeps for backward (saved tensors, the selective cache, checkpoint inputs).

    Counting through `saved_tensors_hooks` would miss most of it: checkpointing installs
    its own hooks inside the region, and selective checkpointing caches outside them.
    """

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[object, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


def activation_bytes(program, source) -> int:
    watch = LiveActivations()
    with watch:
        (loss,) = program(*source.args)
    live = watch.live_bytes()
    loss.backward()
    return live


def test_checkpointing_keeps_fewer_activation_bytes(programs, source):
    kept = {rule: activation_bytes(programs[rule][1], source) for rule in programs}
    assert kept["checkpoint"] < kept["checkpoint selective"] < kept[None]
    assert kept["checkpoint"] < kept["checkpoint every 2"] < kept[None]


BF16 = "mesh dp=1\n\nmodules {\n    layers.*: checkpoint\n}\n\nprecision {\n    compute = bf16\n}\n"


def test_a_region_recasts_its_weights_instead_of_keeping_their_bf16_copies(source, monkeypatch):
    """Under bf16 compute, a checkpointed layer takes its fp32 weights (references) and casts
    them inside: forward keeps no bf16 weight of a checkpointed layer for backward, the step's
    numbers are bit for bit those of the region that takes the casts as inputs."""
    recast = compile_checkpointed(BF16, source)
    region = recast.graph.get_submodule("checkpoint_layers_1")
    casts = [n for n in region.graph.nodes if n.target is aten._to_copy.default and "weight" in n.name]
    assert len(casts) == 9  # q, k, v, o, gate, up, down and the two norms
    monkeypatch.setattr("meshplan.compiler.passes.checkpoint._weight_casts", lambda nodes: [])
    kept_casts = compile_checkpointed(BF16, source)
    programs = {
        "recast": build_rank_program(recast, source.model, 0),
        "kept": build_rank_program(kept_casts, source.model, 0),
    }
    kept = {name: activation_bytes(program, source) for name, program in programs.items()}
    weights = sum(
        p.numel() * 2 for n, p in source.model.named_parameters() if n.startswith("layers.") and p.dim() >= 1
    )
    assert kept["kept"] - kept["recast"] == weights  # every layer's bf16 weights, no more
    (loss_a,), (loss_b,) = programs["recast"](*source.args), programs["kept"](*source.args)
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    grads = dict(programs["kept"].named_parameters())
    for name, p in programs["recast"].named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name


# ---------------------------------------------------------------------------- tensor parallel


def c10d_counts(program, source) -> tuple[collections.Counter, collections.Counter]:
    forward, backward = CountOps(), CountOps()
    with forward:
        (loss,) = program(*source.args)
    with backward:
        loss.backward()

    def c10d(mode):
        return collections.Counter({str(op): n for op, n in mode.ops.items() if op.namespace == "c10d"})

    return c10d(forward), c10d(backward)


# the c10d op a collective module issues in forward, by kind (copy_to and split issue none)
FORWARD_WIRE = {
    "all_reduce": "c10d.allreduce_.default",
    "all_gather": "c10d._allgather_base_.default",
    "gather_replicated": "c10d._allgather_base_.default",
    "reduce_scatter": "c10d._reduce_scatter_base_.default",
}


@pytest.mark.parametrize("mode", ["checkpoint", "checkpoint selective"])
def test_tensor_parallel_regions_run_on_the_fake_process_group(source, mode):
    plain = compile_plan(check_text(TP_SP.format(extra=""), "t.plan"), source)
    compiled = compile_checkpointed(TP_SP.format(extra=f"    layers.*: {mode}\n"), source)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_mesh(compiled.layout)
        program = build_rank_program(compiled, source.model, 0, mesh)
        region = program.checkpoint_layers_0
        # the region calls the rank's own collectives, bound to the tp group
        assert region.all_gather_tp is program.all_gather_tp
        assert region.all_gather_tp.group is mesh.get_group("tp")
        assert not list(region.parameters())
        forward, backward = c10d_counts(program, source)
        plain_forward, plain_backward = c10d_counts(build_rank_program(plain, source.model, 0, mesh), source)
    finally:
        dist.destroy_process_group()
    assert forward == plain_forward
    # backward = the plain backward + the forward collectives the recomputation re-issues
    again = collections.Counter()
    for node, recomputed in collective_nodes(compiled.graph):
        kind = node.meta["meshplan.collective"]["kind"]
        if recomputed and kind in FORWARD_WIRE:
            again[FORWARD_WIRE[kind]] += 1
    # per block: the gather before q/k/v, the reduce-scatter after o_proj, the gather before
    # the MLP; not the reduce-scatter after down_proj (nothing after it is saved)
    assert again == {"c10d._allgather_base_.default": 8, "c10d._reduce_scatter_base_.default": 4}
    assert backward == plain_backward + again


def _tp_worker(rank: int, world_size: int) -> dict[str, bool]:
    torch.manual_seed(0)
    source = ModelSource("llama", llama.build(), llama.example_inputs(), {})
    plain = compile_plan(check_text(TP_SP.format(extra=""), "t.plan"), source)
    mesh = init_mesh(plain.layout)
    results = {}
    reference = run(build_rank_program(plain, source.model, rank, mesh), source)
    for mode in ("checkpoint", "checkpoint selective"):
        compiled = compile_checkpointed(TP_SP.format(extra=f"    layers.*: {mode}\n"), source)
        loss, grads = run(build_rank_program(compiled, source.model, rank, mesh), source)
        results[mode] = torch.equal(loss, reference[0]) and all(
            torch.equal(g, reference[1][n]) for n, g in grads.items()
        )
    return results


@pytest.mark.slow
def test_tensor_parallel_checkpointing_is_bit_identical_on_gloo():
    for rank, result in enumerate(spawn(_tp_worker, 2)):
        assert result == {"checkpoint": True, "checkpoint selective": True}, rank
