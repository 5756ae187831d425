"""Experts kept as a list of modules vs stacked in 3-D parameters: what the list costs.

    python bench/expert_lists.py [--steps 10] [--warmup 3] [--seq 128]

The example MoE model (2 layers, hidden 256, 8 experts of intermediate 512, top-2; B=4,
T=--seq per rank, fp32) under `mesh ep=2` (`layers.*.mlp.experts: experts over ep`), on 2
gloo ranks, compiled twice in this script: as `moe.build` holds its experts (Hugging Face's
layout: `gate_up_proj` (E, 2I, H), the experts module called once per layer) and as
`moe.build_listed` holds the same weights (an `nn.ModuleList` of SwiGLU modules the block
loops over, which meshplan stacks and whose E calls it joins into one experts unit). Same
weights, same routing, the same all-to-alls. A step is forward, backward, the gradient
averaging over ep and AdamW; both take turns each round (a barrier before each step), a
step's time is the slower rank's. Reported: each median step, their ratio list / stacked
(goal: about 1: the join adds a concatenation, a split and a sort of rows already grouped
by expert) and the losses (equal: the same function).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from common import compiled_step, result, same_work_medians, take_turns

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.dsl.check import check_text
from meshplan.examples.models import moe
from meshplan.runtime.launch import spawn

WORLD = 2
BATCH = 4
PLAN = "mesh ep=2\n\nmodules {\n    layers.*.mlp.experts: experts over ep (top_k=2)\n}\n"


def _step(build: Callable[..., moe.MoEModel], seq: int, rank: int) -> Callable[[], float]:
    model = build(
        hidden_size=256, intermediate_size=512, num_local_experts=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=seq,
    )  # fmt: skip
    ids, labels = moe.example_inputs(batch=BATCH, seq=seq, seed=rank)
    source = ModelSource("moe", model, (ids, labels), {})
    compiled = compile_plan(
        check_text(PLAN, "bench.plan", world_size=WORLD), source, world_size=WORLD, dynamic=False
    )
    return compiled_step(compiled, model, rank, (ids, labels), data=("ep",))


def worker(rank: int, world: int, warmup: int, steps: int, seq: int) -> dict[str, list[tuple[float, float]]]:
    variants = {"stacked": _step(moe.build, seq, rank), "list": _step(moe.build_listed, seq, rank)}
    return take_turns(variants, warmup, steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    opts = parser.parse_args()
    results = spawn(worker, WORLD, (opts.warmup, opts.steps, opts.seq), timeout_s=900)
    print(f"MoE 2 layers, H=256, 8 experts (I=512), top-2, B={BATCH} T={opts.seq} per rank, fp32, ep=2, gloo")
    print(f"fwd+bwd+sync+AdamW, {opts.steps} steps after {opts.warmup}\n")
    medians = same_work_medians(results, opts.steps)
    print(f"\nstep time, list / stacked (medians): {medians['list'] / medians['stacked']:.3f}")
    result(
        "Experts as a list vs stacked, step time", "ms", {k: round(v * 1e3, 1) for k, v in medians.items()}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
