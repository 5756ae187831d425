"""Expert parallelism: meshplan's compiled program vs a hand-written all-to-all MoE, same model, same ranks.

    python bench/experts.py [--experts 8] [--hidden 256] [--inner 512] [--layers 2] [--steps 8]

Model: `examples/models/moe.py` (attention + top-2 routed SwiGLU experts, Mixtral's layout),
fp32, B=4, T=128 per rank, on 2 gloo ranks (CPU), experts split over both (`mesh ep=2`: the
batch is split over `ep` too, so every dense weight is averaged over it, torchtitan's layout).

    meshplan   what `meshplan run` runs for `layers.*.mlp.experts: experts over ep (top_k=2)`:
               the compiled program (`open_session`, the run's own engine for the gradients)
    by hand    the same model and weights; each MoE layer's experts module replaced by the
               usual hand-written expert parallelism: sort the (token, slot) pairs by expert,
               exchange the counts, all_to_all_single the rows (the functional
               collective with autograd, as torchtitan does), run the local experts, all_to_all back,
               weigh; DDP averages the dense gradients, each expert's is divided by the ranks

One step = forward, backward, gradient sync, AdamW, zero_grad. Both take turns (one step each
per round) so they share the machine's load; medians of the slowest rank per round. The
first round's losses are printed side by side (the two must agree: same tokens, same weights).
Bytes: the rows the meshplan step hands to all-to-all in forward, summed over the ranks,
against the formula: per layer, the dispatch sends every rank's N k rows of H and the combine
sends them all back, 2 n N k H elements (dropless: exact, whatever the routing; how many
rows stay on their own rank depends on it). The counts' (E,) int64 exchange is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from common import result
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshplan.examples.models import moe
from meshplan.examples.models.llama import example_inputs

WORLD = 2
BATCH, SEQ = 4, 128
SIZES = {"experts": 8, "hidden": 256, "inner": 512, "layers": 2}
SIZES_VAR = "MESHPLAN_BENCH_MOE"  # the sizes, for the copy of this file that `--model` loads
PLAN = "mesh ep={world}\n\nmodules {{\n    layers.*.mlp.experts: experts over ep (top_k=2)\n}}\n"


def model() -> moe.MoEModel:
    """The factory `--model bench/experts.py:model` names (sizes from the command line)."""
    SIZES.update(json.loads(os.environ.get(SIZES_VAR, "{}")))
    return moe.build(
        num_local_experts=SIZES["experts"],
        hidden_size=SIZES["hidden"],
        intermediate_size=SIZES["inner"],
        num_hidden_layers=SIZES["layers"],
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )


# ---------------------------------------------------------------------------- by hand


class HandExperts(nn.Module):
    """This rank's experts of one MoE layer, and the all-to-alls that bring them their tokens."""

    def __init__(self, experts: moe.Experts, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group, self.n, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = experts.num_experts
        self.local = self.num_experts // self.n
        mine = slice(self.rank * self.local, (self.rank + 1) * self.local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[mine].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[mine].clone())

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        N, k = index.shape
        flat = index.reshape(-1)  # (N k,) the expert of each pair
        order = flat.argsort(stable=True)  # pairs grouped by expert, so by destination rank
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,) pairs per expert
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # (n L,): from rank s, for local e
        send = counts.view(self.n, self.local).sum(1).tolist()
        recv = received.view(self.n, self.local).sum(1).tolist()
        rows = _all_to_all(x[order // k], recv, send, self.group)  # (R, H) by source rank, then local expert
        per_source = received.view(self.n, self.local)
        by_expert = torch.arange(self.local).repeat(self.n).repeat_interleave(per_source.flatten())
        regroup = by_expert.argsort(stable=True)  # the received rows grouped by local expert
        outs, start = [], 0
        grouped = rows[regroup]
        for e, n in enumerate(per_source.sum(0).tolist()):
            chunk = grouped[start : start + n]
            gate, up = nn.functional.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e]))
            start += n
        computed = torch.empty_like(grouped)
        computed[regroup] = torch.cat(outs)  # back in the order they arrived
        back = _all_to_all(computed, send, recv, self.group)
        y = torch.empty_like(back)
        y[order] = back  # (N k, H) in (token, slot) order
        return (y.view(N, k, -1) * weights.unsqueeze(-1)).sum(1)


def _all_to_all(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group) -> torch.Tensor:
    """torchtitan's: the functional collective with autograd (backward: the reverse all-to-all)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, out_sizes, in_sizes, group))


def by_hand(group: dist.ProcessGroup):
    net = model()
    for layer in net.layers:
        layer.mlp.experts = HandExperts(layer.mlp.experts, group)
    experts = [n for n, _ in net.named_parameters() if ".experts." in n]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, experts)
    ddp = DistributedDataParallel(net)
    local = [p for n, p in net.named_parameters() if ".experts." in n]
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    n = dist.get_world_size(group)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = ddp(ids, labels)
        loss.backward()
        for p in local:  # the loss is the mean over ranks: an expert's gradient summed them all
            p.grad.div_(n)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


# ---------------------------------------------------------------------------- meshplan


def compiled(folder: str, rank: int, world: int):
    from meshplan.options import parse
    from meshplan.session import open_session

    plan = Path(folder) / "ep.plan"
    options = parse(
        [
            str(plan),
            "--model",
            f"{__file__}:model",
            "--batch",
            str(BATCH),
            "--seq",
            str(SEQ),
            "--out",
            folder,
        ]
    )
    session = open_session(options, rank, world)
    optimizer = torch.optim.AdamW(session.program.parameters(), lr=1e-4)

    def step(ids: torch.Tensor, labels: torch.Tensor, sent: list[int] | None = None) -> float:
        if sent is None:
            loss = session.loss_of(ids, labels)
        else:  # count the floating-point rows handed to all-to-all in forward
            original = dist.all_to_all_single

            def counted(output, input, *args, **kwargs):
                if input.is_floating_point():
                    sent.append(input.numel() * input.element_size())
                return original(output, input, *args, **kwargs)

            dist.all_to_all_single = counted
            try:
                loss = session.loss_of(ids, labels)
            finally:
                dist.all_to_all_single = original
        loss.backward()
        session.dp.finish()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def worker(rank: int, world: int, folder: str, rounds: int, warmup: int) -> dict:
    torch.manual_seed(0)
    ours = compiled(folder, rank, world)
    theirs = by_hand(dist.group.WORLD)
    steps = {"meshplan": ours, "by hand": theirs}
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, float] = {}
    for i in range(warmup + rounds):
        ids, labels = example_inputs(BATCH, SEQ, seed=world * i + rank)
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            loss = step(ids, labels)
            times[name].append(time.perf_counter() - start)
            losses.setdefault(name, loss)
    sent: list[int] = []
    ours(ids, labels, sent)
    return {"times": times, "losses": losses, "sent": sum(sent)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=SIZES["experts"])
    parser.add_argument("--hidden", type=int, default=SIZES["hidden"])
    parser.add_argument("--inner", type=int, default=SIZES["inner"])
    parser.add_argument("--layers", type=int, default=SIZES["layers"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    os.environ[SIZES_VAR] = json.dumps({k: getattr(args, k) for k in SIZES})  # the ranks inherit it

    from meshplan.runtime.launch import spawn

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "ep.plan").write_text(PLAN.format(world=WORLD))
        by_rank = spawn(worker, WORLD, (folder, args.steps, args.warmup), timeout_s=1800)
    print(
        f"MoE fp32, {args.layers} layers, H={args.hidden}, {args.experts} experts of I={args.inner}, top-2, "
        f"B={BATCH} T={SEQ} per rank, ep={WORLD} gloo ranks\n"
    )
    for name in ("meshplan", "by hand"):
        losses = " ".join(f"{r['losses'][name]:.6f}" for r in by_rank)
        print(f"first loss by rank, {name:<9} {losses}")
    t = {
        name: statistics.median(
            max(r["times"][name][i] for r in by_rank) for i in range(args.warmup, args.warmup + args.steps)
        )
        for name in ("meshplan", "by hand")
    }
    rows = 2 * WORLD * BATCH * SEQ * 2 * args.hidden * 4 * args.layers  # 2 n N k H fp32, every layer
    sent = sum(r["sent"] for r in by_rank)
    print(
        f"\nall-to-all rows in forward, all ranks: {sent / 1e6:.3f} MB, formula {rows / 1e6:.3f} MB, ratio {sent / rows:.3f}"
    )
    print()
    for name, v in t.items():
        print(f"{name:>9}  {v * 1e3:8.1f} ms/step")
    print(f"\nmeshplan / by hand  {t['meshplan'] / t['by hand']:.2f}")
    result(f"MoE step, ep={WORLD} (median, slowest rank)", "ms", {k: round(v * 1e3, 1) for k, v in t.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
