"""What `meshplan estimate` prices a step against: one device's compute and memory, and the
links between devices, per kind of machine.

    hw = hardware("h100")                    # a datasheet entry
    hw = hardware("cpu")                     # this machine, as `--calibrate` measured it
    hw = hardware("my_cluster.json")         # an entry a user wrote (the same keys)
    write_entry(calibrate())                 # measure this machine (seconds), keep it

The numbers are a roofline with a fixed cost per op: an op takes `op_overhead` plus the larger
of its FLOPs over the matmul rate of its dtype and its bytes over the memory bandwidth. A
collective takes the ring algorithm's bytes over the link's bandwidth plus a latency per ring
step (its op's own where the link measured one: gloo's), on the intra-node link when every
rank of its group is on one node, else on the inter-node one. Datasheet entries use dense
(not sparse) tensor-core peaks and the bandwidth NCCL reaches in practice, not the wire's;
fp32 matmuls are priced without TF32 (PyTorch's default). A CPU entry is one core: ranks run
one thread each (`OMP_NUM_THREADS=1`), and more ranks than `cores` on a node share them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import CompileError

DTYPES = ("float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s a rank moves through a ring step, in practice
    latency: float  # s per ring step
    send_latency: float | None = None  # s a point-to-point send waits beyond its bytes (None: `latency`)
    handoff: float | None = (
        None  # s a pipeline's message to the next rank waits beyond its bytes (None: `send_latency`)
    )
    # s it waits when other pipelines' ranks (data-parallel replicas) share the CPU cores, two
    # ranks a core (None: `handoff`): a woken rank waits for a core another pipeline holds
    shared_handoff: float | None = None
    # s per ring step of each collective where it differs from `latency` (gloo on a CPU: its
    # all-gather, reduce-scatter and all-to-all are not half an all-reduce, as a ring's steps say)
    latencies: dict[str, float] = field(default_factory=dict)

    def step_latency(self, op: str) -> float:
        """Seconds per ring step of `op` ("all_reduce", "all_gather", ...)."""
        return self.latencies.get(op, self.latency)

    def for_pipelines(self, shared: bool = False) -> Link:
        """The link as a pipeline's messages meet it: a send at the hand-off's latency (`shared`:
        while other pipelines' ranks share the cores, `shared_handoff`)."""
        latency = self.shared_handoff if shared and self.shared_handoff is not None else self.handoff
        return self if latency is None else dataclasses.replace(self, send_latency=latency)


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: dict[str, float]  # matmul FLOP/s of one device, per dtype (`DTYPES`)
    memory_bandwidth: float  # bytes/s of one device
    op_overhead: float  # s each op costs beyond its FLOPs and bytes (dispatch, launch)
    intra: Link  # between devices of one node
    inter: Link  # between nodes
    devices_per_node: int
    optimizer_tensor: float = 0.0  # s the optimizer step spends per tensor it updates
    step_overhead: float = 0.0  # s the training loop spends once a step (the norm read back, the metrics)
    cores: int | None = None  # a CPU: ranks beyond this many on a node share the cores
    overlap: float = 1.0  # the share of a collective issued ahead that runs beside compute
    crowding: float = 1.0  # a CPU: how much longer ops take with a rank on every core
    cache_bytes: int = 0  # an op touching at most this many bytes runs at `cache_bandwidth`
    cache_bandwidth: float = 0.0
    attention: float = 1.0  # the share of the matmul rate attention kernels reach
    selective_op: float = 0.0  # s selective checkpointing's policy adds to each op it sees (Python, per op)
    source: str = ""  # where the numbers come from

    def bandwidth(self, nbytes: float) -> float:
        """Bytes/s of an op that reads and writes `nbytes`: from cache when they fit in it."""
        return (
            self.cache_bandwidth
            if nbytes <= self.cache_bytes and self.cache_bandwidth
            else self.memory_bandwidth
        )

    def flops_of(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return self.flops.get(name) or self.flops["float32"]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Hardware:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown keys {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
        data = dict(data)
        data["intra"], data["inter"] = Link(**data["intra"]), Link(**data["inter"])
        data["flops"] = {str(k): float(v) for k, v in data["flops"].items()}
        return cls(**data)


def _gpu(name: str, bf16: float, fp32: float, hbm: float, nvlink: float, network: float, source: str):
    return Hardware(
        name=name,
        flops={"bfloat16": bf16, "float16": bf16, "float32": fp32, "float64": fp32},
        memory_bandwidth=hbm,
        op_overhead=5e-6,  # an eager kernel launch
        intra=Link(nvlink, 10e-6),
        inter=Link(network, 20e-6),
        devices_per_node=8,
        optimizer_tensor=5e-6,
        source=source,
    )


# Datasheets (SXM parts, dense peaks); link bandwidths are what NCCL's bus bandwidth reaches
# (about 80% of NVLink's per-direction rate; one 400 or 200 Gb/s NIC per GPU).
TABLE: dict[str, Hardware] = {
    "h100": _gpu("h100", 989e12, 67e12, 3.35e12, 360e9, 40e9, "NVIDIA H100 SXM datasheet"),
    "h200": _gpu("h200", 989e12, 67e12, 4.8e12, 360e9, 40e9, "NVIDIA H200 SXM datasheet"),
    "a100": _gpu("a100", 312e12, 19.5e12, 2.039e12, 240e9, 20e9, "NVIDIA A100 SXM 80GB datasheet"),
    "cpu": Hardware(  # one AVX2 core, gloo over loopback; `--calibrate` replaces it with this machine's
        name="cpu",
        flops={"float32": 50e9, "float64": 25e9, "bfloat16": 10e9, "float16": 5e9},
        memory_bandwidth=10e9,
        op_overhead=10e-6,
        intra=Link(2e9, 50e-6),
        inter=Link(1e9, 100e-6),
        devices_per_node=os.cpu_count() or 1,
        optimizer_tensor=20e-6,
        cores=os.cpu_count() or 1,
        overlap=0.0,
        source="generic figures for one CPU core (not measured: run `meshplan estimate --calibrate`)",
    ),
}


def config_dir() -> Path:
    """Where measured entries are kept: `$MESHPLAN_CONFIG`, else `$XDG_CONFIG_HOME/meshplan`."""
    if os.environ.get("MESHPLAN_CONFIG"):
        return Path(os.environ["MESHPLAN_CONFIG"])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "meshplan"


def entry_path(name: str) -> Path:
    return config_dir() / "hardware" / f"{name}.json"


def hardware(name: str) -> Hardware:
    """A table entry (`TABLE`; a measured one kept by `--calibrate` wins over its datasheet), or a
    JSON file of `Hardware`'s keys. An unknown name is a `CompileError` naming the known ones."""
    path = Path(name) if name.endswith(".json") else entry_path(name)
    if path.is_file():
        try:
            return Hardware.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise CompileError(f"{path}: not a hardware entry ({e})") from None
    if name.endswith(".json"):
        raise CompileError(f"{name}: no such file")
    if name not in TABLE:
        raise CompileError(
            f"unknown hardware {name!r}: one of {', '.join(TABLE)}, or a .json file of its keys"
        )
    return TABLE[name]


def write_entry(hw: Hardware) -> Path:
    path = entry_path(hw.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(hw.to_json(), indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------- calibration


def _timed(fn, *, seconds: float = 0.25, device: torch.device) -> float:
    """Seconds one call of `fn` takes: the median of batches run for about `seconds`."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    per_batch = max(1, int(seconds / 5 / once))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / per_batch)
    return sorted(samples)[len(samples) // 2]


@dataclass
class Calibration:
    """What `calibrate` measured, with the figure each gave (for the report)."""

    hardware: Hardware
    measured: dict[str, str] = field(default_factory=dict)


COMPUTE_ROUNDS = 3


def calibrate(
    device: str | None = None,
    *,
    links: bool = True,
    loop: Callable[[torch.device], tuple[float, float]] | None = None,
    rounds: int = COMPUTE_ROUNDS,
) -> Calibration:
    """Measure this machine: matmul FLOP/s per dtype, copy bandwidth, the cost of one op
    forward and backward, the optimizer's cost per tensor, and (`links`) gloo's latency and
    bandwidth between two local processes. CPU: one thread, as a rank runs.

    A shared machine has slow seconds: the device's figures are measured `rounds` times, one
    before the links and the others after, and each is the median of its rounds.

    `loop(device)`: the training loop's own seconds per step and per parameter beside forward
    and backward, measured through the loop (`runtime.loop_cost.measure`, which the command
    line passes: the compiler does not import the training loop); without it, the optimizer's
    step alone per tensor and nothing per step."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    first = _device_figures(dev, loop)
    base = TABLE["cpu"] if dev.type == "cpu" else TABLE.get(gpu_name(dev), TABLE["h100"])
    intra, overlap, shared = (
        _gloo_link() if links and dev.type == "cpu" else (base.intra, base.overlap, first["overhead"])
    )
    figures = _medians([first, *(_device_figures(dev, loop) for _ in range(rounds - 1))])
    flops, bandwidth, overhead = figures["flops"], figures["bandwidth"], figures["overhead"]
    cache, cache_bandwidth, selective = figures["cache"], figures["cache_bandwidth"], figures["selective"]
    step_overhead, optimizer_tensor = figures["step_overhead"], figures["optimizer_tensor"]
    crowding = max(1.0, shared / overhead)
    name = "cpu" if dev.type == "cpu" else base.name
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    when = time.strftime("%Y-%m-%d %H:%M")
    hw = Hardware(
        name=name,
        flops=flops,
        memory_bandwidth=bandwidth,
        op_overhead=overhead,
        intra=intra,
        inter=base.inter if dev.type != "cpu" else intra,
        devices_per_node=cores if dev.type == "cpu" else base.devices_per_node,
        optimizer_tensor=optimizer_tensor,
        step_overhead=step_overhead,
        cores=cores if dev.type == "cpu" else None,
        overlap=overlap,
        crowding=crowding,
        selective_op=selective,
        cache_bytes=cache,
        cache_bandwidth=cache_bandwidth,
        source=f"measured by `meshplan estimate --calibrate` on {platform.node()} ({dev.type}), {when}",
    )
    measured = {
        **{f"matmul {k}": f"{v / 1e9:.1f} GFLOP/s" for k, v in flops.items()},
        "copy": f"{bandwidth / 1e9:.2f} GB/s"
        + (f", {cache_bandwidth / 1e9:.1f} GB/s within {cache // 1024} KiB of cache" if cache else ""),
        "op": f"{overhead * 1e6:.1f} us, {selective * 1e6:.1f} us more under selective checkpointing",
        "optimizer": f"{optimizer_tensor * 1e6:.1f} us a tensor"
        + (f", the loop {step_overhead * 1e6:.0f} us a step" if loop is not None else ""),
        "gloo": f"{intra.latency * 1e6:.0f} us a ring step ("
        + ", ".join(f"{op.replace('_', '-')}'s {t * 1e6:.0f}" for op, t in intra.latencies.items())
        + f"), {(intra.send_latency or 0) * 1e6:.0f} us a send and receive, "
        f"{intra.bandwidth / 1e9:.2f} GB/s, "
        f"{overlap:.0%} of it beside compute",
        "two ranks at once": f"each op {crowding:.2f}x as long",
    }
    return Calibration(hw, measured)


def _device_figures(
    dev: torch.device, loop: Callable[[torch.device], tuple[float, float]] | None
) -> dict[str, Any]:
    """One round of the device's own figures (`calibrate`'s), by name."""
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        flops = {}
        for name in DTYPES:
            dtype = getattr(torch, name)
            n = 512 if dev.type == "cpu" else 8192
            a = torch.randn(n, n, device=dev).to(dtype)
            flops[name] = 2 * n**3 / _timed(lambda a=a: a @ a, device=dev)
        cache = _cache_bytes() if dev.type == "cpu" else 0
        step_overhead, optimizer_tensor = loop(dev) if loop is not None else (0.0, _optimizer_per_tensor(dev))
        return {
            "flops": flops,
            "bandwidth": _copy_bandwidth(64 * 2**20 if dev.type == "cpu" else 2**30, dev),
            "cache": cache,
            "cache_bandwidth": _copy_bandwidth(cache // 4, dev) if cache else 0.0,
            "overhead": _op_overhead(dev),
            "selective": _selective_op(dev) if dev.type == "cpu" else 0.0,
            "step_overhead": step_overhead,
            "optimizer_tensor": optimizer_tensor,
        }
    finally:
        torch.set_num_threads(threads)


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over `rounds` (a dict of figures: each of its entries')."""
    return {
        key: {k: statistics.median(r[key][k] for r in rounds) for k in first}
        if isinstance(first := rounds[0][key], dict)
        else statistics.median(r[key] for r in rounds)
        for key in rounds[0]
    }


def gpu_name(dev: torch.device) -> str:
    label = torch.cuda.get_device_name(dev).lower()
    return next((k for k in ("h200", "h100", "a100") if k in label), "h100")


def _copy_bandwidth(size: int, dev: torch.device) -> float:
    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * size / _timed(lambda: dst.copy_(src), device=dev)


def _cache_bytes() -> int:
    """The per-core (L2) cache, from sysfs; 1 MiB where it does not say."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
        return int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, KeyError, IndexError):
        return 2**20


class _Block(torch.nn.Module):
    """A transformer block at a size where its ops cost nothing but their dispatch: norm,
    fused projection split by heads, causal attention, MLP, residuals."""

    def __init__(self, h: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(h)
        self.qkv, self.out = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.up, self.down = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, h))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _op_overhead(dev: torch.device) -> float:
    """Seconds per op of small transformer blocks forward and backward: what a model's many
    little ops (views included, as the estimate counts them) cost beyond their arithmetic."""
    model = torch.nn.Sequential(*[_Block() for _ in range(4)]).to(dev)
    x = torch.randn(2, 8, 32, device=dev)

    def step() -> None:
        model(x).sum().backward()

    return _timed(step, device=dev) / _op_count(step)


def _selective_op(dev: torch.device) -> float:
    """Seconds `checkpoint selective` adds to each op of a region: torch's policy runs in Python
    for every op, as the forward keeps what it chooses and again as backward recomputes (the
    forward's caching mode timed against the plain forward; datasheet entries: 0, a GPU's
    Python runs ahead of its kernels)."""
    from .passes.checkpoint import SelectiveContext

    model = torch.nn.Sequential(*[_Block() for _ in range(4)]).to(dev)
    x = torch.randn(2, 8, 32, device=dev)
    ops = _op_count(lambda: model(x))

    def kept() -> None:
        caching, _ = SelectiveContext.SAVE_MATMULS()  # the contexts a compiled region makes
        with caching:
            model(x)

    with torch.no_grad():
        plain, selective = _timed(lambda: model(x), device=dev), _timed(kept, device=dev)
    return max(selective - plain, 0.0) / ops


def _op_count(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def _optimizer_per_tensor(dev: torch.device) -> float:
    """Seconds per tensor of what a training step does after backward, as `meshplan run` does
    it: the gradient's global norm, clipping, fused AdamW, gradients zeroed."""
    params = [torch.zeros(16, device=dev, requires_grad=True) for _ in range(64)]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=dev.type in ("cpu", "cuda"))

    def step() -> None:
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        if bool(torch.isfinite(norm)):
            opt.step()
        opt.zero_grad(set_to_none=False)

    return _timed(step, device=dev) / len(params)


def _gloo_link() -> tuple[Link, float, float]:
    """All-reduce between two local processes over gloo, each reached from a millisecond of
    compute as a step reaches them: latency from 4 KB (gloo's small messages all cost about the
    same), bandwidth from 8 MB (a ring of two moves each byte once each way); the other
    collectives' latencies the same way (gloo's all-gather and reduce-scatter cost most of an
    all-reduce, not the half a ring's steps say), and a batch of sends and receives each way
    (a ring attention's step); how much of an all-reduce issued ahead runs beside compute (0:
    none); and an op's cost while both processes compute (cores shared: caches, memory
    bandwidth, frequency)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    small, large, nbytes, compute, both, shared, exchange, *others = queue.get()
    latency = small / 2  # 2 (n - 1) ring steps for n = 2
    bandwidth = nbytes / max(large - small, 1e-9)  # 2 (n - 1) / n = 1 byte per byte, n = 2
    overlap = (compute + large - both) / min(compute, large)
    # one ring step each for n = 2
    latencies = {op: max(t, 1e-6) for op, t in zip(ONE_STEP_OPS, others, strict=True)}
    link = Link(bandwidth, latency, max(exchange, 1e-6), latencies=latencies)
    return link, min(max(overlap, 0.0), 1.0), shared


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LINK_ROUNDS = 3
ONE_STEP_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # measured beside the all-reduce


def _gloo_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        small = torch.zeros(1024)
        nbytes = 8 * 2**20
        large = torch.zeros(nbytes // 4)
        a = torch.randn(128, 128)

        def work() -> None:  # about a millisecond: ranks arrive at a collective from compute, as in a step
            for _ in range(32):
                a @ a

        def then(collective: Callable[[], object]):
            def call() -> None:
                work()
                collective()

            return call

        half = torch.zeros(small.numel() // 2)
        received = (torch.empty_like(small), torch.empty_like(half))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        others = {  # as the runtime issues them (`runtime/collectives.py`), the same 4 KB on the wire
            "all_gather": lambda: gather(small, half),
            "reduce_scatter": lambda: scatter(half, small),
            "all_to_all": lambda: dist.all_to_all_single(received[0], small),
        }
        assert tuple(others) == ONE_STEP_OPS

        def swap() -> None:  # two blocks each way in one batch, as a ring's step sends keys and values
            peer = 1 - rank
            ops = [dist.P2POp(dist.isend, t, peer) for t in (small, half)]
            ops += [dist.P2POp(dist.irecv, t, peer) for t in received]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        def compute() -> None:
            for _ in range(8):
                work()

        def beside() -> None:
            handle = dist.all_reduce(large, async_op=True)
            compute()
            handle.wait()

        def once() -> tuple[float, ...]:
            t_work = _same_count(work, 50)  # both ranks run as many of everything
            t_small = _same_count(then(lambda: dist.all_reduce(small)), 50) - t_work
            t_swap = _same_count(then(swap), 50) - t_work
            t_large = _same_count(then(lambda: dist.all_reduce(large)), 10) - t_work
            t_others = [_same_count(then(op), 50) - t_work for op in others.values()]
            t_compute = _same_count(compute, 3)
            t_both = _same_count(beside, 3)
            dist.barrier()
            shared = _op_overhead(torch.device("cpu"))  # both ranks at once: the cores shared
            return t_small, t_large, nbytes, t_compute, t_both, shared, t_swap, *t_others

        # a shared machine's links come and go: each figure the median of a few rounds
        rounds = [once() for _ in range(LINK_ROUNDS)]
        if rank == 0:
            queue.put(tuple(statistics.median(column) for column in zip(*rounds, strict=True)))
    finally:
        dist.destroy_process_group()


def _same_count(fn, count: int, rounds: int = 5) -> float:
    """Seconds per call, the median of `rounds` of a fixed count (a collective's ranks must call
    it as often)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(count):
            fn()
        samples.append((time.perf_counter() - start) / count)
    return sorted(samples)[rounds // 2]
