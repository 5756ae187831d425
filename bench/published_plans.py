"""`meshplan suggest` against the plans people publish for Llama 3: torchtitan's and NeMo's
Megatron recipes for 8B on 8 H100s and 70B on 64, each written as a meshplan plan
(`bench/plans/published/`), estimated beside the plan `suggest` writes for the same model,
ranks, memory and batch.

    python bench/published_plans.py [--only 8b,70b] [--budget 240]

Priced on `--hardware h100` (the datasheet entry, 80 GiB each), sequences of 8192 tokens, a step
of 8 sequences on 8 ranks and of 64 on 64 (torchtitan's local batches: 1 for 8B, 8 per data
rank for 70B). Each published plan runs its own micro-batch (Megatron's is 1 sequence, its
steps take fewer sequences than the global batch, which Megatron reaches by accumulation),
so plans are compared by tokens a second per GPU, not step time. Every number is
`meshplan estimate`'s (the compiled program on meta, no weights): what a plan would hold and
take on that hardware by meshplan's pricing, not a measurement on it.

What the recipes do that meshplan's plans cannot say yet is in `docs/how-to/estimate.md`
("Against the published plans"), with each difference between them and the suggestion.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "bench/plans/published"
MODELS = f"{ROOT / 'bench/estimate_accuracy.py'}"
SEQ = 8192
MEMORY = 80 * 2**30


@dataclass(frozen=True)
class Case:
    model: str  # factory in bench/estimate_accuracy.py
    world: int
    batch: int  # sequences a step, over the data ranks (suggest's --batch)
    plans: dict[str, int]  # published plan file -> its micro-batch per rank (estimate's --batch)


CASES = {
    "8b": Case("llama8b", 8, 8, {"llama3_8b_torchtitan.plan": 1, "llama3_8b_megatron.plan": 1}),
    "70b": Case("llama70b", 64, 64, {"llama3_70b_torchtitan.plan": 8, "llama3_70b_megatron.plan": 1}),
}


def row(name: str, est, world: int, tokens: int, seconds: float) -> str:
    peak = max(r.peak for r in est.ranks)
    step = est.step_time
    slowest = max((r for r in est.ranks if r.time is not None), key=lambda r: r.time.total)
    per_gpu = tokens / step / world if step else 0.0
    fits = "fits" if est.fits else "does NOT fit"
    return (
        f"  {name:34s} {peak / 2**30:7.1f} GiB {fits:13s} step {step:7.3f} s  {tokens:7d} tokens  "
        f"{per_gpu:8.0f} tokens/s/GPU  FLOP util {slowest.time.utilization:5.1%}  ({seconds:.0f} s)"
    )


def one_case(name: str, case: Case, budget: float) -> None:
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.errors import CompileError
    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.hardware import hardware
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.compiler.suggest import suggest
    from meshplan.dsl import check_text
    from meshplan.dsl.errors import PlanError

    hw = hardware("h100")
    spec = f"{MODELS}:{case.model}"
    print(f"Llama 3 {name.upper()} on {case.world} x h100 (80 GiB), {case.batch} x {SEQ} tokens a step")
    t0 = time.perf_counter()
    found = suggest(
        load_model(spec, shapes_only=True),
        world=case.world,
        hw=hw,
        limit=MEMORY,
        batch=case.batch,
        seq=SEQ,
        budget=budget,
    )
    best = found.best
    assert best is not None and best.estimate is not None, "a layout fits"
    lay = best.layout
    what = f"suggest: {lay.mesh()}, zero {lay.zero}, checkpoint {lay.checkpoint or 'none'}"
    if lay.pp > 1:
        what += f", pp x{lay.virtual} m{lay.microbatches}"
    print(row(what, best.estimate, case.world, case.batch * SEQ, time.perf_counter() - t0))
    for plan_file, rows in case.plans.items():
        t0 = time.perf_counter()
        text = (PUBLISHED / plan_file).read_text()
        source = on_meta_inputs(with_token_shape(load_model(spec, shapes_only=True), batch=rows, seq=SEQ))
        try:
            plan = check_text(text, plan_file, world_size=case.world)
            compiled = compile_plan(plan, source, world_size=case.world, dynamic=False)
        except (PlanError, CompileError) as e:
            print(f"  {plan_file:34s} refused: {str(e).splitlines()[0]}")
            continue
        est = estimate(compiled, limit=MEMORY, hw=hw)
        data = compiled.layout.size("dp") if "dp" in compiled.layout.names else 1
        micro = compiled.plan.pipeline.microbatches if compiled.plan.pipeline else 1
        print(row(plan_file, est, case.world, rows * (micro or 1) * data * SEQ, time.perf_counter() - t0))
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CASES), help="of " + ",".join(CASES))
    ap.add_argument("--budget", type=float, default=240.0, help="suggest's --budget, seconds")
    args = ap.parse_args()
    for name in args.only.split(","):
        one_case(name, CASES[name], args.budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
