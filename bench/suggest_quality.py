"""`meshplan suggest` against running every layout: is the suggested plan the fastest that fits?

    meshplan estimate --calibrate              # once: this machine's entry (`--hardware cpu`)
    python bench/suggest_quality.py [--models llama,hf_llama] [--world 4] [--batch 8] [--seq 64]
                                    [--memory 24MiB] [--steps 10] [--rounds 2] [--measure 3]
                                    [--confirm 3]

For each model, every layout of a bounded space (`compiler.suggest.layouts` on `--world` ranks,
ZeRO 0, 1 and 3, checkpointing or not, a pipeline's microbatches at twice its stages, no
offload) is written as `suggest` writes it and trained with `meshplan run` (torchrun, gloo on
this machine's CPUs) for `--steps` steps, `--rounds` times (every layout once a round, the
rounds in turn forward and backward, so a drift in the machine's load evens out): its median
step time (the slowest rank's) of its fastest round, and its most live tensor bytes (the CPU
tracker's `peak_tensor_bytes`). Then `meshplan suggest` runs
once for the same model, ranks, batch and memory, priced on `--hardware cpu`.

Goals (issue: suggest): the suggested plan's measured step time is the fastest measured of the
layouts that fit `--memory` or within 5% of it, and none of suggest's top 3 measures over
`--memory`. The table shows each layout's screened, estimated (for those suggest estimated)
and measured numbers, in measured order. `--measure K` also runs `suggest --measure K` (the
estimate's best of K meshes trained a few steps each, the fastest kept) and reports its pick
against the same table; the goal is held to the estimate's pick, `suggest`'s default.

The sweep's fastest is the least of some forty noisy runs, fast partly by luck. So the
contenders (those that fit within 15% of it, up to five, and the picks) then run `--confirm`
rounds more, all alike, and the goal is judged on those rounds alone (`--confirm 0`: on the
sweep).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import ROOT, human_bytes, run_step_time

MODELS = {
    "llama": f"{ROOT / 'examples/models/llama.py'}:build",
    "hf_llama": f"{Path(__file__).resolve()}:hf_llama",
}


def hf_llama():
    """A Hugging Face Llama from a config, random weights (4 layers, H=64, 4/2 heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def space(shape, args):
    from meshplan.compiler.suggest import layouts

    for lay in layouts(shape, args.world, args.batch, args.seq, per_node=args.world):
        if lay.offload or lay.zero == 2:
            continue  # ZeRO-2 is ZeRO-1's time on one machine; offload is ZeRO-3's plus the host
        if lay.pp > 1 and (lay.microbatches != 2 * lay.pp or lay.virtual > 1):
            continue  # one pipeline schedule: 1F1B over twice its stages
        yield lay


def one_model(name: str, spec: str, args: argparse.Namespace, tmp: Path) -> bool:
    from meshplan.compiler.hardware import hardware
    from meshplan.compiler.load import load_model
    from meshplan.compiler.structure import model_shape
    from meshplan.compiler.suggest import Candidate, suggest
    from meshplan.compiler.suggest_plan import write_plan

    hw = hardware(args.hardware)
    source = load_model(spec, shapes_only=True)
    found = suggest(
        source,
        world=args.world,
        hw=hw,
        limit=args.memory,
        batch=args.batch,
        seq=args.seq,
        shapes=max(args.measure - 1, 0),
    )
    assert found.best is not None, f"{name}: suggest found nothing that fits"
    picked = found.best.layout  # the estimate's pick
    measured_pick = None  # `suggest --measure`'s: the fastest of its own short runs
    if args.measure:
        from meshplan.suggest_measure import measure, pick

        trial = pick(measure(found, args.measure, spec, args.memory), args.memory)
        measured_pick = trial.candidate.layout if trial is not None else picked
    shape = found.shape or model_shape(source.model)
    by_layout = {c.layout: c for c in found.ranked}
    layouts = list(space(shape, args))
    for lay in (picked, measured_pick):  # the suggestions are measured whatever the bounded space leaves out
        if lay is not None and lay not in layouts:
            layouts.append(lay)
    plans = []
    for i, lay in enumerate(layouts):
        cand = by_layout.get(lay) or Candidate(lay, 0, 0.0)
        text = write_plan(
            shape,
            cand,
            compute=found.compute,
            world=args.world,
            hw=hw,
            limit=None,
            batch=args.batch,
            seq=args.seq,
        )
        plan = tmp / f"{name}_{i}.plan"
        plan.write_text(text)
        plans.append((i, lay, cand, plan))
    measured = _sweep(plans, range(args.rounds), name, spec, args, tmp)
    rows = [(lay, cand, *measured[i]) for i, lay, cand, _ in plans if i in measured]
    rows.sort(key=lambda r: r[2])
    fitting = [r for r in rows if args.memory is None or r[3] <= args.memory]
    fastest = fitting[0][2]
    best = next(r for r in rows if r[0] == picked)
    top3 = [c.layout for c in found.runners_up(3)]
    print(f"\n{name} ({spec}): {len(rows)} layouts on {args.world} ranks, batch {args.batch} x {args.seq}")
    print(f"  {'layout':34} {'screened':>9} {'estimated':>10} {'measured':>9} {'peak':>10}")
    for lay, cand, step, peak in rows:
        mark = "<- suggested" if lay == picked else ("top 3" if lay in top3 else "")
        if lay == measured_pick:
            mark += f" <- --measure {args.measure}"
        over = " over" if args.memory is not None and peak > args.memory else ""
        estimated = f"{cand.estimated_time * 1e3:8.1f}ms" if cand.estimated_time else f"{'-':>10}"
        print(
            f"  {_what(lay):34} {cand.time * 1e3:7.1f}ms {estimated} {step * 1e3:7.1f}ms "
            f"{human_bytes(peak):>10}{over} {mark}"
        )
    ratio = best[2] / fastest
    if args.confirm:
        ratio, chosen_ratio = _confirm(rows, plans, fastest, picked, measured_pick, name, spec, args, tmp)
    top_over = [
        lay for lay, _, _, peak in rows if lay in top3 and args.memory is not None and peak > args.memory
    ]
    goal = "" if args.confirm else " (goal <= 1.05)"
    print(f"  suggested: {best[2] * 1e3:.1f} ms, {best[2] / fastest:.3f} x the fastest that fits{goal}")
    print(f"  top 3 over --memory when run: {len(top_over)} (goal 0)")
    if measured_pick is not None:
        chosen = next(r for r in rows if r[0] == measured_pick)
        over = args.memory is not None and chosen[3] > args.memory
        print(
            f"  suggested with --measure {args.measure}: {chosen[2] * 1e3:.1f} ms, "
            f"{chosen[2] / fastest:.3f} x the fastest that fits{' (over --memory)' if over else ''}"
        )
    if args.confirm:
        print(
            f"  confirmed ({args.confirm} more rounds of the contenders): suggested {ratio:.3f} x the fastest (goal <= 1.05)"
        )
        if chosen_ratio is not None:
            print(f"  confirmed: --measure {args.measure}'s pick {chosen_ratio:.3f} x the fastest")
    return ratio <= 1.05 and not top_over


def _what(lay) -> str:
    what = f"{lay.mesh()}, zero {lay.zero}{f', ckpt {lay.checkpoint}' if lay.checkpoint else ''}"
    if lay.pp > 1:
        what += f", {'interleaved x' + str(lay.virtual) if lay.virtual > 1 else '1f1b'} {lay.microbatches} mb"
    return what


def _sweep(
    plans, rounds, name: str, spec: str, args: argparse.Namespace, tmp: Path
) -> dict[int, tuple[float, int]]:
    """Each plan's fastest round (median step of the slowest rank) and its most live bytes:
    every plan once a round, the rounds in turn forward and backward, so a drift in the
    machine's load evens out."""
    measured: dict[int, tuple[float, int]] = {}
    failed: set[int] = set()
    for r in rounds:
        for i, lay, _, plan in plans if r % 2 == 0 else reversed(plans):
            if i in failed:
                continue
            try:
                step, peak = run_step_time(
                    plan,
                    spec,
                    steps=args.steps,
                    batch=lay.rows(args.batch),
                    seq=args.seq,
                    out=tmp / f"{name}_{i}_{r}",
                )
            except Exception as e:  # a layout that does not train is a finding, not a crash of the bench
                print(f"  {_what(lay)}: did not run ({e})")
                failed.add(i)
                continue
            best_step, most = measured.get(i, (step, peak))
            measured[i] = (min(best_step, step), max(most, peak))
    return measured


def _confirm(
    rows, plans, fastest: float, picked, measured_pick, name, spec, args, tmp
) -> tuple[float, float | None]:
    """The sweep's fastest is the least of many noisy runs, so it is fast partly by luck (a
    layout run once among forty is compared with the luckiest of forty). The contenders (the
    layouts that fit within 15% of the fastest, up to five, and the picks) run `--confirm`
    rounds more, all alike, and the picks are held against the fastest of those rounds alone."""
    fits = [r[0] for r in rows if args.memory is None or r[3] <= args.memory]
    close = [lay for lay, _, step, _ in rows if lay in fits and step <= 1.15 * fastest][:5]
    contenders = [*close, *(lay for lay in (picked, measured_pick) if lay is not None and lay not in close)]
    chosen = [p for p in plans if p[1] in contenders]
    again = _sweep(chosen, range(args.rounds, args.rounds + args.confirm), name, spec, args, tmp)
    by_layout = {lay: again[i][0] for i, lay, _, _ in chosen if i in again}
    best = min(step for lay, step in by_layout.items() if lay in fits)
    for lay in contenders:
        if lay in by_layout:
            print(f"  confirmed {_what(lay):40} {by_layout[lay] * 1e3:7.1f}ms {by_layout[lay] / best:6.3f} x")
    return by_layout[picked] / best, (by_layout[measured_pick] / best if measured_pick is not None else None)


def main() -> int:
    from meshplan.args import memory_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="sequences a step, over the data ranks")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--memory", type=memory_size, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="runs of every layout; its fastest counts")
    ap.add_argument(
        "--confirm", type=int, default=3, help="rounds more of the contenders, the picks held to those alone"
    )
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument(
        "--measure", type=int, default=3, help="also `suggest --measure K` (0: the estimate's pick alone)"
    )
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            ok &= one_model(name, MODELS[name], args, Path(tmp))
    print("\nall goals met" if ok else "\nsome goal missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
