"""Weight gradients partial over an axis: one all-reduce per weight in backward vs one bucket in
the gradient sync (`compiler/passes/tensor_parallel/grad_sums.py`).

    python bench/grad_sums.py [--steps 15] [--warmup 3] [--seq 512]

A weight kept whole while each rank computes with its shard of the activations gets only its
shard's share of the gradient. Two layouts where that happens, each compiled twice in this
script, the second time with the f's (identity forward, all-reduce backward) left on the
weights as meshplan compiled them before (`defer_weight_sums` switched off):

    context   `mesh cp=2`, ring attention: every weight (39 of them), the example Llama at
              hidden 256, 4 layers, B=1, T=--seq
    sequence  `mesh tp=2`, examples/llama_tp.plan: the 9 norms between sequence-parallel
              regions, the same model, B=4, T=128

A step is forward, backward, the gradient sync and AdamW, as `meshplan run` runs it; both
programs of a layout take turns within each round (a barrier before each step), and a
step's time is the slower rank's. Reported: collectives per step from each program's ledger
(the per-weight all-reduces against the buckets), the median step time of each, and the
ratio bucketed / per weight (goal: below 1); the losses must agree (the same arithmetic).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from unittest import mock

from common import PLAN_TP_SP, compiled_step, median, result, sized_llama, take_turns

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.passes import tensor_parallel
from meshplan.dsl import load_plan
from meshplan.dsl.check import check_text
from meshplan.examples.models.llama import example_inputs
from meshplan.runtime.launch import spawn

WORLD = 2
CONTEXT = "mesh cp=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n}\n"


def _layouts(seq: int) -> dict[str, tuple[str, int, int]]:
    """name -> (plan text, batch, seq)."""
    sequence = load_plan(PLAN_TP_SP, world_size=WORLD).source
    return {"context": (CONTEXT, 1, seq), "sequence": (sequence, 4, 128)}


def _step(text: str, batch: int, seq: int, rank: int, *, bucketed: bool) -> tuple[Callable[[], float], int]:
    """One training step of the compiled program (and its collectives per step)."""
    model = sized_llama(4, 256, max_position_embeddings=seq)
    ids, labels = example_inputs(batch, seq, seed=1)
    source = ModelSource("llama", model, (ids, labels), {})
    plan = check_text(text, "bench.plan", world_size=WORLD)
    off = mock.patch.object(tensor_parallel, "defer_weight_sums", lambda gm, axis: [])
    with contextlib.nullcontext() if bucketed else off:
        compiled = compile_plan(plan, source, world_size=WORLD, dynamic=False)
    assert bool(compiled.grad_sums) == bucketed
    return compiled_step(compiled, model, rank, (ids, labels)), sum(r.count for r in compiled.ledger.rows)


def worker(rank: int, world: int, warmup: int, steps: int, seq: int) -> dict:
    out: dict = {}
    for layout, (text, batch, length) in _layouts(seq).items():
        variants = {
            how: _step(text, batch, length, rank, bucketed=how == "bucketed")
            for how in ("per weight", "bucketed")
        }
        times = take_turns({how: step for how, (step, _) in variants.items()}, warmup, steps)
        out[layout] = {how: (times[how], variants[how][1]) for how in variants}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, default=512)
    opts = parser.parse_args()
    results = spawn(worker, WORLD, (opts.warmup, opts.steps, opts.seq), timeout_s=900)
    print(
        f"Llama 4 layers, H=256, fp32, 2 gloo ranks; fwd+bwd+sync+AdamW, {opts.steps} steps after {opts.warmup}"
    )
    print(f"\n{'layout':<10}{'gradients':<12}{'collectives':>12}{'median ms':>11}{'min ms':>9}   last loss")
    ratios = {}
    for layout in results[0]:
        medians = {}
        for how, (times, count) in results[0][layout].items():
            per_step = [max(r[layout][how][0][i][0] for r in results) for i in range(opts.steps)]
            medians[how] = median(per_step)
            print(
                f"{layout:<10}{how:<12}{count:>12}{medians[how] * 1e3:>11.1f}{min(per_step) * 1e3:>9.1f}"
                f"   {times[-1][1]:.6f}"
            )
        losses = [results[0][layout][how][0][-1][1] for how in medians]
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0]), f"{layout}: the losses differ: {losses}"
        ratios[layout] = medians["bucketed"] / medians["per weight"]
    print(
        "\nstep time, bucketed / per weight (medians): "
        + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
    )
    result(
        "step time, bucketed / per-weight gradient sums", "ratio", {k: round(v, 3) for k, v in ratios.items()}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
