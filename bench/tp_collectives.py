"""Collectives per training step: meshplan's TP vs the analytical minimum, vs what really runs, vs PyTorch.

    python bench/tp_collectives.py

Model: the example Llama (4 layers, H=64, V=256, GQA 4/2 heads), inputs B=2, S=16, fp32,
tp=2 on 2 gloo ranks. Two layouts:

    TP     bench/plans/llama_tp_nosp.plan   column q,k,v / row o, column gate,up / row down,
                                             vocab-parallel embedding and LM head
    TP+SP  examples/llama_tp.plan           the same plus `sequence` on every norm

Columns of the table (calls per step; the `bytes` line sums tensor bytes as the ledger
counts them: the whole tensor of an all-reduce, the whole gathered/scattered tensor of an
all-gather/reduce-scatter; ring traffic per rank is 2(n-1)/n resp. (n-1)/n of that):

    minimum   the analytical Megatron minimum for the layout (below)
    ledger    meshplan's `compiled.ledger`
    wrapped   meshplan's compiled program, one step: calls of the wrapped
              torch.distributed / functional-collective entry points (bench/common.py)
    c10d      the same step, collectives the process group ran (profiler `c10d::*` op events,
              which every Python entry point ends in)
    pytorch   `parallelize_module` with Colwise/RowwiseParallel (+ SequenceParallel) on the
              same modules, `loss_parallel()`; wrapped calls ([c10d count] after it where different)
    megatron  a hand-written Megatron TP of the same model (TP only; bench/common.py)

The minimum, with L blocks, N = B*S tokens, H hidden, fp32. TP:
    forward  all-reduce  2L of N*H   g after each row split (o_proj, down_proj)
                         1  of N*H   vocab-parallel embedding: each rank looks up its own vocab
                                     rows, the partial lookups are summed
                         3  of N     vocab-parallel cross-entropy: max, sum of exp, target
                                     logit, one float per token each (Megatron's three)
    backward all-reduce  2L of N*H   f before each column group (q,k,v share one; gate,up one)
                         1  of N*H   f before the vocab-parallel LM head
    Norm weights are replicated and see the whole sequence: their gradients need nothing.
TP+SP: every g becomes a reduce-scatter and every f an all-gather (forward), each with its
conjugate in backward (all-gather resp. reduce-scatter), so 2L+1 of each per direction,
of N*H; the loss keeps its 3 all-reduces of N; and each of the 2L+1 norm weights now sees
only its sequence shard, so its gradient is a partial sum: one all-reduce of (2L+1)*H in
backward, the norms coalesced into one call as Megatron does (meshplan: in the gradient
sync's bucket, `Compiled.grad_sums`; one all-reduce per norm would move the same bytes in
2L+1 calls).
Saving the gathered activations rather than re-gathering in backward is assumed (no
activation recomputation), as Megatron does without `--recompute-*`.

A step is forward, backward and AdamW: PyTorch leaves the gradients of replicated
parameters used on sequence shards as `Partial` DTensors, and their all-reduce runs
inside `optimizer.step()`, so that phase is counted too (meshplan issues nothing there).
The step counted is the second one (the first is a warm-up, uncounted).

A last line counts the transformer blocks alone (`bench/plans/llama_tp_blocks.plan`, and
PyTorch's styles on the same linears, embedding and LM head replicated): minimum 2L
all-reduces forward and 2L backward. PyTorch's ColwiseParallel turns the gradient of its
replicated input from Partial to Replicate inside each module, so q, k, v (and gate, up)
each all-reduce their own input gradient: 5L in backward instead of 2L.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator

import torch
from common import (
    OPS,
    PHASES,
    PLAN_TP,
    PLAN_TP_BLOCKS,
    PLAN_TP_SP,
    CollectiveCounter,
    DispatchCounter,
    MegatronLlama,
    Tally,
    llama_source,
    parallelize_with_pytorch,
)
from torch.distributed.tensor.parallel import loss_parallel

from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.ledger import Ledger
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl import load_plan
from meshplan.runtime.launch import spawn
from meshplan.runtime.mesh import init_mesh
from meshplan.session import partial_grad_sync

WORLD = 2
BATCH, SEQ = 2, 16


def minimum(num_layers: int, tokens: int, hidden: int, *, sequence_parallel: bool) -> Tally:
    """The analytical minimum of the module docstring, as a Tally (fp32)."""
    act, per_token = tokens * hidden * 4, tokens * 4
    pairs = 2 * num_layers + 1  # f/g pairs of the blocks, plus the embedding or the LM head
    t = Tally()
    for _ in range(3):
        t.add("all_reduce", "forward", per_token)
    if not sequence_parallel:
        for phase in ("forward", "backward"):
            for _ in range(pairs):
                t.add("all_reduce", phase, act)
        return t
    for phase in ("forward", "backward"):
        for op in ("all_gather", "reduce_scatter"):
            for _ in range(pairs):
                t.add(op, phase, act)
    t.add("all_reduce", "backward", (2 * num_layers + 1) * hidden * 4)  # every norm weight's, in one
    return t


def ledger_tally(ledger: Ledger) -> Tally:
    t = Tally()
    for row in ledger.rows:
        for _ in range(row.count):
            t.add(row.op, row.phase, row.bytes)
    return t


@contextlib.contextmanager
def counting(counters: list, phase: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for counter in counters:
            stack.enter_context(counter.phase(phase))
        yield


def count_step(
    model: torch.nn.Module,
    forward: Callable[[], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
) -> tuple[Tally, Tally, float]:
    """Two training steps (forward, backward, AdamW); the collectives of the second, and its loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(counters: list) -> torch.Tensor:
        optimizer.zero_grad()
        with counting(counters, "forward"):
            loss = forward()
        with counting(counters, "backward"):
            backward(loss)
        with counting(counters, "optimizer"):
            optimizer.step()
        return loss.detach()

    step([])  # warm-up, uncounted
    wrapped, dispatch = CollectiveCounter(), DispatchCounter()
    loss = step([dispatch, wrapped])
    return wrapped.tally, dispatch.tally, float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def worker(rank: int, world_size: int) -> dict[str, tuple]:
    """Every measurement of one rank: {case: (wrapped Tally, dispatch Tally, loss[, ledger Tally])}."""
    out: dict[str, tuple] = {}
    mesh = None
    reference = llama_source(batch=BATCH, seq=SEQ)
    args = reference.args

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    single = copy.deepcopy(reference.model)
    out["unpartitioned"] = count_step(single, lambda: single(*args), backward)

    meshplan_cases = (
        ("meshplan TP", PLAN_TP),
        ("meshplan TP+SP", PLAN_TP_SP),
        ("meshplan blocks", PLAN_TP_BLOCKS),
    )
    for case, plan_path in meshplan_cases:
        source = llama_source(batch=BATCH, seq=SEQ)
        compiled = compile_plan(load_plan(plan_path, world_size=world_size), source, world_size=world_size)
        mesh = mesh or init_mesh(compiled.layout)
        program = build_rank_program(compiled, source.model, rank, mesh)
        inputs = bind_inputs(source.model, compiled.graph, source.args, source.kwargs)
        sync = partial_grad_sync(compiled, program, mesh)  # what `meshplan run` adds: the norms' sums

        def synced(loss: torch.Tensor, sync=sync) -> None:
            loss.backward()
            sync.finish()

        measured = count_step(program, lambda program=program, inputs=inputs: program(*inputs)[0], synced)
        out[case] = (*measured, ledger_tally(compiled.ledger))

    for case, sp in (("pytorch TP", False), ("pytorch TP+SP", True)):
        model = parallelize_with_pytorch(copy.deepcopy(reference.model), mesh, sequence_parallel=sp)

        # loss_parallel: cross-entropy reduces over the vocab-sharded DTensor logits
        # instead of gathering them; backward needs the same context.
        def forward_lp(model=model) -> torch.Tensor:
            with loss_parallel():
                return model(*args)

        def backward_lp(loss: torch.Tensor) -> None:
            with loss_parallel():
                loss.backward()

        out[case] = count_step(model, forward_lp, backward_lp)

    blocks = parallelize_with_pytorch(copy.deepcopy(reference.model), mesh, blocks_only=True)
    out["pytorch blocks"] = count_step(blocks, lambda: blocks(*args), backward)

    megatron = MegatronLlama(copy.deepcopy(reference.model), mesh.get_group("tp"))
    out["megatron TP"] = count_step(megatron, lambda: megatron(*args), backward)
    return out


def print_table(title: str, columns: dict[str, Tally], dispatch: dict[str, Tally]) -> None:
    names = list(columns)
    print(f"\n{title}")
    header = f"{'op':<15}{'phase':<10}" + "".join(f"{n:>14}" for n in names)
    print(header)
    print("-" * len(header))
    seen = {key for t in [*columns.values(), *dispatch.values()] for key in t.calls}
    rows = sorted(
        seen, key=lambda k: (OPS.index(k[0]) if k[0] in OPS else len(OPS), k[0], PHASES.index(k[1]))
    )
    for op, phase in rows:
        cells = []
        for n in names:
            cell = str(columns[n].calls[op, phase])
            g = dispatch.get(n)
            if g is not None and g.calls[op, phase] != columns[n].calls[op, phase]:
                cell += f" [{g.calls[op, phase]}]"
            cells.append(f"{cell:>14}")
        print(f"{op:<15}{phase:<10}" + "".join(cells))
    print(f"{'total calls':<25}" + "".join(f"{columns[n].count():>14}" for n in names))
    # the c10d column counts calls only
    total_bytes = [f"{columns[n].total_bytes():,}" if columns[n].total_bytes() else "-" for n in names]
    print(f"{'total bytes':<25}" + "".join(f"{b:>14}" for b in total_bytes))


def main() -> int:
    results = spawn(worker, WORLD)
    config = llama_source(batch=BATCH, seq=SEQ).model.config
    L, H, N = config.num_hidden_layers, config.hidden_size, BATCH * SEQ
    print(
        f"Llama {L} layers, B={BATCH} S={SEQ} H={H} V={config.vocab_size}, tp={WORLD}, fp32, "
        f"one step (fwd, bwd, AdamW) after one warm-up step; B*S*H*4 = {N * H * 4} bytes"
    )
    r0 = results[0]
    ref_loss = r0["unpartitioned"][2]
    for rank, r in enumerate(results):
        for case in r:
            if case == "unpartitioned":
                continue
            for other in results:  # every rank must have issued the same collectives
                assert other[case][0] == r[case][0], f"ranks disagree on {case}"
            rel = abs(r[case][2] - ref_loss) / abs(ref_loss)
            if rank == 0:
                print(
                    f"  loss {case:<15} {r[case][2]:.7f}  (unpartitioned {ref_loss:.7f}, rel diff {rel:.1e})"
                )

    ratios = {}
    mismatches = []
    for layout, sp in (("TP", False), ("TP+SP", True)):
        mine_wrapped, mine_dispatch, _, ledger = r0[f"meshplan {layout}"]
        torch_wrapped, torch_dispatch, _ = r0[f"pytorch {layout}"]
        columns = {
            "minimum": minimum(L, N, H, sequence_parallel=sp),
            "ledger": ledger,
            "wrapped": mine_wrapped,
            "c10d": mine_dispatch,
            "pytorch": torch_wrapped,
        }
        dispatch = {"pytorch": torch_dispatch}
        if not sp:
            columns["megatron"] = r0["megatron TP"][0]
            dispatch["megatron"] = r0["megatron TP"][1]
        plan = PLAN_TP if not sp else PLAN_TP_SP
        print_table(f"{layout}: {plan.split('/main/')[-1]}", columns, dispatch)
        if ledger.calls != mine_wrapped.calls or ledger.bytes != mine_wrapped.bytes:
            mismatches.append(f"{layout}: ledger != wrapped")
        if mine_dispatch.calls != mine_wrapped.calls:
            mismatches.append(f"{layout}: wrapped != c10d")
        ratios[layout] = (
            ledger.total_bytes() / columns["minimum"].total_bytes(),
            mine_wrapped.total_bytes() / columns["minimum"].total_bytes(),
            torch_wrapped.total_bytes() / columns["minimum"].total_bytes(),
            torch_wrapped.count() / columns["minimum"].count(),
        )

    # The blocks alone (embedding, norms and LM head replicated): the "28 vs 16".
    mine_blocks, torch_blocks = r0["meshplan blocks"][0], r0["pytorch blocks"][0]
    print(
        f"\ntransformer blocks only ({PLAN_TP_BLOCKS.split('/main/')[-1]}): all-reduces fwd/bwd per step: "
        f"minimum {2 * L}/{2 * L}, meshplan {mine_blocks.count('all_reduce', 'forward')}/"
        f"{mine_blocks.count('all_reduce', 'backward')} (ledger {r0['meshplan blocks'][3].count()} in all), "
        f"pytorch {torch_blocks.count('all_reduce', 'forward')}/{torch_blocks.count('all_reduce', 'backward')}; "
        f"other collectives: meshplan {mine_blocks.count() - mine_blocks.count('all_reduce')}, "
        f"pytorch {torch_blocks.count() - torch_blocks.count('all_reduce')}"
    )
    if r0["meshplan blocks"][3].calls != mine_blocks.calls:
        mismatches.append("blocks: ledger != wrapped")

    print()
    print(
        "ledger vs reality:", "; ".join(mismatches) if mismatches else "match (calls and bytes, every layout)"
    )
    for layout, (ledger_r, observed_r, torch_r, torch_calls) in ratios.items():
        print(
            f"{layout:<6} bytes compiled/minimum: ledger {ledger_r:.3f}, observed {observed_r:.3f};"
            f"  pytorch/minimum: bytes {torch_r:.3f}, calls {torch_calls:.3f}"
        )
    tp, sp = ratios["TP"], ratios["TP+SP"]
    print(f"ratio bytes compiled/minimum: TP {tp[1]:.3f}, TP+SP {sp[1]:.3f}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
