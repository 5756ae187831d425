"""`meshplan estimate`'s step time against `meshplan run`'s, cell by cell, on this machine.

    meshplan estimate --calibrate              # once: this machine's entry
    python bench/step_time_accuracy.py [--cells dp,tp,...] [--batch 4] [--seq 64] [--steps 20] [--rounds 3]

Measured: `meshplan run PLAN --steps N` (torchrun, gloo on this machine's CPUs); a step's time
is the slowest rank's `time_s` (every rank waits for the others at the step's end), the median
over the steps after the first two, leaving out the steps the CPU peak tracker slows (those
with `peak_tensor_bytes`). A shared machine has slow minutes: each cell runs `--rounds` times,
the cells in reverse order every other round, and its time is the median of its rounds (of
three, one slow run is outvoted; the table shows their spread). Estimated: `compiler.estimate.estimate` priced with `--hardware cpu`
(what `--calibrate` measured) on the program compiled for the same shapes.

Goals (issue: estimate): median |error| <= 15% over the cells, and the cells ordered by
predicted time as they are by measured time wherever two measured times differ by more than
20%. The table prints each cell's error and the pairs out of order.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

from common import run_step_time

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "examples/models/llama.py:build"
MOE = "examples/models/moe.py:build"


def _plan(name: str) -> str:
    return (ROOT / name).read_text()


ZERO = "mesh dp=2\n\ndata_parallel over dp {{\n    zero = {z}\n}}\n"
PP = "mesh pp=2\n\npipeline over pp {{\n    schedule = {s}\n    microbatches = 4\n}}\n"
ONE = "mesh dp=1\n"
INTERLEAVED = "mesh pp=2\n\npipeline over pp {\n    schedule = interleaved\n    virtual_stages = 2\n    microbatches = 4\n}\n"
# four ranks on the machine's cores, as `suggest_quality.py` runs its layouts
DP4 = "mesh dp=4\n\ndata_parallel over dp {\n    zero = 1\n}\n"
PP4 = "mesh pp=4\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 8\n}\n"
DP_PP = (
    "mesh dp=2, pp=2\n\npipeline over pp {\n    schedule = interleaved\n    virtual_stages = 2\n"
    "    microbatches = 4\n}\n\ndata_parallel over dp {\n    zero = 0\n}\n"
)

# name -> (plan text, model, what it exercises)
CELLS: dict[str, tuple[str, str, str]] = {
    "one": (ONE, LLAMA, "one process"),
    "dp": (_plan("examples/tiny_dp.plan"), LLAMA, "DP, buckets"),
    "zero1": (ZERO.format(z=1), LLAMA, "ZeRO-1"),
    "zero3": (ZERO.format(z=3), LLAMA, "ZeRO-3"),
    "tp": (_plan("bench/plans/llama_tp_nosp.plan"), LLAMA, "TP, vocab-parallel"),
    "tp_sp": (_plan("examples/llama_tp.plan"), LLAMA, "TP + SP"),
    "pp_1f1b": (PP.format(s="1f1b"), LLAMA, "1F1B, 4 microbatches"),
    "pp_gpipe": (PP.format(s="gpipe"), LLAMA, "GPipe, 4 microbatches"),
    "pp_tp": (_plan("examples/llama_pipeline.plan"), LLAMA, "pp x tp, 4 ranks"),
    "interleaved": (INTERLEAVED, LLAMA, "interleaved 1F1B, 2 stages a rank"),
    "ep": (_plan("examples/moe_ep.plan").replace("dp=*", "dp=1"), MOE, "experts over ep"),
    "cp": (
        "mesh cp=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n}\n",
        LLAMA,
        "ring attention",
    ),
    "ulysses": (
        "mesh cp=2\n\nmodules {\n    layers.*.self_attn: context ulysses over cp\n}\n",
        LLAMA,
        "Ulysses attention",
    ),
    "ulysses_tp": (
        _plan("examples/ulysses_tp.plan").replace("dp=*", "dp=1"),
        LLAMA,
        "Ulysses x TP + SP, 4 ranks",
    ),
    "dp4_zero1": (DP4, LLAMA, "ZeRO-1 over 4 ranks"),
    "pp4": (PP4, LLAMA, "1F1B over 4 ranks, 8 microbatches"),
    "dp_pp": (DP_PP, LLAMA, "dp=2 x interleaved pp=2"),
}


def measured(plan: Path, model: str, args: argparse.Namespace, out: Path) -> float:
    """The median step time of `meshplan run` (the slowest rank's, per step)."""
    return run_step_time(plan, model, steps=args.steps, batch=args.batch, seq=args.seq, out=out)[0]


def estimated(plan: Path, model: str, args: argparse.Namespace) -> float:
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.hardware import hardware
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.dsl import load_plan

    checked = load_plan(plan)
    source = load_model(model, shapes_only=True)
    source = on_meta_inputs(with_token_shape(source, batch=args.batch, seq=args.seq))
    est = estimate(
        compile_plan(checked, source, world_size=checked.mesh.world_size, dynamic=False),
        hw=hardware(args.hardware),
    )
    assert est.step_time is not None
    return est.step_time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each cell, in turn (default 3)")
    args = ap.parse_args()
    names = args.cells.split(",")
    print(
        f"batch {args.batch}, seq {args.seq}, {args.steps} steps, {args.rounds} rounds; hardware {args.hardware}"
    )
    runs: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        plans = {}
        for name in names:
            plans[name] = Path(tmp) / f"{name}.plan"
            plans[name].write_text(CELLS[name][0])
        for r in range(args.rounds):
            for name in names[::-1] if r % 2 else names:
                runs[name].append(measured(plans[name], CELLS[name][1], args, Path(tmp) / f"{name}-{r}"))
            print(f"round {r + 1}: " + ", ".join(f"{n} {runs[n][-1] * 1e3:.1f}" for n in names), flush=True)
        print(f"{'cell':10} {'measured':>10} {'spread':>7} {'estimated':>10} {'error':>7}  what")
        rows: list[tuple[str, float, float]] = []
        for name in names:
            real = statistics.median(runs[name])
            guess = estimated(plans[name], CELLS[name][1], args)
            rows.append((name, real, guess))
            spread = max(runs[name]) / min(runs[name]) - 1
            what = CELLS[name][2]
            print(
                f"{name:10} {real * 1e3:>8.1f}ms {spread:>7.0%} {guess * 1e3:>8.1f}ms {guess / real - 1:>+7.1%}  {what}"
            )
    errors = [abs(g / r - 1) for _, r, g in rows]
    print(f"median |error| {statistics.median(errors):.1%} (goal <= 15%), worst {max(errors):.1%}")
    wrong = [
        (a, b)
        for (a, ra, ga), (b, rb, gb) in itertools.combinations(rows, 2)
        if max(ra, rb) / min(ra, rb) > 1.2 and (ra < rb) != (ga < gb)
    ]
    pairs = sum(
        1 for (_, ra, _), (_, rb, _) in itertools.combinations(rows, 2) if max(ra, rb) / min(ra, rb) > 1.2
    )
    print(f"order: {pairs - len(wrong)} of {pairs} pairs more than 20% apart ordered as measured")
    for a, b in wrong:
        print(f"  out of order: {a} vs {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
