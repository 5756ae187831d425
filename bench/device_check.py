"""The device check: meshplan on one GPU, in one command of at most 8 minutes.

    python -m bench.device_check --out runs/device_check     # on a machine with a CUDA device
    python -m bench.device_check --dry-run                   # what it would run (works on CPU)

On the GPU machine, torch's CUDA build comes from that machine's own registry (or image); the
check installs nothing at run time beyond meshplan itself (`pip install --no-deps -e .` there,
or a wheel built with `pip wheel --no-deps .`; lark is meshplan's one dependency a CUDA image
may lack). It runs, in order, each part in its own process with its own time budget, so a part
that fails or hangs is reported and the next one still runs:

1. `gpu-tier`: `pytest -m gpu tests/gpu`, meshplan's tests on the device.
2. `llama-1b-step`: a 1B-class Llama (the Hugging Face config of Llama 3.2 1B, random
   weights), sequences of 2048 tokens, bf16 compute over fp32 master weights, fused AdamW,
   gradient clipping, one optimizer step per batch. The baseline is the loop a user writes in
   plain PyTorch (`torch.autocast` to bf16, the same optimizer and clipping), run first in its
   own process to find the largest batch that fits (halving from an estimate); then
   `meshplan run` trains the same model at that batch under a `dp=1` plan. Both report the
   median step time after warm-up steps, and MFU = 6 x parameters x tokens/s / the card's
   dense bf16 peak (attention's own FLOPs left out, as `meshplan run`'s metrics do).
   Target: meshplan / plain <= 1.02.
3. `llama-8b-tp8-memory`: Llama-3-8B's config built on the meta device, compiled for `tp=8`
   (bf16 compute, every layer checkpointed), and one rank of it run alone on the device under
   the fake process group (collectives that keep shapes only): two steps at seq 2048, its
   peak device memory (`torch.cuda.max_memory_allocated`; `peak_tensor_bytes` beside it) and its
   training state (`state_bytes`), against `meshplan estimate`'s prediction for that same rank
   (its peak and state, from the same plan compiled at the same shape: `estimate_gib`, and the
   ratio `estimate_over_measured`; the estimate leaves out the allocator's caching and
   fragmentation, kernel workspaces and the CUDA context, as it says).
4. `cpu-offload-step`: the 1B Llama with its embedding and LM head (one tied weight, 263M
   parameters) placed `on cpu`: their weights, gradients and AdamW state in host memory, their
   matmuls on the host, the activations copied at their boundaries (`meshplan explain` lists the
   copies); its step time and peak device memory beside the same run with everything on the
   device, at a shape that fits the part's budget (the head's matmul runs on the CPU).

It writes `device_check.json` (every part: status, seconds, numbers, the tail of its output)
and `device_check.md` (the same as tables) into `--out`, after each part, so a check cut short
still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQ = 2048
TARGET = 1.02  # meshplan's step time over the plain loop's, at most

DP1_BF16 = """# the device check's 1B Llama: one GPU, bf16 compute over fp32 master weights
mesh dp=1

precision {
    compute = bf16
    params = fp32
}
"""


def llama_1b():
    """Llama 3.2 1B's shape (Hugging Face config), random weights: 1.24B parameters with the
    embedding tied to the head. `attn_implementation="sdpa"`: PyTorch's fused attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=SEQ,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------- the parts


@dataclass
class Part:
    name: str
    measures: str
    budget_s: int
    run: Callable[[Path, int], dict] | None  # (out folder, budget) -> numbers; None: skipped
    skipped_because: str = ""


@dataclass
class Outcome:
    name: str
    status: str  # "ok", "failed", "timed out", "skipped"
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)
    note: str = ""
    output_tail: str = ""


class PartFailed(Exception):
    def __init__(self, message: str, tail: str = "", numbers: dict | None = None) -> None:
        super().__init__(message)
        self.tail = tail
        self.numbers = numbers or {}


def _run(command: list[str], budget_s: float, env: dict[str, str] | None = None) -> str:
    """Run `command` from the repository's root within `budget_s`; its output. Raises
    PartFailed (with the output's tail) when it fails or runs out of time."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            capture_output=True,
            text=True,
            timeout=budget_s,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise PartFailed(f"ran past its {budget_s:.0f} s", out[-6000:]) from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise PartFailed(
            f"{' '.join(command[:6])} ... exited {done.returncode} after {time.monotonic() - started:.0f} s",
            output[-6000:],
        )
    return output


def gpu_tier(out: Path, budget_s: int) -> dict:
    log = _run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-n", "8", "--dist", "load",
         "-p", "no:cacheprovider", "-o", "addopts=", "--junitxml", str(out / "gpu_tier.xml")],
        budget_s,
    )  # fmt: skip
    summary = [line for line in log.splitlines() if " passed" in line or " failed" in line]
    return {"summary": summary[-1] if summary else log[-300:]}


def llama_1b_step(out: Path, budget_s: int) -> dict:
    import torch

    deadline = time.monotonic() + budget_s
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    # about 25 GiB of weights, gradients and AdamW state and 6 GiB of activations per sequence
    # (an H200 measured 71.5 GiB at 8): the largest power of two that should fit, halved
    # while it does not
    batch = 1 << (max(int((total_gib - 25) / 6), 1).bit_length() - 1)
    plain = None
    while batch >= 1:
        try:
            plain = json.loads(
                _run(
                    [sys.executable, "-m", "bench.device_check", "--plain-loop", str(batch)],
                    deadline - time.monotonic(),
                )
                .strip()
                .splitlines()[-1]
            )
            break
        except PartFailed as e:
            if "OutOfMemoryError" not in e.tail and "out of memory" not in e.tail:
                raise
            batch //= 2
    if plain is None:
        raise PartFailed("the plain loop did not fit one sequence of 2048 tokens")
    numbers: dict = {"batch": batch, "seq": SEQ, "plain": plain}
    with tempfile.TemporaryDirectory() as folder:
        plan = Path(folder) / "dp1_bf16.plan"
        plan.write_text(DP1_BF16)
        run_dir = Path(folder) / "run"
        steps = WARMUP + MEASURED
        try:
            _run(
                [sys.executable, "-m", "meshplan", "run", str(plan), "--model", f"{__file__}:llama_1b",
                 "--batch", str(batch), "--seq", str(SEQ), "--steps", str(steps), "--warmup", "2",
                 "--lr", "3e-4", "--out", str(run_dir), "--log-every", "1"],
                deadline - time.monotonic(),
            )  # fmt: skip
        except PartFailed as e:
            e.numbers = numbers
            raise
        records = [
            json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()
        ]
    measured = [r["time_s"] for r in records[WARMUP:]]
    step_s = statistics.median(measured)
    params = plain["parameters"]
    tokens_per_s = batch * SEQ / step_s
    peak = plain["peak_flops"]
    numbers["meshplan"] = {
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": 6 * params * tokens_per_s / peak if peak else None,
        "mfu_reported": records[-1].get("mfu"),
        "peak_memory_gib": max(r["peak_memory"] for r in records) / 2**30,
        "losses": [round(r["loss"], 4) for r in records],
    }
    numbers["ratio"] = step_s / plain["step_s"]
    numbers["target"] = f"<= {TARGET}"
    numbers["meets_target"] = numbers["ratio"] <= TARGET
    return numbers


WARMUP, MEASURED = 3, 10


TP8 = """# the device check's 8B Llama: one rank of tp=8, bf16 compute, every layer recomputed
mesh tp=8

modules {
    model.layers.*.self_attn.{q,k,v}_proj: column over tp
    model.layers.*.self_attn.o_proj:       row over tp
    model.layers.*.mlp.{gate,up}_proj:     column over tp
    model.layers.*.mlp.down_proj:          row over tp
    model.embed_tokens:                    vocab over tp
    lm_head:                               vocab over tp
    model.layers.*.{input,post_attention}_layernorm: sequence over tp
    model.norm:                                      sequence over tp
    model.layers.*: checkpoint
}

precision {
    compute = bf16
    params = fp32
}
"""


def llama_8b():
    """Llama 3 8B's shape (Hugging Face config), on the meta device: each rank initializes only
    its own pieces."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def llama_tiny():
    """`llama_8b`'s shape at a size a CPU test runs (8 query and 8 key/value heads: tp=8 splits them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=128,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def llama_8b_tp8(out: Path, budget_s: int) -> dict:
    output = _run([sys.executable, "-m", "bench.device_check", "--one-rank-8b"], budget_s)
    return compared(json.loads(output.strip().splitlines()[-1]))


def one_rank_8b(device: str = "cuda", seq: int = SEQ, model: str = "llama_8b") -> dict:
    """Rank 3 of the tp=8 plan, alone on `device` under the fake process group, for two steps;
    its metrics. (`tests/test_device_check.py` runs it on the CPU with a small model.)"""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplan.launcher import prepare
    from meshplan.options import parse
    from meshplan.session import open_session, train_session

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    with tempfile.TemporaryDirectory() as folder:
        plan = Path(folder) / "tp8.plan"
        plan.write_text(TP8)
        argv = [
            str(plan),
            "--model",
            f"{__file__}:{model}",
            "--batch",
            "1",
            "--seq",
            str(seq),
            "--steps",
            "2",
        ]
        options, _ = prepare(parse([*argv, "--out", str(Path(folder) / "run"), "--log-every", "1"]))
        started = time.monotonic()
        session = open_session(options, 3, 8)
        opened_s = time.monotonic() - started
        train_session(session, show_progress=False)
        records = [
            json.loads(line) for line in (Path(folder) / "run/metrics/rank3.jsonl").read_text().splitlines()
        ]
    dist.destroy_process_group()
    gib = 2**30
    return {
        "open_session_s": round(opened_s, 1),
        "parameters_on_rank": sum(p.numel() for p in session.program.parameters()),
        "state_gib": records[-1]["state_bytes"] / gib,
        "peak_tensor_gib": max(r["peak_tensor_bytes"] or 0 for r in records) / gib,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib if device == "cuda" else None,
    } | estimated(model, seq)


def estimated(model: str, seq: int, rank: int = 3) -> dict:
    """`meshplan estimate`'s prediction for the rank `one_rank_8b` runs (the same plan, model and
    shape, compiled as `meshplan estimate PLAN --model SPEC --batch 1 --seq T` compiles it). Runs
    without a process group (the estimate makes its own)."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.dsl.check import check_text

    source = with_token_shape(load_model(f"{__file__}:{model}", shapes_only=True), batch=1, seq=seq)
    compiled = compile_plan(check_text(TP8, "tp8.plan", world_size=8), on_meta_inputs(source), dynamic=False)
    predicted = estimate(compiled).ranks[rank]
    gib = 2**30
    return {
        "estimate_gib": predicted.peak / gib,
        "estimate_state_gib": predicted.state / gib,
        "estimate_peak_at": predicted.peak_op,
    }


def compared(numbers: dict) -> dict:
    """The measured peak (the allocator's on a GPU, the tensors' on a CPU) beside the estimate's,
    and their ratio."""
    measured = numbers["peak_allocated_gib"] or numbers["peak_tensor_gib"]
    return numbers | {"measured_gib": measured, "estimate_over_measured": numbers["estimate_gib"] / measured}


OFFLOAD = """# the device check's offload run: the 1B Llama's embedding and LM head (one tied weight)
# in host memory, the layers on the device
mesh dp=1

modules {
    model.embed_tokens: on cpu
    lm_head:            on cpu
}

precision {
    compute = bf16
    params = fp32
}
"""
# the head's matmuls (2 x 2048 x 128256 FLOPs a token forward, twice that backward) run on the CPU:
# 1024 tokens a step keep the part in its budget
OFFLOAD_BATCH, OFFLOAD_SEQ, OFFLOAD_WARMUP, OFFLOAD_MEASURED = 2, 512, 2, 3


def cpu_offload_step(out: Path, budget_s: int) -> dict:
    """The `on cpu` run's step time and peak device memory, then (in the time left) the same run
    with everything on the device, each a `meshplan run` of its own."""
    deadline = time.monotonic() + budget_s
    numbers: dict = {"model": "llama_1b", "batch": OFFLOAD_BATCH, "seq": OFFLOAD_SEQ}
    with tempfile.TemporaryDirectory() as folder:
        for name, text in (("on_cpu", OFFLOAD), ("on_device", DP1_BF16)):
            plan = Path(folder) / f"{name}.plan"
            plan.write_text(text)
            run_dir = Path(folder) / name
            try:
                _run(
                    [sys.executable, "-m", "meshplan", "run", str(plan), "--model", f"{__file__}:llama_1b",
                     "--batch", str(OFFLOAD_BATCH), "--seq", str(OFFLOAD_SEQ),
                     "--steps", str(OFFLOAD_WARMUP + OFFLOAD_MEASURED), "--warmup", "1", "--lr", "3e-4",
                     "--out", str(run_dir), "--log-every", "1"],
                    deadline - time.monotonic(),
                )  # fmt: skip
            except PartFailed as e:
                e.numbers = numbers
                raise
            lines = (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
            step_s = statistics.median(r["time_s"] for r in records[OFFLOAD_WARMUP:])
            numbers[name] = {
                "step_s": step_s,
                "tokens_per_s": OFFLOAD_BATCH * OFFLOAD_SEQ / step_s,
                "peak_memory_gib": max(r["peak_memory"] for r in records) / 2**30,
                "losses": [round(r["loss"], 4) for r in records],
            }
    numbers["slowdown"] = numbers["on_cpu"]["step_s"] / numbers["on_device"]["step_s"]
    numbers["device_memory_saved_gib"] = (
        numbers["on_device"]["peak_memory_gib"] - numbers["on_cpu"]["peak_memory_gib"]
    )
    return numbers


def plain_loop(batch: int) -> dict:
    """The baseline, in this process: the training loop a user writes for the same model."""
    import torch

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = llama_1b()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    tokens = torch.randint(0, 256, (batch, SEQ + 1), device="cuda")  # byte-level, as meshplan's corpus
    input_ids, labels = tokens[:, :-1], tokens[:, 1:]
    times = []
    for _ in range(WARMUP + MEASURED):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the loss is read every step, as `meshplan run` reads it for its metrics
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    from meshplan.runtime.train import PEAK_FLOPS

    name = torch.cuda.get_device_name()
    peak = next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
    step_s = statistics.median(times[WARMUP:])
    tokens_per_s = batch * SEQ / step_s
    return {
        "parameters": params,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": 6 * params * tokens_per_s / peak if peak else None,
        "peak_flops": peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


PARTS = (
    Part("gpu-tier", "pytest -m gpu tests/gpu: meshplan's tests on the device", 150, gpu_tier),
    Part(
        "llama-1b-step",
        f"1B Llama, seq {SEQ}, bf16, dp=1: meshplan's step time and MFU against a plain PyTorch loop "
        f"(target ratio <= {TARGET})",
        150,
        llama_1b_step,
    ),
    Part(
        "llama-8b-tp8-memory",
        "Llama-3-8B (built on meta) at tp=8, one rank alone under the fake process group, bf16, checkpointing, "
        "seq 2048: peak device memory and training state beside `meshplan estimate`'s for that rank",
        100,
        llama_8b_tp8,
    ),
    Part(
        "cpu-offload-step",
        f"1B Llama, embedding and LM head `on cpu`, batch {OFFLOAD_BATCH} x seq {OFFLOAD_SEQ}, bf16: step time "
        "and peak device memory, beside the same run all on the device",
        80,
        cpu_offload_step,
    ),
)


# ---------------------------------------------------------------------------- the report


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {
            "device": torch.cuda.get_device_name(),
            "memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }
    return env


def write_report(out: Path, env: dict, outcomes: list[Outcome]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"environment": env, "parts": [o.__dict__ for o in outcomes]}
    (out / "device_check.json").write_text(json.dumps(data, indent=2))
    lines = ["# meshplan device check", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    lines += ["", "| part | status | seconds | result |", "|---|---|---:|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} | {_headline(o)} |")
    for o in outcomes:
        if o.numbers or o.output_tail:
            lines += ["", f"## {o.name}", "", "```", json.dumps(o.numbers, indent=2)]
            if o.output_tail:
                lines += ["", o.output_tail[-3000:]]
            lines.append("```")
    (out / "device_check.md").write_text("\n".join(lines) + "\n")


def _headline(o: Outcome) -> str:
    n = o.numbers
    if o.name == "llama-1b-step" and "ratio" in n:
        return (
            f"batch {n['batch']}: meshplan {n['meshplan']['step_s'] * 1e3:.0f} ms/step, MFU "
            f"{_pct(n['meshplan']['mfu'])}; plain {n['plain']['step_s'] * 1e3:.0f} ms/step, MFU "
            f"{_pct(n['plain']['mfu'])}; ratio {n['ratio']:.3f} (target {n['target']})"
        )
    if o.name == "llama-8b-tp8-memory" and "estimate_over_measured" in n:
        return (
            f"rank 3: measured {n['measured_gib']:.2f} GiB peak, estimate {n['estimate_gib']:.2f} GiB "
            f"(x{n['estimate_over_measured']:.3f}); state {n['state_gib']:.2f} GiB"
        )
    if o.name == "cpu-offload-step" and "slowdown" in n:
        placed, plain = n["on_cpu"], n["on_device"]
        return (
            f"on cpu {placed['step_s'] * 1e3:.0f} ms/step, peak {placed['peak_memory_gib']:.1f} GiB; all on the "
            f"device {plain['step_s'] * 1e3:.0f} ms/step, peak {plain['peak_memory_gib']:.1f} GiB "
            f"(x{n['slowdown']:.2f} the time, {n['device_memory_saved_gib']:.1f} GiB less)"
        )
    return n.get("summary", o.note)


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/device_check", help="folder for device_check.json and .md")
    p.add_argument("--dry-run", action="store_true", help="print the parts and their budgets; run nothing")
    p.add_argument("--only", nargs="*", help="run only these parts")
    p.add_argument(
        "--plain-loop", type=int, metavar="BATCH", help=argparse.SUPPRESS
    )  # the baseline's process
    p.add_argument("--one-rank-8b", action="store_true", help=argparse.SUPPRESS)  # the 8B rank's process
    args = p.parse_args(argv)
    if args.plain_loop:
        print(json.dumps(plain_loop(args.plain_loop)))
        return 0
    if args.one_rank_8b:
        print(json.dumps(one_rank_8b()))
        return 0
    parts = [part for part in PARTS if not args.only or part.name in args.only]
    if args.dry_run:
        total = sum(part.budget_s for part in parts if part.run is not None)
        print(
            f"meshplan device check: {len(parts)} parts, at most {total} s ({total / 60:.1f} min) on the device"
        )
        for part in parts:
            budget = f"{part.budget_s:4d} s" if part.run is not None else "skip  "
            print(f"  {part.name:22s} {budget}  {part.measures}")
            if part.run is None:
                print(f"  {'':22s}         skipped: {part.skipped_because}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("the device check needs a CUDA device (--dry-run lists what it runs)", file=sys.stderr)
        return 2
    out = Path(args.out)
    env, outcomes = environment(), []
    for part in parts:
        started = time.monotonic()
        if part.run is None:
            outcomes.append(Outcome(part.name, "skipped", note=part.skipped_because))
        else:
            print(f"== {part.name} (budget {part.budget_s} s)", flush=True)
            try:
                numbers = part.run(out, part.budget_s)
                outcomes.append(Outcome(part.name, "ok", time.monotonic() - started, numbers))
            except PartFailed as e:
                status = "timed out" if "ran past" in str(e) else "failed"
                outcomes.append(
                    Outcome(part.name, status, time.monotonic() - started, e.numbers, str(e), e.tail)
                )
            except Exception as e:  # a bug of the check itself: reported, the next part still runs
                outcomes.append(Outcome(part.name, "failed", time.monotonic() - started, note=repr(e)))
            print(
                f"   {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s: {_headline(outcomes[-1])}",
                flush=True,
            )
        write_report(out, env, outcomes)
    print((out / "device_check.md").read_text())
    return 0 if all(o.status in ("ok", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
