"""Run every benchmark in `bench/` and write one report, `bench/REPORT.md`.

    python -m bench            # every benchmark at its own sizes (tens of minutes on 2 cores)
    python -m bench --quick    # smaller sizes and fewer steps: a few minutes
    python -m bench --only dp_step_time tp_step_time     # some of them

Each benchmark is its own script (`python bench/NAME.py`), run here as a subprocess with
the arguments below, so one that fails (or misses a target it checks: zero_memory exits 1
above 5%) is reported with its exit status and the others still run.
The report starts with the machine, then a summary (each benchmark's headline lines, picked
from its output by the pattern below, and its wall time), then every benchmark's output as
it printed it: every ratio in it was measured against its baseline in that same run (each
script's docstring says what the baseline is). Where a benchmark prints a `bench-result`
line (`common.result`), its numbers are plotted into `bench/plots/NAME.png` (needs
matplotlib: `pip install matplotlib`; without it the report says so and has no plots).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = "bench-result "  # the prefix of `common.result`'s lines


@dataclass(frozen=True)
class Bench:
    name: str
    measures: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    headline: str = r"ratio|/ "  # lines of its output that make the summary
    in_quick: bool = True


BENCHES = (
    Bench(
        "tp_collectives",
        "TP collectives per step vs the analytical minimum and PyTorch TP",
        headline=r"^total bytes|^transformer blocks",
    ),
    Bench(
        "tp_step_time",
        "TP=2 step time vs PyTorch TP and hand-written Megatron",
        quick=("--steps", "3", "--warmup", "1"),
        headline=r"^medians:|^ratio \(medians\)",
    ),
    Bench(
        "dp_step_time",
        "DP / ZeRO 1-3 step time vs DDP and FSDP2",
        quick=("--layers", "2", "--hidden", "128", "--steps", "3", "--warmup", "1"),
        headline=r" / ",
    ),
    Bench("zero_memory", "per-rank training-state bytes vs analytical, ZeRO 0-3", headline=r"^largest|= "),
    Bench(
        "disk_offload",
        "optimizer state (ZeRO-1) and parameter shards (ZeRO-3) on disk vs in host memory: host "
        "bytes per rank and step time",
        quick=("--layers", "2", "--hidden", "256", "--bucket-mib", "1", "--steps", "3"),
        headline=r"ratio|goal|/ in memory",
    ),
    Bench(
        "optimizer_state",
        "optimizer state bytes per rank for each optimizer, measured vs the formula and vs AdamW",
        quick=("--layers", "2"),
        headline=r"^largest",
    ),
    Bench(
        "compression",
        "compressed gradient all-reduce (bf16, PowerSGD): bytes, step time and loss vs exact",
        quick=("--steps", "30"),
        headline=r"^exact|^powersgd|^bf16",
    ),
    Bench(
        "compile_time",
        "compile time by layer count",
        quick=("--layers", "2", "4", "--repeats", "1"),
        headline=r"^fit",
    ),
    Bench(
        "checkpoint_memory",
        "activation memory with checkpointing",
        quick=("--layers", "2", "--seq", "128"),
        headline=r"^(off|checkpoint)",
    ),
    Bench(
        "mixed_memory",
        "ZeRO-3 under bf16 compute: step memory and gather bytes vs FSDP2 mixed precision",
        quick=("--layers", "2", "--hidden", "128", "--steps", "1"),
        headline=r" / |all-gather bytes",
    ),
    Bench(
        "save_memory",
        "per-rank memory while saving and loading a checkpoint, ZeRO-3 vs FSDP2",
        quick=("--world", "2", "--layers", "2", "--hidden", "256"),
        headline=r"worst rank|meshplan / ",
    ),
    Bench(
        "export_memory",
        "rank 0's memory while --export writes one file: held whole vs streamed",
        quick=("--quick",),
        headline=r"^(held|streamed)",
    ),
    Bench(
        "start_memory",
        "meshplan run's peak host memory per rank (start-up + 3 steps) / its training state, CPU- vs meta-built",
        quick=("--quick",),
        headline=r" raw \d",
    ),
    Bench("pp_idle", "pipeline idle per rank, measured vs simulated", quick=("--quick",), headline=r"goal"),
    Bench("pp_step_time", "pipeline step vs torch.distributed.pipelining", quick=("--quick",)),
    Bench("pp_cuts", "balanced cuts vs equal layer counts", quick=("--quick", "--microbatches", "4")),
    Bench(
        "pp_memory",
        "pipeline memory per rank by schedule",
        quick=("--quick",),
        headline=r"^(1f1b|interleaved|zero_bubble|zbv|\(p - r\) / m)[^\[]*$",
    ),
    Bench(
        "context",
        "context parallel bytes, memory and time per variant",
        quick=("--seq", "512", "--steps", "2"),
        headline=r"^(sent|kept|time) / ",
    ),
    Bench(
        "grad_sums",
        "weight gradients partial over cp / tp: one bucket vs an all-reduce per weight",
        quick=("--steps", "4", "--warmup", "1", "--seq", "256"),
        headline=r"^step time, bucketed",
    ),
    Bench(
        "moe_token_shards",
        "MoE under sequence parallelism: each rank's token shard vs gathered tokens",
        quick=("--steps", "4", "--warmup", "1", "--seq", "128"),
        headline=r"^step time, token shards",
    ),
    Bench(
        "cp_balance",
        "causal ring work per rank, balanced vs contiguous",
        quick=("--seq", "1024", "--reps", "2"),
        headline=r"^2 +(contiguous|balanced)|^(contiguous|balanced) ",
    ),
    Bench(
        "experts",
        "expert parallel step vs hand-written all-to-all MoE",
        quick=("--steps", "2", "--warmup", "1"),
    ),
    Bench(
        "expert_lists",
        "experts kept as a list of modules vs stacked, same weights, under ep",
        quick=("--steps", "3", "--warmup", "1", "--seq", "64"),
        headline=r"^step time, list",
    ),
    Bench(
        "verify_matrix", "composition cells trained against float64", headline=r"pass|fail", in_quick=False
    ),
)


def machine() -> list[str]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f"{pages / 2**30:.0f} GiB"
    except (ValueError, OSError):
        memory = "unknown"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (gloo on CPU)"
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores; memory {memory}; GPU: {gpu}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, {platform.system()} {platform.release()}",
        f"- load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ]


def run(bench: Bench, quick: bool, timeout_s: int) -> tuple[str, float, int]:
    """Its output (stdout, then stderr if it failed), wall seconds, exit status (124: timed out)."""
    args = bench.quick if quick else bench.full
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / f"{bench.name}.py"), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=HERE.parent,
        )
        out, code = done.stdout, done.returncode
        if code:
            out += "\n" + done.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, code = out + f"\n(timed out after {timeout_s} s)", 124
    return out, time.perf_counter() - start, code


def results(output: str) -> list[dict]:
    return [json.loads(line[len(RESULT) :]) for line in output.splitlines() if line.startswith(RESULT)]


def plot(name: str, found: list[dict], folder: Path) -> Path | None:
    """One bar chart per `bench-result` line (its `values`: label -> number, in `unit`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not found:
        return None
    fig, axes = plt.subplots(1, len(found), figsize=(5 * len(found), 3.6), squeeze=False)
    for ax, r in zip(axes[0], found, strict=True):
        labels, values = list(r["values"]), list(r["values"].values())
        ax.bar(labels, values, color="#4c72b0")
        ax.set_title(r["title"], fontsize=10)
        ax.set_ylabel(r["unit"])
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes, fewer steps; verify_matrix left out"
    )
    parser.add_argument("--only", nargs="*", metavar="NAME", help="these benchmarks only")
    parser.add_argument("--timeout", type=int, default=1800, metavar="S", help="per benchmark (default 1800)")
    parser.add_argument("--out", type=Path, default=HERE / "REPORT.md")
    args = parser.parse_args()
    known = {b.name for b in BENCHES}
    if args.only and (unknown := sorted(set(args.only) - known)):
        parser.error(f"no benchmark named {', '.join(unknown)} (there are: {', '.join(sorted(known))})")
    chosen = [b for b in BENCHES if (b.name in args.only if args.only else (b.in_quick or not args.quick))]
    try:
        import matplotlib  # noqa: F401

        plots: str | None = None
    except ImportError:
        plots = "no plots: matplotlib is not installed (`pip install matplotlib`)"

    mode = "quick" if args.quick else "full"
    lines = [
        "# meshplan benchmark report",
        "",
        f"`python -m bench{' --quick' if args.quick else ''}` ({mode} sizes), "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        *machine(),
        "",
    ]
    summary = ["| benchmark | measures | headline (as printed) | wall |", "|---|---|---|---|"]
    sections: list[str] = []
    failed = 0
    for bench in chosen:
        print(f"{bench.name} ...", end=" ", flush=True)
        output, seconds, code = run(bench, args.quick, args.timeout)
        print(f"{seconds:.0f} s" + (f" (exit {code})" if code else ""), flush=True)
        failed += code != 0
        shown = [line.strip() for line in output.splitlines() if not line.startswith(RESULT)]
        picked = [line for line in shown if line and re.search(bench.headline, line)][-6:]
        headline = "<br>".join(f"`{line}`" for line in picked) or "(see below)"
        status = f"{seconds:.0f} s" + (f", **exit {code}**" if code else "")
        summary.append(f"| [{bench.name}](#{bench.name}) | {bench.measures} | {headline} | {status} |")
        cmd = " ".join(["python", f"bench/{bench.name}.py", *(bench.quick if args.quick else bench.full)])
        sections += [f"## {bench.name}", "", f"`{cmd}`, {seconds:.0f} s", "", "```", *shown, "```", ""]
        if (
            plots is None
            and not code
            and (image := plot(bench.name, results(output), args.out.parent / "plots"))
        ):
            sections += [f"![{bench.name}]({image.relative_to(args.out.parent)})", ""]
    lines += ["## Summary", "", *summary, ""]
    if plots:
        lines += [plots, ""]
    args.out.write_text("\n".join(lines + sections))
    print(f"wrote {args.out} ({len(chosen) - failed} of {len(chosen)} benchmarks ran)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
