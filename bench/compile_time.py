"""Compile time vs model depth: wall time of `compile_plan` for the example Llama with 4..32 layers.

    python bench/compile_time.py [--layers 4 8 16 32] [--repeats 5]

`compile_plan` is the whole compiler: capture (torch.export + normalize), rule
resolution, the tensor-parallel pass, the ledger. Measured for the tp=2 plan
`bench/plans/llama_tp_nosp.plan` on the example Llama at its default width (H=64, B=2,
S=16): the graph grows with the layers, the tensors do not matter. The `capture` inside each
compile is timed too, to split the total into export and meshplan's own work (rule
resolution, the tensor-parallel pass, the ledger: "rest"), and so is the graph lint run
after every pass (`compiler/lint.py`), part of "rest". Each time is the best of
`--repeats` runs, taken round robin over the sizes after one warm-up compile (first use
of torch.export imports and caches a lot), each after a `gc.collect()`; the process's CPU
time is printed beside the wall time because the machine may be shared. Model building
is not timed.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass

from common import PLAN_TP, llama_source

from meshplan.compiler import compile as compile_module
from meshplan.compiler.capture import capture
from meshplan.compiler.lint import lint
from meshplan.dsl import load_plan

WORLD = 2


@dataclass(frozen=True, order=True)
class Timing:
    wall: float  # first: `min` of Timings is the fastest wall time
    cpu: float  # this process's CPU time: less sensitive to other load on the machine
    capture: float  # wall seconds inside `capture`
    lint: float  # wall seconds inside the lint after each pass
    nodes: int


def timed_compile(plan, source) -> Timing:
    """One `compile_plan`, with the `capture` inside it timed by wrapping the name
    `compile_plan` calls, so the split is not blurred by run-to-run noise."""
    spent: dict[str, float] = {"capture": 0.0, "lint": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0

        return wrapper

    compile_module.capture = timed("capture", capture)
    compile_module.lint = timed("lint", lint)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        compiled = compile_module.compile_plan(plan, source, world_size=WORLD)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        compile_module.capture, compile_module.lint = capture, lint
    return Timing(wall, cpu, spent["capture"], spent["lint"], len(compiled.graph.graph.nodes))


def fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares line t = a + b * layers: (a, b, largest relative deviation of a point)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    return intercept, slope, max(abs(y - (intercept + slope * x)) / y for x, y in points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()

    plan = load_plan(PLAN_TP, world_size=WORLD)
    sources = {n: llama_source(num_hidden_layers=n) for n in opts.layers}
    timed_compile(plan, llama_source(num_hidden_layers=2))  # warm-up
    load_before = os.getloadavg()[0]
    runs: dict[int, list[Timing]] = {n: [] for n in opts.layers}
    for _ in range(opts.repeats):  # round robin: a change in the machine's load hits every size
        for n in opts.layers:
            gc.collect()  # the previous compile's garbage is not this one's cost
            runs[n].append(timed_compile(plan, sources[n]))
    best = {n: min(times) for n, times in runs.items()}

    print(
        f"compile_plan, {PLAN_TP.split('/main/')[-1]}, example Llama (H=64, B=2, S=16), tp={WORLD}, "
        f"best of {opts.repeats}; '+s/layer': added wall time per added layer since the previous row"
    )
    header = (
        f"{'layers':>6}{'nodes':>7}{'wall s':>9}{'s/layer':>9}{'+s/layer':>10}{'cpu s':>8}{'cpu/layer':>10}"
        f"{'capture s':>11}{'rest s':>8}{'lint s':>8}"
    )
    print(header)
    print("-" * len(header))
    previous = None
    for n, t in best.items():
        added = f"{(t.wall - previous[1].wall) / (n - previous[0]):.4f}" if previous else "-"
        print(
            f"{n:>6}{t.nodes:>7}{t.wall:>9.3f}{t.wall / n:>9.4f}{added:>10}{t.cpu:>8.3f}{t.cpu / n:>10.4f}"
            f"{t.capture:>11.3f}{t.wall - t.capture:>8.3f}{t.lint:>8.3f}"
        )
        previous = (n, t)

    print(f"\n1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    for what in ("wall", "cpu"):
        a, b, worst = fit([(n, getattr(t, what)) for n, t in best.items()])
        print(f"fit ({what}): t = {a:.3f} s + {b:.4f} s/layer; largest deviation from the line {worst:.1%}")
    (n0, t0), (n1, t1) = next(iter(best.items())), list(best.items())[-1]
    print(
        f"ratio t({n1})/t({n0}) = {t1.wall / t0.wall:.2f} wall, {t1.cpu / t0.cpu:.2f} cpu, "
        f"for {n1 / n0:.0f}x the layers"
    )


if __name__ == "__main__":
    sys.exit(main())
