"""Per-rank peak host memory of `meshplan run` over start-up and the first steps, divided by the
rank's own training state, for a model built on the CPU (every rank builds it whole) and on the
meta device (each rank initializes only its pieces, `compiler/materialize.py`).

    python bench/start_memory.py [--layers 24] [--hidden 1024] [--intermediate 3456] [--vocab 32000]
    python bench/start_memory.py --quick      # a small config, tp=2 only (`python -m bench --quick`)

Model: a Hugging Face `LlamaForCausalLM` from a config (random weights, no download; default
hidden 1024, 24 layers, 16 heads, 4 kv heads, intermediate 3456, vocabulary 32000: 0.38B
parameters), fp32, AdamW. Layouts: `mesh tp=2` and `mesh tp=4` (Megatron column/row pairs, the
embedding and LM head over the vocabulary) and `mesh dp=2` with `zero = 3`. Factories, in this
file, passed to the real command:

    meshplan run PLAN --model bench/start_memory.py:FACTORY --steps 3 --batch 1 --seq 128 --out DIR

    cpu_llama   `LlamaForCausalLM(config)`: built on the host (how models were passed until now)
    meta_llama  the same under `with torch.device("meta")`

Measured per rank: `peak`, the `peak_memory` of its last step record in DIR/metrics/rank{R}.jsonl
(the process's max RSS, `getrusage` maxrss: start-up and every step so far; the first step's
record is shown too, and `start`, the record's `start_memory`: the same measure before the first
step, start-up alone); `state`, its own training state, 16 bytes per parameter element it holds
(fp32 parameter, gradient and AdamW's two moments; under ZeRO divided over dp), each rank's
element count read from the compiled program (DIR/program.pt: its placements applied to the
parameters' shapes). Two ratios, the worst rank of each run:

    raw        peak / state
    less base  (peak - base) / state, `base` the max RSS of a process that imports torch and
               meshplan and nothing else, measured the same way (getrusage maxrss)

The project's goal is `peak / state` <= 1.15 (start-up on the CPU factory measured 1.86 at
tp=2). Also shown: the launcher process's own peak (VmHWM, sampled from /proc while it runs: it
builds the model to compile the plan), and the peak of all the run's processes together
(their VmRSS summed, sampled every 0.1 s: the host's footprint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG_ENV = "MESHPLAN_BENCH_START_MEMORY"  # the config's sizes, JSON, for the factories in the ranks
DEFAULT = {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 3456, "vocab_size": 32000}
HEADS, KV_HEADS = 16, 4
FACTORIES = ("cpu_llama", "meta_llama")
TP = """
modules {
    model.layers.*.self_attn.{q,k,v}_proj: column over tp
    model.layers.*.self_attn.o_proj:       row over tp
    model.layers.*.mlp.{gate,up}_proj:     column over tp
    model.layers.*.mlp.down_proj:          row over tp
    model.embed_tokens:                    vocab over tp
    lm_head:                               vocab over tp
}
"""
LAYOUTS = {
    "tp=2": "mesh tp=2\n" + TP,
    "tp=4": "mesh tp=4\n" + TP,
    "dp=2 zero3": "mesh dp=2\n\ndata_parallel over dp {\n    zero = 3\n}\n",
}
STATE_BYTES = 16  # per parameter element: fp32 param + grad + AdamW m and v
STEPS, BATCH, SEQ = 3, 1, 128
GOAL = 1.15
# --quick: hidden 512, 4 layers, intermediate 1536, vocabulary 8192 (20M params), tp=2 only;
# its state is small next to torch's import, so only the full run's ratios mean much
QUICK, QUICK_LAYOUT = (4, 512, 1536, 8192), "tp=2"


# ---------------------------------------------------------------------------- the factories
# (this file is loaded by `meshplan run --model`: nothing above imports more than torch)


def _config():
    from transformers import LlamaConfig

    sizes = json.loads(os.environ.get(CONFIG_ENV, "null")) or DEFAULT
    return LlamaConfig(
        **sizes,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=max(SEQ, 256),
    )


def cpu_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config())


def meta_llama():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(_config())


# ---------------------------------------------------------------------------- measuring


def import_baseline() -> int:
    """Max RSS (getrusage, bytes) of a fresh process that imports torch and meshplan only."""
    code = (
        "import resource, torch, meshplan\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        found += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return found


def _kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_once(factory: str, plan_text: str, folder: Path, sizes: dict, timeout_s: int) -> dict:
    """One `meshplan run` in a subprocess: its ranks' step records, the launcher's peak and the
    peak of all its processes together."""
    plan = folder / "bench.plan"
    plan.write_text(plan_text)
    exe = Path(sys.executable).with_name("meshplan")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "meshplan"]
    command += ["run", str(plan), "--model", f"{__file__}:{factory}", "--steps", str(STEPS)]
    command += ["--batch", str(BATCH), "--seq", str(SEQ), "--out", str(folder / "run")]
    env = dict(os.environ, **{CONFIG_ENV: json.dumps(sizes)})
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    launcher, together = 0, 0
    while proc.poll() is None:
        launcher = max(launcher, _kib(proc.pid, "VmHWM"))
        together = max(together, sum(_kib(p, "VmRSS") for p in [proc.pid, *_descendants(proc.pid)]))
        if time.monotonic() - start > timeout_s:
            proc.kill()
        time.sleep(0.1)
    out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    if proc.returncode:
        raise RuntimeError(f"meshplan run ({factory}) exited {proc.returncode}:\n{out[-3000:]}")
    records = {}
    for path in sorted((folder / "run" / "metrics").glob("rank*.jsonl")):
        records[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines()]
    return {
        "records": records,
        "launcher": launcher,
        "together": together,
        "seconds": time.monotonic() - start,
        "program": folder / "run" / "program.pt",
    }


def own_elements(program: Path) -> dict[int, int]:
    """Each rank's parameter elements: the compiled program's placements applied to the
    parameters' shapes (padding included), divided over dp under ZeRO."""
    from meshplan.compiler.executable import load_executable
    from meshplan.compiler.lower import local_shard
    from meshplan.dsl.check import check_text

    executable = load_executable(program)
    layout = executable.layout
    plan = check_text(executable.plan_text, executable.plan_name, world_size=layout.world_size)
    dp = plan.data_parallel
    zero_over = layout.size(dp.axis) if dp is not None and dp.zero else 1
    params = dict(executable.graph.named_parameters())
    elements = {}
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        n = sum(
            local_shard(p, executable.param_placements.get(name, {}), coords, layout).numel()
            for name, p in params.items()
        )
        elements[rank] = -(-n // zero_over)
    return elements


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=DEFAULT["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=DEFAULT["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=DEFAULT["intermediate_size"])
    parser.add_argument("--vocab", type=int, default=DEFAULT["vocab_size"])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument(
        "--quick", action="store_true", help=f"a small config, {QUICK_LAYOUT} only: a smoke test"
    )
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.vocab = QUICK
        args.layouts = [QUICK_LAYOUT]
    sys.path.insert(0, str(HERE))
    from common import result

    sizes = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.intermediate,
        "vocab_size": args.vocab,
    }
    os.environ[CONFIG_ENV] = json.dumps(sizes)
    with torch.device("meta"):
        total = sum(p.numel() for p in meta_llama().parameters())
    base = import_baseline()
    mib = 2**20
    print(
        f"HF Llama fp32, {total / 1e9:.3f}B params (hidden {args.hidden}, {args.layers} layers, "
        f"{HEADS}/{KV_HEADS} heads, intermediate {args.intermediate}, vocab {args.vocab}), AdamW; "
        f"meshplan run --steps {STEPS} --batch {BATCH} --seq {SEQ}, gloo on CPU"
    )
    print(f"base: max RSS of a process importing torch and meshplan only = {base / mib:.0f} MiB\n")
    print(
        f"{'layout':<11} {'factory':<10} {'rank':>4} {'state MiB':>10} {'start MiB':>10} {'step 1 MiB':>11} "
        f"{'peak MiB':>9} {'raw':>6} {'less base':>10} {'start/state':>12}"
    )
    worst: dict[tuple[str, str], tuple[float, float, float]] = {}
    extra: dict[tuple[str, str], dict] = {}
    for layout in args.layouts:
        for factory in FACTORIES:
            with tempfile.TemporaryDirectory(prefix="meshplan-start-") as tmp:
                run = run_once(factory, LAYOUTS[layout], Path(tmp), sizes, args.timeout)
                elements = own_elements(run["program"])
            raw = less = start_ratio = 0.0
            for rank, records in sorted(run["records"].items()):
                state = STATE_BYTES * elements[rank]
                first, peak = records[0]["peak_memory"], max(r["peak_memory"] for r in records)
                start = records[0]["start_memory"]
                raw, less = max(raw, peak / state), max(less, (peak - base) / state)
                start_ratio = max(start_ratio, start / state)
                print(
                    f"{layout:<11} {factory:<10} {rank:>4} {state / mib:>10.0f} {start / mib:>10.0f} "
                    f"{first / mib:>11.0f} {peak / mib:>9.0f} {peak / state:>6.2f} "
                    f"{(peak - base) / state:>10.2f} {start / state:>12.2f}"
                )
            worst[layout, factory] = (raw, less, start_ratio)
            extra[layout, factory] = run
    print(
        "\nlauncher: the `meshplan run` process's own peak (VmHWM); together: all the run's processes' "
        "RSS summed (peak)"
    )
    for (layout, factory), run in extra.items():
        print(
            f"{layout:<11} {factory:<10} launcher {run['launcher'] / mib:>7.0f} MiB   "
            f"together {run['together'] / mib:>7.0f} MiB   wall {run['seconds']:>5.0f} s"
        )
    print(
        f"\npeak / own state, worst rank (goal <= {GOAL}); raw = peak / state, less base = (peak - base) / state"
    )
    for (layout, factory), (raw, less, start_ratio) in worst.items():
        print(
            f"{layout:<11} {factory:<10} raw {raw:.2f}   less base {less:.2f}   start-up alone {start_ratio:.2f}"
        )
    for layout in args.layouts:
        cpu, meta = worst[layout, "cpu_llama"][0], worst[layout, "meta_llama"][0]
        print(f"{layout}: peak / state meta / cpu (raw, worst ranks) = {meta / cpu:.2f}")
    result(
        "peak host memory / own training state, worst rank (raw)",
        "ratio",
        {f"{layout} {factory[:4]}": round(r[0], 2) for (layout, factory), r in worst.items()},
    )
    result(
        "(peak - torch import) / own training state, worst rank",
        "ratio",
        {f"{layout} {factory[:4]}": round(r[1], 2) for (layout, factory), r in worst.items()},
    )
    result(
        "start-up's peak host memory (before the first step) / own training state, worst rank",
        "ratio",
        {f"{layout} {factory[:4]}": round(r[2], 2) for (layout, factory), r in worst.items()},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
