"""Experts under sequence parallelism: each rank routes its own token shard vs every rank
gathering the tokens and running the experts whole; and without sequence parallelism (the
tokens whole on every tp rank): each rank routing its split of them vs all of them.

    python bench/moe_token_shards.py [--steps 15] [--warmup 3] [--seq 256]

The example MoE model (2 layers, hidden 256, 8 experts of intermediate 512, top-2; B=2,
T=--seq) under `mesh tp=2`: attention column/row over tp, the norms sequence-parallel, the
experts over an axis of one rank (no expert parallelism: each rank runs the model's experts
module). Compiled twice in this script: as meshplan compiles it (the experts unit takes the
rank's sequence shard of the tokens, its weights' gradients summed over tp by the gradient
sync) and with that rule switched off (the unit's tokens all-gathered over tp and every rank
running all of them, as before). A step is forward, backward, the gradient sync and AdamW;
both take turns each round (a barrier before each step), a step's time is the slower
rank's. Reported: the median step of each, their ratio (goal: below 1; the experts' FLOPs
per rank halve) and the losses (equal: the same arithmetic). The same twice more for the plan
without its `sequence` rule: the unit splitting the whole tokens over tp and gathering its
output back, and with that switched off (every rank routing, sending and computing all).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from unittest import mock

from common import compiled_step, result, same_work_medians, take_turns

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.passes.tensor_parallel import experts as experts_rule
from meshplan.dsl.check import check_text
from meshplan.examples.models import moe
from meshplan.runtime.launch import spawn

WORLD = 2
PLAN = """mesh tp=2, ep=1

modules {
    layers.*.self_attn.{q,k,v}_proj: column over tp
    layers.*.self_attn.o_proj:       row over tp
    layers.*.*_layernorm:            sequence over tp
    layers.*.mlp.experts:            experts over ep (top_k=2)
}
"""


def _step(seq: int, rank: int, *, shards: bool, sequence: bool = True) -> Callable[[], float]:
    model = moe.build(
        hidden_size=256, intermediate_size=512, num_local_experts=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=seq,
    )  # fmt: skip
    ids, labels = moe.example_inputs(batch=2, seq=seq)
    source = ModelSource("moe", model, (ids, labels), {})
    text = PLAN if sequence else PLAN.replace("    layers.*.*_layernorm:            sequence over tp\n", "")
    # switched off: the unit's inputs gathered over tp, as for an op with no rule (without a
    # sequence rule: whole tokens not split)
    off = (
        mock.patch.object(experts_rule, "_whole_over_the_axis", lambda w, node, *_: w.default(node))
        if sequence
        else mock.patch.object(experts_rule, "_rows_divide", lambda *_: False)
    )
    with contextlib.nullcontext() if shards else off:
        compiled = compile_plan(check_text(text, "bench.plan", world_size=WORLD), source, world_size=WORLD)
    return compiled_step(compiled, model, rank, (ids, labels))


def worker(rank: int, world: int, warmup: int, steps: int, seq: int) -> dict[str, list[tuple[float, float]]]:
    variants = {
        "token shards": _step(seq, rank, shards=True),
        "gathered": _step(seq, rank, shards=False),
        "no SP, split": _step(seq, rank, shards=True, sequence=False),
        "no SP, repeated": _step(seq, rank, shards=False, sequence=False),
    }
    return take_turns(variants, warmup, steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    opts = parser.parse_args()
    results = spawn(worker, WORLD, (opts.warmup, opts.steps, opts.seq), timeout_s=900)
    print(
        f"MoE 2 layers, H=256, 8 experts (I=512), top-2, B=2 T={opts.seq}, fp32, tp=2 with SP, 2 gloo ranks"
    )
    print(f"fwd+bwd+sync+AdamW, {opts.steps} steps after {opts.warmup}\n")
    medians = same_work_medians(results, opts.steps)
    ratio = medians["token shards"] / medians["gathered"]
    print(f"\nstep time, token shards / gathered (medians): {ratio:.3f}")
    whole = medians["no SP, split"] / medians["no SP, repeated"]
    print(f"step time without SP, split / repeated (medians): {whole:.3f}")
    result(
        "MoE under sequence parallelism, step time", "ms", {k: round(v * 1e3, 1) for k, v in medians.items()}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
