"""`meshplan estimate` against `meshplan run`: each rank's training state and peak tensor bytes,
estimated from the compiled program before anything runs, over what one step of the real run
measured on the same plan, model and shapes.

    python bench/estimate_accuracy.py [--cells dp,zero1,...] [--batch 2] [--seq 16] [--big]

Measured: `meshplan run PLAN --steps 2 --log-every 1` (torchrun, gloo on this machine's CPUs), each rank's
metrics records: `state_bytes` (the engine's `memory()` after the step) and `peak_tensor_bytes`
(on a CPU, a tracker of the storages the step's ops create, on top of the state held before
it). Estimated: `compiler.estimate.estimate` on the program compiled for the same shapes.
The ratios are estimate / measured, per rank; goals: state within 0.5%, peak within 10%.

`--big`: the 70B-class Llama factory of the compile-time benchmark on a large mesh, estimated
(not run): wall time and this process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "examples/models/llama.py:build"
GPT = "examples/models/gpt.py:build"
MOE = "examples/models/moe.py:build"

ZERO = "mesh dp=2\n\ndata_parallel over dp {{\n    zero = {z}\n}}\n"
PP = "mesh pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 4\n}\n"
GPT_ZERO3 = (ROOT / "examples/gpt_zero3.plan").read_text().replace("mesh dp=*", "mesh dp=2")

# name -> (plan text, model, what it exercises)
CELLS: dict[str, tuple[str, str, str]] = {
    "dp": ((ROOT / "examples/tiny_dp.plan").read_text(), LLAMA, "DP, buckets"),
    "zero1": (ZERO.format(z=1), LLAMA, "ZeRO-1"),
    "zero2": (ZERO.format(z=2), LLAMA, "ZeRO-2"),
    "zero3": (ZERO.format(z=3), LLAMA, "ZeRO-3"),
    "tp": ((ROOT / "bench/plans/llama_tp_nosp.plan").read_text(), LLAMA, "TP, vocab-parallel"),
    "tp_sp": ((ROOT / "examples/llama_tp.plan").read_text(), LLAMA, "TP + SP"),
    "pp": (PP, LLAMA, "1F1B, 4 microbatches"),
    "gpt_zero3": (GPT_ZERO3, GPT, "ZeRO-3 fp16, offload, selective checkpointing"),
    "pp_bf16": (
        PP + "\nprecision {\n    compute = bf16\n}\n",
        LLAMA,
        "1F1B under bf16: a weight's cast kept once a step",
    ),
    "interleaved": (PP.replace("1f1b", "interleaved\n    virtual_stages = 2"), LLAMA, "interleaved 1F1B"),
    "zero_bubble": (PP.replace("1f1b", "zero_bubble"), LLAMA, "zero-bubble (split backward)"),
    "pp_gpipe": (PP.replace("1f1b", "gpipe"), LLAMA, "GPipe"),
    "zbv": (PP.replace("1f1b", "zbv\n    virtual_stages = 2"), LLAMA, "zero-bubble V (two stages a rank)"),
    "pp_zero1": (
        PP.replace("mesh pp=2", "mesh dp=2, pp=2") + "\ndata_parallel over dp {\n    zero = 1\n}\n",
        LLAMA,
        "1F1B x ZeRO-1 (4 ranks)",
    ),
    "interleaved_zero1": (
        PP.replace("mesh pp=2", "mesh dp=2, pp=2").replace("1f1b", "interleaved\n    virtual_stages = 2")
        + "\ndata_parallel over dp {\n    zero = 1\n}\n",
        LLAMA,
        "interleaved x ZeRO-1 (4 ranks, two stages a rank)",
    ),
    "pp_zero3": (
        PP.replace("mesh pp=2", "mesh dp=2, pp=2") + "\ndata_parallel over dp {\n    zero = 3\n}\n",
        LLAMA,
        "1F1B x ZeRO-3 (4 ranks)",
    ),
    "hsdp3": (
        "mesh node=2, dp=2\n\ndata_parallel over node x dp {\n    zero = 3 over dp\n}\n",
        LLAMA,
        "HSDP: ZeRO-3 over dp, copies over node (4 ranks)",
    ),
    "zero2_bf16": (
        "mesh dp=2\n\ndata_parallel over dp {\n    zero = 2\n    compress = bf16\n}\n",
        LLAMA,
        "ZeRO-2 with bf16 compression: the flat's residual",
    ),
    "hsdp2_bf16": (
        "mesh node=2, dp=2\n\ndata_parallel over node x dp {\n    zero = 2 over dp\n    compress = bf16\n}\n",
        LLAMA,
        "HSDP ZeRO-2 with bf16 compression: two residuals, the flat's and the shard's (4 ranks)",
    ),
    "hsdp2_experts": (
        "mesh node=2, dp=2\n\nmodules {\n    layers.*.mlp.experts: experts over dp (top_k=2)\n}\n\n"
        "data_parallel over node x dp {\n    zero = 2 over dp\n}\n",
        MOE,
        "HSDP under experts: dense state over dp, the experts' whole, copies over node (4 ranks)",
    ),
    "ep": ((ROOT / "examples/moe_ep.plan").read_text().replace("dp=*", "dp=1"), MOE, "experts over ep"),
    "cp": (
        "mesh cp=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n}\n",
        LLAMA,
        "ring attention",
    ),
    "cp_tp_sp": (
        (ROOT / "examples/llama_tp.plan")
        .read_text()
        .replace("mesh tp=2", "mesh cp=2, tp=2")
        .replace("modules {", "modules {\n    layers.*.self_attn: context ring over cp\n"),
        LLAMA,
        "ring attention x TP + SP (each cp rank's slice cut again at the norms)",
    ),
    "ulysses_tp": (
        (ROOT / "examples/gpt_tp.plan")
        .read_text()
        .replace("mesh tp=2", "mesh cp=2, tp=2")
        .replace("modules {", "modules {\n    h.*.attn: context ulysses over cp\n"),
        GPT,
        "Ulysses x TP (each tp rank's heads cut again over cp)",
    ),
}


def measured(plan: Path, model: str, batch: int, seq: int, out: Path) -> list[dict]:
    """Each rank's record of the second step of `meshplan run` (the first that starts with the
    optimizer's moments and the engine's buffers already made, as every later one does), its
    `peak_tensor_bytes` the larger of both steps'."""
    argv = [sys.executable, "-m", "meshplan", "run", str(plan), "--model", model, "--steps", "2"]
    argv += ["--log-every", "1", "--batch", str(batch), "--seq", str(seq), "--out", str(out)]
    subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT)
    files = sorted((out / "metrics").glob("rank*.jsonl"), key=lambda f: int(f.stem.removeprefix("rank")))
    out_records = []
    for f in files:
        steps = [json.loads(line) for line in f.read_text().splitlines()]
        out_records.append(steps[-1] | {"peak_tensor_bytes": max(r["peak_tensor_bytes"] for r in steps)})
    return out_records


def estimated(plan: Path, model: str, batch: int, seq: int):
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.hardware import hardware
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.dsl import load_plan

    checked = load_plan(plan)
    source = on_meta_inputs(with_token_shape(load_model(model, shapes_only=True), batch=batch, seq=seq))
    # the runs are on this machine's CPUs: priced (and laid out) as `--hardware cpu`
    return estimate(
        compile_plan(checked, source, world_size=checked.mesh.world_size, dynamic=False), hw=hardware("cpu")
    )


BIG_PLAN = """mesh dp=*, pp=8, tp=8

modules {
    layers.*.self_attn.{q,k,v}_proj: column over tp
    layers.*.self_attn.o_proj:       row over tp
    layers.*.mlp.{gate,up}_proj:     column over tp
    layers.*.mlp.down_proj:          row over tp
    embed_tokens:                    vocab over tp
    lm_head:                         vocab over tp
    layers.*: checkpoint
}

pipeline over pp {
    schedule = interleaved
    virtual_stages = 2
    microbatches = 16
}

data_parallel over dp {
    zero = 1
}

precision {
    compute = bf16
    params = fp32
}
"""


def llama70b():
    """A Llama-3-70B-shaped example Llama (80 layers, H=8192, I=28672, 64/8 heads, 128256 tokens)."""
    from meshplan.examples.models.llama import build

    return build(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )


def big(world: str) -> None:
    """The 70B-class factory on a large mesh: estimate time and peak RSS."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.dsl import load_plan

    t0 = time.perf_counter()
    plan_file = Path(tempfile.mkdtemp()) / "llama70b_3d.plan"
    plan_file.write_text(BIG_PLAN)
    plan = load_plan(plan_file, world_size=int(world))
    model = load_model(f"{Path(__file__).resolve()}:llama70b", shapes_only=True)
    source = on_meta_inputs(with_token_shape(model, batch=1, seq=4096))
    compiled = compile_plan(plan, source, world_size=int(world), dynamic=False)
    t1 = time.perf_counter()
    from meshplan.compiler.hardware import hardware

    est = estimate(compiled, hw=hardware("h100"))
    t2 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"70B-class, {world} ranks: compile {t1 - t0:.1f} s, estimate {t2 - t1:.1f} s, peak RSS {rss:.2f} GiB"
    )
    for ranks, r in est.classes():
        print(
            f"  {len(ranks)} ranks like rank {ranks[0]}: params {r.params / 2**30:.2f} GiB, grads {r.grads / 2**30:.2f}, "
            f"optimizer {r.optimizer / 2**30:.2f}, activations {r.activations / 2**30:.2f}, "
            f"buffers {r.buffers / 2**30:.2f}, peak {r.peak / 2**30:.2f} GiB at {r.peak_op}"
        )
    from meshplan.compiler.print_estimate import step_line

    print("  " + step_line(est).strip())
    slowest = max((r for r in est.ranks if r.time is not None), key=lambda r: r.time.total)
    if slowest.time is not None:
        t = slowest.time
        print(
            f"  slowest rank {slowest.rank}: compute {t.compute:.2f} s, communication waited {t.communication:.2f} s, "
            f"pipeline idle {t.idle:.2f} s, optimizer {t.optimizer:.3f} s"
        )


LLAMA8B_PLAN = """mesh tp=8

modules {
    layers.*.self_attn.{q,k,v}_proj: column over tp
    layers.*.self_attn.o_proj:       row over tp
    layers.*.mlp.{gate,up}_proj:     column over tp
    layers.*.mlp.down_proj:          row over tp
    embed_tokens:                    vocab over tp
    lm_head:                         vocab over tp
}

precision {
    compute = bf16
    params = fp32
}
"""


def llama8b(layers: int = 32):
    """A Llama-3-8B-shaped example Llama (32 layers, H=4096, I=14336, 32/8 heads, 128256 tokens)."""
    from meshplan.examples.models.llama import build

    return build(
        num_hidden_layers=layers,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )


def llama8b_block():
    """`llama8b` with one block: the estimate at 32 blocks less this one's is 31 blocks'."""
    return llama8b(layers=1)


def _llama8b_rank(factory: str, seq: int, batch: int, t: int):
    """The estimate of rank 0 for an 8B-shaped factory of this file at tp=`t`."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.hardware import hardware
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.dsl import check_text

    plan = check_text(LLAMA8B_PLAN, "llama8b_tp8.plan")
    model = load_model(f"{Path(__file__).resolve()}:{factory}", shapes_only=True)
    source = on_meta_inputs(with_token_shape(model, batch=batch, seq=seq))
    return estimate(compile_plan(plan, source, world_size=t, dynamic=False), hw=hardware("h100")).ranks[0]


def arithmetic_8b(seq: int, batch: int) -> None:
    """Llama-3-8B at tp=8 (Megatron's layout, bf16 compute, fp32 parameters and AdamW), one
    rank, estimated against the published arithmetic: 16 bytes a parameter (4 parameter, 4
    gradient, 8 for two fp32 moments) of the rank's share, and Korthikanti et al.'s per-layer
    activations.

    Their formula, s b h (34 + 5 a s / h) bytes a layer and at tp=t s b h (10 + 24 / t + 5 a s /
    (h t)) without sequence parallelism or recomputation, counts GPT's block: LayerNorm, a 4h
    GeLU MLP, dropout masks, and the attention scores kept whole. Their method (every tensor
    backward reads, its bytes) applied to this block instead, term by term, is what the
    estimate's walk should find a layer keeping: a layer's bytes are the estimate at 32 blocks
    less the estimate at one, over 31."""
    h, inter, layers, heads, kv, vocab, t = 4096, 14336, 32, 32, 8, 128256, 8
    d = h // heads
    per_layer = h * (h + 2 * kv * d) + h * h + 3 * h * inter  # q, k, v; o; gate, up, down
    split = layers * per_layer + 2 * vocab * h  # cut over tp (embedding and head by vocabulary)
    whole = layers * 2 * h + h  # the norms, on every rank
    local = split // t + whole
    t0 = time.perf_counter()
    r = _llama8b_rank("llama8b", seq, batch, t)
    print(
        f"Llama-3-8B, tp=8, batch {batch}, seq {seq} (estimated in {time.perf_counter() - t0:.1f} s), rank 0:"
    )
    print(
        f"  state       {r.state / 2**30:8.3f} GiB; arithmetic 16 B x {local / 1e9:.3f}B local parameters = "
        f"{16 * local / 2**30:.3f} GiB ({r.state / (16 * local):.4f})"
    )
    one = _llama8b_rank("llama8b_block", seq, batch, t)
    walked = (r.activations - one.activations) / (layers - 1)
    sb = seq * batch
    terms = {  # bytes a layer keeps for backward, bf16 (2 bytes) unless said
        "2 RMSNorms in fp32: the fp32 input (pow, mul), 1/rms, the bf16 cast (weight's mul), "
        "the output (the projections')": 2 * (4 * sb * h + 4 * sb + 2 * sb * h + 2 * sb * h),
        "flash attention: q, k and v (k, v repeated to the query heads), its output, its fp32 "
        "logsumexp (no scores, no dropout)": 4 * 2 * sb * h // t + 4 * heads // t * sb,
        "SwiGLU: the gate's output (silu), silu's and up's outputs (their product), the "
        "product (down_proj)": 4 * 2 * sb * inter // t,
        "the bf16 casts of the layer's fp32 weights (each linear's backward reads its cast)": 2
        * per_layer
        // t
        + 2 * 2 * h,
    }
    method = sum(terms.values())
    print(
        f"  activations {r.activations / 2**30:8.3f} GiB in all; a layer {walked / 2**20:.2f} MiB (the walk)"
    )
    for what, nbytes in terms.items():
        print(f"    {nbytes / 2**20:9.2f} MiB  {what}")
    print(f"    {method / 2**20:9.2f} MiB  Korthikanti et al.'s method on this block ({walked / method:.4f})")
    gpt = sb * h * (10 + 24 / t + 5 * heads * seq / (h * t))
    print(
        f"    {gpt / 2**20:9.2f} MiB  their formula for GPT's block ({walked / gpt:.3f}): LayerNorm in bf16, a 4h "
        "GeLU MLP, dropout masks, the scores whole, no weight casts"
    )
    if r.time is not None:
        print(f"  step on h100 {r.time.total * 1e3:.1f} ms, FLOP utilization {r.time.utilization:.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--big", metavar="WORLD", help="also the 70B-class config on this many ranks")
    ap.add_argument("--llama8b", action="store_true", help="also Llama-3-8B at tp=8 against the arithmetic")
    args = ap.parse_args()
    print(
        f"batch {args.batch}, seq {args.seq}; ratio = estimate / measured (goal: state 1 +- 0.005, peak 1 +- 0.1)"
    )
    print(
        f"{'cell':17} {'rank':>4} {'state est':>11} {'measured':>11} {'ratio':>7} {'peak est':>11} {'measured':>11} {'ratio':>7}"
    )
    worst_state = worst_peak = (0.0, "")
    with tempfile.TemporaryDirectory() as tmp:
        for name in filter(None, args.cells.split(",")):
            text, model, _ = CELLS[name]
            plan = Path(tmp) / f"{name}.plan"
            plan.write_text(text)
            records = measured(plan, model, args.batch, args.seq, Path(tmp) / name)
            est = estimated(plan, model, args.batch, args.seq)
            for rec, r in zip(records, est.ranks, strict=True):
                state, peak = r.state / rec["state_bytes"], r.peak / rec["peak_tensor_bytes"]
                worst_state = max(worst_state, (abs(state - 1), f"{name} rank {r.rank}"))
                worst_peak = max(worst_peak, (abs(peak - 1), f"{name} rank {r.rank}"))
                print(
                    f"{name:17} {r.rank:>4} {r.state:>11} {rec['state_bytes']:>11} {state:>7.4f} "
                    f"{r.peak:>11} {rec['peak_tensor_bytes']:>11} {peak:>7.3f}"
                )
    print(
        f"worst state: {worst_state[0]:.2%} off ({worst_state[1]}); worst peak: {worst_peak[0]:.1%} off ({worst_peak[1]})"
    )
    if args.big:
        big(args.big)
    if args.llama8b:
        arithmetic_8b(seq=2048, batch=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
