"""Shared pieces of the benchmarks under `bench/`: the model, meshplan's and PyTorch's TP of it,
and a counter of the collectives a step really issues.

Not a benchmark itself; imported by `bench/tp_collectives.py`, `bench/tp_step_time.py` and
`bench/compile_time.py` (run as `python bench/NAME.py`, so this folder is on `sys.path`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.examples.models.llama import Llama, build, example_inputs
from meshplan.runtime import collectives as meshplan_collectives
from meshplan.runtime.mesh import init_mesh
from meshplan.session import partial_grad_sync

ROOT = Path(__file__).resolve().parents[1]
PLAN_TP = str(ROOT / "bench/plans/llama_tp_nosp.plan")  # column/row + vocab, no sequence parallel
PLAN_TP_SP = str(ROOT / "examples/llama_tp.plan")  # the same plus `sequence` rules on the norms
PLAN_TP_BLOCKS = str(ROOT / "bench/plans/llama_tp_blocks.plan")  # column/row only, the rest replicated

OPS = ("all_reduce", "all_gather", "reduce_scatter")
PHASES = ("forward", "backward", "optimizer")


# ---------------------------------------------------------------------------- the model


def llama_source(*, batch: int = 2, seq: int = 16, **overrides: object) -> ModelSource:
    """The example Llama (same seed, same weights) with example inputs of the given shape.

    Built directly rather than through `load_model`, whose factory takes no arguments:
    `compile_plan` only needs the model and the inputs to capture it with.
    """
    model = build(**overrides)
    vocab = model.config.vocab_size
    input_ids, labels = example_inputs(batch, seq, vocab_size=vocab)
    return ModelSource(spec=f"llama{overrides}", model=model, args=(input_ids, labels))


def sized_llama(layers: int, hidden: int, *, heads: int = 8, kv_heads: int = 4, **overrides: object) -> Llama:
    """The example Llama at a benchmark's size: the MLP 8/3 of the hidden size rounded up to 64
    (Llama's ratio), GQA with `heads` query and `kv_heads` key/value heads."""
    return build(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **overrides,
    )


# ---------------------------------------------------------------------------- PyTorch's own TP


def pytorch_tp_plan(
    model: Llama, *, sequence_parallel: bool = False, blocks_only: bool = False
) -> dict[str, ParallelStyle]:
    """The layout of `bench/plans/llama_tp_nosp.plan` (or `examples/llama_tp.plan` with
    `sequence_parallel`, `bench/plans/llama_tp_blocks.plan` with `blocks_only`) in
    `torch.distributed.tensor.parallel` styles, as torchtitan writes it for Llama:
    vocab-parallel embedding (Rowwise on the table), column/row pairs, and a vocab-sharded
    LM head whose DTensor logits go to a loss under `loss_parallel()`.
    """
    seq = Shard(1)  # (B, T, H) sharded on T
    plan: dict[str, ParallelStyle] = {}
    if not blocks_only:
        plan["embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate()
        )
        plan["lm_head"] = ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,
        )
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        prefix = f"layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"{prefix}.mlp.{name}"] = ColwiseParallel()
        out = seq if sequence_parallel else Replicate()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel(output_layouts=out)
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel(output_layouts=out)
        if sequence_parallel:
            plan[f"{prefix}.input_layernorm"] = SequenceParallel()
            plan[f"{prefix}.post_attention_layernorm"] = SequenceParallel()
            # attention takes (x, cos, sin): only x is gathered
            plan[f"{prefix}.self_attn"] = PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
            )
            plan[f"{prefix}.mlp"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            )
    return plan


def parallelize_with_pytorch(
    model: Llama, mesh: DeviceMesh, *, sequence_parallel: bool = False, blocks_only: bool = False
) -> Llama:
    """`parallelize_module` over a one-axis mesh; the model is changed in place and returned.

    The example model reshapes heads with -1, so a rank holding half the q/k/v columns runs
    the unchanged forward with half the heads (GQA groups stay aligned: tp divides kv heads).
    Unless `blocks_only`, the logits are vocab-sharded DTensors: run the forward and the
    backward inside `torch.distributed.tensor.parallel.loss_parallel()`.
    """
    styles = pytorch_tp_plan(model, sequence_parallel=sequence_parallel, blocks_only=blocks_only)
    return parallelize_module(model, mesh, styles)


# ---------------------------------------------------------------------------- hand-written Megatron TP


class MegatronLlama(nn.Module):
    """Megatron-LM tensor parallelism of the example Llama, written by hand (no sequence parallel).

    Each rank keeps its column shards of q/k/v and gate/up, its row shards of o and down,
    its vocab rows of the embedding and LM head. Collectives are meshplan's runtime modules
    (plain autograd functions, the same f/g pairs Megatron uses), placed by hand:

        x = g(embedding(ids))                       # all-reduce of partial lookups
        per block: h = f(norm(x)); x = x + g(o(attn(q(h), k(h), v(h))))   and the same for the MLP
        loss = vocab_parallel_cross_entropy(lm_head(f(norm(x))))
    """

    def __init__(self, model: Llama, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner = model
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.f = meshplan_collectives.CopyToAxis(group, "tp")
        self.g = meshplan_collectives.AllReduce(group, "tp")
        self.embedding = meshplan_collectives.VocabParallelEmbedding(group, "tp")
        self.cross_entropy = meshplan_collectives.VocabParallelCrossEntropy(group, "tp")

        def shard(linear: nn.Module, dim: int) -> None:
            local = linear.weight.detach().chunk(world, dim)[rank].clone()
            linear.weight = nn.Parameter(local)

        for layer in model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                shard(lin, 0)
            shard(layer.mlp.gate_proj, 0)
            shard(layer.mlp.up_proj, 0)
            shard(layer.self_attn.o_proj, 1)
            shard(layer.mlp.down_proj, 1)
        shard(model.embed_tokens, 0)
        shard(model.lm_head, 0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        m = self.inner
        T = input_ids.shape[1]
        cos, sin = m.rope_cos[:T], m.rope_sin[:T]
        x = self.g(self.embedding(m.embed_tokens.weight, input_ids))  # (B, T, H)
        for layer in m.layers:
            h = self.f(layer.input_layernorm(x))
            x = x + self.g(layer.self_attn(h, cos, sin))  # o_proj output is partial: g sums it
            h = self.f(layer.post_attention_layernorm(x))
            x = x + self.g(layer.mlp(h))
        logits = F.linear(self.f(m.norm(x)), m.lm_head.weight)  # (B, T, V/tp)
        return self.cross_entropy(logits.flatten(0, 1), labels.flatten())


# ---------------------------------------------------------------------------- counting collectives


@dataclass
class Tally:
    """Collectives seen, by (op, phase): number of calls and bytes in the ledger's convention
    (the whole tensor of an all-reduce, the whole gathered/scattered tensor otherwise)."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def add(self, op: str, phase: str, nbytes: int) -> None:
        self.calls[op, phase] += 1
        self.bytes[op, phase] += nbytes

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(n for (o, p), n in self.calls.items() if op in (None, o) and phase in (None, p))

    def total_bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(n for (o, p), n in self.bytes.items() if op in (None, o) and phase in (None, p))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    if isinstance(group, tuple):  # funcol's (mesh, mesh_dim)
        return group[0].size(group[1])
    if isinstance(group, DeviceMesh):
        return group.size()
    return dist.get_world_size(group)


class CollectiveCounter:
    """Wrap the Python entry points of every collective for the duration of a `with` block.

    Two families are wrapped, because the two TP implementations use different ones:
    `torch.distributed.{all_reduce, all_gather_single, reduce_scatter_single}` (and their
    `*_into_tensor`/`*_tensor` names, and meshplan's module-level aliases of them, bound at
    import time) for meshplan and the hand-written TP; `_functional_collectives.{all_reduce,
    all_gather_single, reduce_scatter_single, ...}` for DTensor. Only the outermost call is
    counted, so a wrapper calling another wrapped name is one collective.

        counter = CollectiveCounter()
        with counter.phase("forward"):
            loss = program(*inputs)
        with counter.phase("backward"):
            loss.backward()
        counter.tally.count("all_reduce", "backward")
    """

    def __init__(self) -> None:
        self.tally = Tally()
        self._phase = ""
        self._depth = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phase = name
        patches = self._patches()
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
        for owner, attr, wrapper in patches:
            setattr(owner, attr, wrapper)
        try:
            yield
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)
            self._phase = ""

    def _patches(self) -> list[tuple[object, str, Callable]]:
        # op, bytes of one call from its arguments
        def dist_all_reduce(tensor, *a, **k):
            return "all_reduce", _nbytes(tensor)

        def dist_gather(output, input, *a, **k):
            return "all_gather", _nbytes(output)

        def dist_scatter(output, input, *a, **k):
            return "reduce_scatter", _nbytes(input)

        def fc_all_reduce(tensor, *a, **k):
            return "all_reduce", _nbytes(tensor)

        def fc_gather(tensor, gather_dim, group, *a, **k):
            return "all_gather", _nbytes(tensor) * _group_size(group)

        def fc_scatter(tensor, *a, **k):
            return "reduce_scatter", _nbytes(tensor)

        targets = [
            (dist, "all_reduce", dist_all_reduce),
            (dist, "all_gather_single", dist_gather),
            (dist, "all_gather_into_tensor", dist_gather),
            (dist, "reduce_scatter_single", dist_scatter),
            (dist, "reduce_scatter_tensor", dist_scatter),
            (meshplan_collectives, "_all_gather", dist_gather),
            (meshplan_collectives, "_reduce_scatter", dist_scatter),
            (funcol, "all_reduce", fc_all_reduce),
            (funcol, "all_gather_single", fc_gather),
            (funcol, "all_gather_tensor", fc_gather),
            (funcol, "reduce_scatter_single", fc_scatter),
            (funcol, "reduce_scatter_tensor", fc_scatter),
        ]
        return [
            (owner, attr, self._wrap(getattr(owner, attr), describe))
            for owner, attr, describe in targets
            if hasattr(owner, attr)
        ]

    def _wrap(self, fn: Callable, describe: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                op, nbytes = describe(*args, **kwargs)
                self.tally.add(op, self._phase, nbytes)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper


class DispatchCounter:
    """The collectives the process group ran, from the profiler's `c10d::*` op events.

    Independent of which Python function issued them (both `torch.distributed` and the
    functional collectives end in these ops): a check on `CollectiveCounter`. Not the
    `gloo:*` events: gloo runs a reduce-scatter as an all-reduce and names it so.
    The profiler prints start/stop lines on fd 2; they are silenced for the block.
    """

    _OPS: ClassVar[dict[str, str]] = {
        "c10d::allreduce_": "all_reduce",
        "c10d::allreduce_coalesced_": "all_reduce",
        "c10d::_allgather_base_": "all_gather",
        "c10d::allgather_": "all_gather",
        "c10d::allgather_into_tensor_coalesced_": "all_gather",
        "c10d::_reduce_scatter_base_": "reduce_scatter",
        "c10d::reduce_scatter_": "reduce_scatter",
        "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    }

    def __init__(self) -> None:
        self.tally = Tally()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        for event in prof.events():
            if event.name.startswith("c10d::"):  # an unexpected one shows up under its own name
                self.tally.add(self._OPS.get(event.name, event.name), name, 0)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# ---------------------------------------------------------------------------- small helpers


def median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def result(title: str, unit: str, values: dict[str, float]) -> None:
    """One machine-readable line of a benchmark's numbers, a bar per label: `python -m bench`
    plots it into the report (`bench/__main__.py`)."""
    print("bench-result " + json.dumps({"title": title, "unit": unit, "values": values}))


class LiveStorages(TorchDispatchMode):
    """Storages made under the mode, by weak reference: what is still alive is what was kept
    (for backward, when read after a forward). The program's parameters and buffers do not count."""

    def __init__(self, program: torch.nn.Module) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        held = (*program.parameters(), *program.buffers())
        self.skip = {t.untyped_storage()._cdata for t in held}  # a weight's view (`t`) is no activation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in self.skip:
                    self.storages.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


_LIBC = None


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def resident_rise(fn: Callable[[], object]) -> int:
    """How far this process's resident memory rose above its level before `fn()` ran (its peak
    during the call, VmHWM reset through /proc/self/clear_refs, minus VmRSS before). Freed heap
    memory is first returned to the OS (`malloc_trim`), so memory the call reuses counts.
    Every rank calls it: it synchronizes before and after."""
    global _LIBC
    import ctypes
    import gc

    _LIBC = _LIBC or ctypes.CDLL("libc.so.6")
    gc.collect()
    _LIBC.malloc_trim(0)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to VmRSS
    before = _status("VmRSS")
    fn()
    dist.barrier()
    return max(0, _status("VmHWM") - before)


def compiled_step(
    compiled, model: torch.nn.Module, rank: int, inputs: tuple, data: tuple[str, ...] = ()
) -> Callable[[], float]:
    """One training step of a compiled plan's rank program as `meshplan run` takes it: forward,
    backward, the gradient sums the program leaves to the sync and the averaging over the
    `data` axes (`session.partial_grad_sync`), AdamW. Returns the step, which returns the loss."""
    mesh = init_mesh(compiled.layout)
    program = build_rank_program(compiled, model, rank, mesh)
    sync = partial_grad_sync(compiled, program, mesh, data)
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
    bound = bind_inputs(model, compiled.graph, inputs, {})

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        (loss,) = program(*bound)
        loss.backward()
        sync.finish()
        optimizer.step()
        return float(loss.detach())

    return step


def take_turns(
    variants: dict[str, Callable[[], float]], warmup: int, steps: int
) -> dict[str, list[tuple[float, float]]]:
    """Each variant's (seconds, loss) per measured step: every round runs one step of each, a
    barrier before each, so that the machine's load hits them alike; each round in its own
    order (seeded: the same on every rank), so that no variant always runs first or right
    after the same one (a fixed order cost the variant after the single-process ones 5-15%)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    order = random.Random(0)
    for i in range(warmup + steps):
        for name in order.sample(list(variants), len(variants)):
            step = variants[name]
            dist.barrier()
            start = time.perf_counter()
            loss = step()
            if i >= warmup:
                times[name].append((time.perf_counter() - start, loss))
    return times


def same_work_medians(results: list[dict[str, list[tuple[float, float]]]], steps: int) -> dict[str, float]:
    """`take_turns`' results from every rank, for variants computing the same thing: each one's
    median step (a step's time is its slowest rank's), printed with its fastest step and last
    loss, which must agree between the variants. Returns the medians, in seconds."""
    medians = {}
    width = max(len(name) for name in results[0]) + 2
    for name in results[0]:
        per_step = [max(r[name][i][0] for r in results) for i in range(steps)]
        medians[name] = median(per_step)
        loss = results[0][name][-1][1]
        print(
            f"{name:<{width}}{medians[name] * 1e3:>9.1f} ms (median){min(per_step) * 1e3:>9.1f} ms (fastest)   {loss:.6f}"
        )
    losses = [results[0][name][-1][1] for name in medians]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), f"the losses differ: {losses}"
    return medians


def run_step_time(
    plan: Path, model: str, *, steps: int, batch: int, seq: int, out: Path
) -> tuple[float, int]:
    """`meshplan run PLAN` for `steps` steps (torchrun, gloo on this machine's CPUs): the median
    step time (a step's is its slowest rank's `time_s`; the steps after the first two, leaving
    out those the CPU peak tracker slows) and the most live tensor bytes any rank measured in
    a step after the first (whose optimizer has no state yet until its end: the tracker
    measures the first step and one halfway)."""
    import json
    import statistics
    import subprocess
    import sys

    argv = [sys.executable, "-m", "meshplan", "run", str(plan), "--model", model, "--steps", str(steps)]
    argv += [
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--out",
        str(out),
        "--log-every",
        str(max(steps // 2, 1)),
    ]
    subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT)
    per_step: dict[int, float] = {}
    peak = 0
    for f in (out / "metrics").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["step"] > 1 or steps == 1:
                peak = max(peak, rec.get("peak_tensor_bytes") or 0)
            if rec["step"] > 2 and rec.get("peak_tensor_bytes") is None:
                per_step[rec["step"]] = max(per_step.get(rec["step"], 0.0), rec["time_s"])
    return statistics.median(per_step.values()), peak
