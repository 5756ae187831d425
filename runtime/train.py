"""The training loop behind `meshplan run`: the plan's optimizer, warmup + cosine LR, global-norm clipping,
gradient accumulation, checkpoints, JSONL metrics on every rank, and what a person watching sees
through a `Display` the caller gives (the command line's progress bar on rank 0).

    meshplan run examples/tiny_dp.plan --steps 200          # launches: torchrun ... -m meshplan.run ...

    axes = Axes(groups={"dp": dp_group, "tp": tp_group}, data=("dp",), sharding=cuts)
    summary = train(program, loss_of, batches, config, axes=axes, sync=DataParallel(program, dp_group))

One optimizer step is `config.accumulation` micro-steps; gradients are synchronized over
the data axis only on the last (`DataParallel.no_sync` before), and each micro-loss is
divided by the number of micro-steps, so k micro-batches of b train exactly like one
batch of k*b (for a mean-reduced loss over equally many tokens).

Gradients are synchronized over the data axis by one `GradSync` engine (`grad_sync.py`):
`Local` (no data axis), `DataParallel`, `Zero` or their expert-parallel forms. The loop reads
and scales the gradient only through it, so clipping and loss scaling are one code path for
all of them, and takes its optimizer from it (`sync.optimizer(config)`), which checkpoints
then save and load through the same engine.

Gradient clipping by global norm: the norm is over the *full* model. Parameters are grouped
by the axes that shard them (`Axes.sharded_over`: () for a whole one, ("tp",) for a column
split, ("ep", "tp") later for an expert's matrix); the engine sums each group's squares over
the data axis (`grad_squares`), and each sum is then summed over the axes that shard its
group. A whole parameter is identical on every rank of those axes and counts once.

Under ZeRO the optimizer is the engine itself, stepping the plan's over this rank's fp32 shards,
and each data rank holds only its shard of the averaged gradient; each rank checkpoints its
own elements (`zero.own_state()`).

Metrics: every rank appends one JSON object per optimizer step to
`RUN_DIR/metrics/rank{R}.jsonl`:

    {"step": 12, "loss": 3.41, "lr": 0.0018, "grad_norm": 0.93, "tokens_per_s": 21000.0,
     "peak_memory": 412000000, "start_memory": 380000000, "state_bytes": 3433628,
     "peak_tensor_bytes": 3712172,
     "mfu": null, "skipped_steps": 0, "time_s": 0.05}

`state_bytes` is the training state this rank holds right after the optimizer step:
parameters, gradients and optimizer state (AdamW's moments and step counters), each storage
once, as the engine counts it (`GradSync.memory()["total"]`): 16 bytes a parameter for fp32
AdamW on one replica, less under ZeRO. `peak_tensor_bytes` is the most bytes of tensors live
at once during the step (forward, backward, optimizer step; `StepPeak`): on a GPU the CUDA
allocator's peak, reset each step; on a CPU a tracker of the storages the ops create, whose
cost (a Python call per op) limits it to one step in `log_every` (the others have null).
Under ZeRO the record adds `"zero_memory": {"params": ..., "grads": ..., "optimizer": ...,
"total": ...}`, the same count by kind, and under a pipeline `"pipeline_idle"`: the fraction of the step this rank's stages spent
waiting for their neighbours (the measured bubble; `runtime/pipeline.py`).

`loss` is the mean over the data axes; `tokens_per_s` is for the whole job
(every dp rank's tokens over the step's wall time); `peak_memory` is bytes: on CPU the
process's peak resident set (`getrusage` maxrss), on GPU `torch.cuda.max_memory_allocated`;
`start_memory` is the same measure taken before the first step: what start-up took (building
or loading the program, this rank's shards, the engine, a resumed checkpoint).
`mfu` = 6 * (this rank's parameters) * (this rank's tokens/s) / peak FLOP/s: the usual
6N-per-token estimate for a forward and backward pass, ignoring attention's own FLOPs.
The peak is `config.peak_flops` if given, else the dense bf16 tensor-core peak of a few
known GPUs (table `PEAK_FLOPS`); on a CPU or an unknown GPU it is unknown and `mfu` is null.
A step is skipped (not applied, counted in `skipped_steps`) when its gradient norm is
not finite.

A dead or stuck peer: every step starts with `watchdog.progress(step)` and every collective
notes itself first (here, in `collectives.py`, `data_parallel.py`). A collective that times
out or loses its connection raises `PeerFailure`, whose one line names this rank, the step,
the collective and the ranks that never joined it (`runtime/watchdog.py`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import resource
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import checkpoint, watchdog, zero_flats
from .axes import Axes
from .collectives import label_collectives
from .grad_sync import GradSync, Local, Optimizer, storage_bytes
from .optimizers import OptimizerChoice

LossFn = Callable[[Tensor, Tensor], Tensor]  # (input_ids, labels) -> scalar loss of one micro-batch
BatchFn = Callable[[int, int], tuple[Tensor, Tensor]]  # (step, micro_step) -> (input_ids, labels)
# (input_ids, labels, k, scale) -> the micro-step's loss / k, detached, after its backward from
# loss / k * scale
ForwardBackward = Callable[[Tensor, Tensor, int, float], Tensor]

# Dense bf16 peak FLOP/s per device, by a substring of `torch.cuda.get_device_name()`.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.1
    optimizer: OptimizerChoice = field(default_factory=OptimizerChoice)  # the plan's; AdamW (0.9, 0.95)
    grad_clip: float = 1.0  # 0 disables clipping
    accumulation: int = 1
    seed: int = 0
    tokens_per_micro_step: int = 0  # per rank: batch * seq
    run_dir: Path = Path("runs/default")
    save_every: int = 0  # 0: only the final checkpoint if saving was asked for
    resume: bool = False
    log_every: int = 10
    peak_flops: float | None = None
    # fp16: the loss is multiplied by `loss_scale` before backward and gradients divided
    # after; `dynamic_loss_scale` halves it on overflow (the step is skipped) and doubles
    # it after `scale_growth_interval` good steps. None: no scaling (fp32, bf16).
    loss_scale: float | None = None
    dynamic_loss_scale: bool = False
    scale_growth_interval: int = 1000


@dataclass
class Summary:
    steps_done: int
    start_step: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # before clipping
    skipped_steps: int = 0
    elapsed_s: float = 0.0
    tokens: int = 0  # whole job
    last: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s else 0.0


# ---------------------------------------------------------------------------- pieces


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine from `lr` to `lr * min_lr_ratio` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.steps - 1 - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def global_grad_norm(sync: GradSync, axes: Axes, names: Iterable[str]) -> Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank (see the module docstring)."""
    kinds: dict[tuple[str, ...], set[str]] = {}
    for name in names:
        if name not in axes.copies:
            kinds.setdefault(axes.sharded_over(name), set()).add(name)
    sharded = sorted(k for k in kinds if k)  # the same order on every rank
    # first the copies of tied weights, whose squares another pipeline rank counts (no such
    # kind without them: the engines' reductions stay what the ledger predicts)
    copies = [set(axes.copies)] if axes.copies else []
    squares = sync.grad_squares([*copies, *(kinds[k] for k in sharded)])
    total = squares[-1]  # whole parameters: counted once
    for i, over in enumerate(sharded):
        total = total + axes.sum_over(squares[len(copies) + i], over, "gradient norm")
    # each pipeline rank holds other stages' parameters: theirs add up
    return axes.sum_over(total, axes.stages, "gradient norm").sqrt()


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():  # the run's peak: `StepPeak` resets the allocator's every step
        return max(int(torch.cuda.max_memory_allocated()), StepPeak.earlier_cuda_peak)
    # Linux reports ru_maxrss in KiB (macOS in bytes)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class StepPeak:
    """`peak_tensor_bytes`: the most bytes of tensors live at once during one optimizer step.

        peak = StepPeak.begin(held_bytes)   # before the step's first forward
        ...                                 # forward, backward, optimizer step
        peak.end()                          # -> bytes

    On a GPU it is the CUDA caching allocator's own count (`max_memory_allocated`, reset
    here every step): every tensor, at no cost. A CPU has no such count in PyTorch (no
    `torch.cpu` memory stats; the profiler's `profile_memory` has it, but costs as much per
    op as the tracker below, prints a line per session and misses frees of blocks allocated
    before it started), so `_LiveTensors` keeps it: a `TorchDispatchMode` that adds each
    storage an op creates (an output no alias annotation ties to an input) and subtracts it
    when the storage dies, on top of `held_bytes` (the training state and buffers held when
    the step starts), plus the bytes ZeRO-3's gathered buffers gain and lose (a storage resized
    is no op: the flats tell it, `zero_flats.RESIZED`). It misses temporaries inside one
    kernel, and the mode's Python call per op costs a small model's step over half its time:
    on a CPU the loop measures one step in `log_every` (`_sampled`)."""

    earlier_cuda_peak = 0  # the allocator's peaks before its latest reset (the run's `peak_memory`)

    def __init__(self, tracker: _LiveTensors | None) -> None:
        self._tracker = tracker

    @classmethod
    def begin(cls, held_bytes: int) -> StepPeak:
        if torch.cuda.is_available():
            cls.earlier_cuda_peak = max(cls.earlier_cuda_peak, int(torch.cuda.max_memory_allocated()))
            torch.cuda.reset_peak_memory_stats()
            return cls(None)
        tracker = _LiveTensors(held_bytes)
        tracker.__enter__()
        return cls(tracker)

    def end(self) -> int:
        if self._tracker is None:
            return int(torch.cuda.max_memory_allocated())
        self._tracker.__exit__(None, None, None)
        return self._tracker.peak


class _LiveTensors(TorchDispatchMode):
    """Bytes of the storages the ops run inside create, while they live, and their peak."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.live = self.peak = start
        self._storages: dict[int, tuple[int, weakref.ref]] = {}  # data pointer -> (bytes, ref)
        self._fresh: dict[Any, list[bool]] = {}  # op -> whether each return is a new tensor

    def __enter__(self) -> _LiveTensors:
        zero_flats.RESIZED.append(self._resized)  # ZeRO-3's gathered buffers
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        zero_flats.RESIZED.remove(self._resized)
        self._storages.clear()  # the refs die with it: no callback after the step

    def _resized(self, delta: int) -> None:
        self.live += delta
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = [r.alias_info is None for r in func._schema.returns]
        if any(fresh):
            # a collective returns the tensors it wrote into without saying so (`_allgather_base_`
            # hands back its output buffer): what was passed in is not new
            given = _storages_of((args, kwargs)) if func.namespace == "c10d" else ()
            results = out if isinstance(out, tuple) else (out,)
            for result, new in zip(results, fresh, strict=False):
                if new:
                    for t in result if isinstance(result, list) else (result,):
                        if (
                            isinstance(t, Tensor)
                            and t.layout == torch.strided
                            and t.device.type == "cpu"
                            and t.untyped_storage().data_ptr() not in given
                        ):
                            self._add(t.untyped_storage())
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or key in self._storages:
            return
        self._storages[key] = (nbytes, weakref.ref(storage, functools.partial(self._dead, key)))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _dead(self, key: int, _: object) -> None:
        nbytes, _ = self._storages.pop(key, (0, None))
        self.live -= nbytes


def _storages_of(tree: object) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)}


def peak_flops(config: TrainConfig) -> float | None:
    if config.peak_flops:
        return config.peak_flops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


class MetricsWriter:
    """Appends one JSON line per step to RUN_DIR/metrics/rank{R}.jsonl (flushed, so a crash loses nothing)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        folder = run_dir / "metrics"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.jsonl"
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------- the loop


def train(
    program: nn.Module,
    loss_of: LossFn,
    batches: BatchFn,
    config: TrainConfig,
    *,
    axes: Axes | None = None,
    sync: GradSync | None = None,
    display: Display | None = None,
    forward_backward: ForwardBackward | None = None,
    step_metrics: Callable[[], dict[str, Any]] | None = None,
    after_backward: Callable[[], None] | None = None,
    between_steps: Callable[[], None] | None = None,
) -> Summary:
    """Train `program` (the module holding this rank's parameters) for `config.steps` optimizer steps.

    `loss_of` runs one micro-batch forward (through `sync` when it is `DataParallel`) and
    returns the loss. `axes` are this rank's process groups by axis name (None: one process), with the plan's
    roles and each parameter's cuts; `sync` synchronizes gradients over the data axis (None:
    there is none). `forward_backward` replaces `loss_of` and its backward where one
    micro-step is more than a forward and a backward (a pipeline's schedule over its
    microbatches), `step_metrics` adds its own facts to each step's record (a
    pipeline's measured idle fraction), and `after_backward` runs once the step's gradients
    are synchronized, before they are read (a pipeline sums a tied weight's over its copies);
    `display` is told the steps as they go (None: nothing shown).
    `between_steps` runs after each optimizer step (the model's own update of its buffers:
    aux-loss-free balancing's expert bias). The engine builds the optimizer with this config's
    hyperparameters (`GradSync.optimizer`); the LR is set here every step.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    axes = axes or Axes()
    torch.manual_seed(config.seed)
    grads: GradSync = sync if sync is not None else Local(program)
    # the plan's optimizer over `program`, or ZeRO's engine stepping it over its shards
    optimizer = grads.optimizer(config, axes)
    ckpt_root = config.run_dir / "checkpoints"
    start, resumed_notes = _maybe_resume(ckpt_root, grads, config, axes)
    metrics = MetricsWriter(config.run_dir, rank)
    dp_size = axes.data_size
    tokens_per_step = config.tokens_per_micro_step * config.accumulation * dp_size  # whole job
    local_params = sum(p.numel() for p in program.parameters())
    flops = peak_flops(config)
    summary = Summary(steps_done=start, start_step=start)
    if display is not None:
        display.begin(config, start)
        for text in resumed_notes:
            display.note(text)
    names = [name for name, _ in program.named_parameters()]
    label_collectives(program)  # the watchdog's report names the graph node a rank waits in
    scale = config.loss_scale
    good_steps = 0
    t_start = time.perf_counter()
    start_memory = peak_memory_bytes()  # start-up's: the program, its shards, the engine, a resume
    try:
        for step in range(start, config.steps):
            watchdog.progress(step + 1)
            t0 = time.perf_counter()
            lr = lr_at(step, config)
            # read each step: loading a checkpoint replaces an optimizer's param groups
            for group in optimizer.param_groups:
                group["lr"] = lr
            measured = torch.cuda.is_available() or _sampled(step + 1, start, config)
            peak = StepPeak.begin(_held_bytes(grads, program)) if measured else None
            try:
                loss = _accumulate(
                    forward_backward or _plain(loss_of),
                    batches,
                    step,
                    config.accumulation,
                    grads,
                    scale or 1.0,
                )  # () mean loss
                if after_backward is not None:
                    after_backward()
                norm = _optimizer_step(grads, optimizer, axes, names, scale, config.grad_clip)
            finally:  # a step that raises leaves no dispatch mode behind in the process
                peak_bytes = peak.end() if peak is not None else None
            skipped = not bool(torch.isfinite(norm))
            held = grads.memory()  # before zero_grad: what the step leaves held
            optimizer.zero_grad()
            if between_steps is not None:
                between_steps()
            if scale is not None and config.dynamic_loss_scale:
                scale, good_steps = _update_scale(scale, good_steps, skipped, config.scale_growth_interval)
            mean_loss = float(axes.mean_over_data(loss, "mean loss"))
            dt = time.perf_counter() - t0
            summary.skipped_steps += skipped
            summary.losses.append(mean_loss)
            summary.grad_norms.append(float(norm))
            summary.steps_done = step + 1
            summary.tokens += tokens_per_step
            tokens_per_s = tokens_per_step / dt
            record: dict[str, Any] = {
                "step": step + 1,
                "loss": mean_loss,
                "lr": lr,
                "grad_norm": float(norm),
                "tokens_per_s": tokens_per_s,
                "peak_memory": peak_memory_bytes(),
                "start_memory": start_memory,
                "state_bytes": held["total"],
                "peak_tensor_bytes": peak_bytes,
                "mfu": (6 * local_params * tokens_per_s / dp_size / flops) if flops else None,
                "skipped_steps": summary.skipped_steps,
                "loss_scale": scale,
                "time_s": dt,
            }
            if optimizer is grads:  # ZeRO: the engine steps its own shards
                record["zero_memory"] = held
            if step_metrics is not None:
                record.update(step_metrics())
            summary.last = record
            metrics.write(record)
            if display is not None:
                display.update(record)
            if _should_save(step + 1, config):
                watchdog.note("checkpoint save", "")
                checkpoint.save(ckpt_root, step + 1, grads, axes=axes)
                if display is not None:
                    display.note(f"saved checkpoint {checkpoint.checkpoint_name(step + 1)}")
    except RuntimeError as e:
        if is_peer_failure(e):  # gloo/NCCL: a peer closed its connection or never answered
            raise PeerFailure(watchdog.diagnose(e)) from e
        raise
    finally:
        metrics.close()
        summary.elapsed_s = time.perf_counter() - t_start
        if display is not None:
            display.close(summary)
    return summary


def _optimizer_step(
    grads: GradSync,
    optimizer: Optimizer,
    axes: Axes,
    names: list[str],
    scale: float | None,
    max_norm: float,
) -> Tensor:
    """One optimizer step after `_accumulate`: unscale and clip the averaged gradient, step
    unless its global norm is not finite. Returns the norm, the same on every rank (so every
    rank skips the same steps)."""
    if scale is not None:
        grads.scale_grads_(1.0 / scale)
    norm = global_grad_norm(grads, axes, names)
    if bool(torch.isfinite(norm)):
        if max_norm > 0:
            grads.scale_grads_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        optimizer.step()
    return norm


class PeerFailure(RuntimeError):
    """A collective failed because another rank died or stopped answering (after the timeout).

    The message is the watchdog's one line: this rank, the step, the collective it waited
    in and the ranks that never joined it (`runtime/watchdog.py`).
    """

    def __init__(self, stall: watchdog.Stall):
        super().__init__(str(stall))
        self.stall = stall
        self.step, self.rank = stall.step, stall.rank


def is_peer_failure(e: BaseException) -> bool:
    """A backend error from a peer that is gone or silent. After one gloo op times out, the
    others on the same pair fail with "Application timeout caused pair closure"."""
    text = str(e)
    return (
        isinstance(e, dist.DistError)
        or watchdog.is_timeout(e)
        or any(word in text for word in ("Connection closed by peer", "Connection reset", "NCCL"))
    )


def _plain(loss_of: LossFn) -> ForwardBackward:
    """One forward and one backward: the micro-step of every layout but a pipeline."""

    def forward_backward(input_ids: Tensor, labels: Tensor, k: int, scale: float) -> Tensor:
        loss = loss_of(input_ids, labels) / k
        (loss * scale if scale != 1.0 else loss).backward()
        return loss.detach()

    return forward_backward


def _accumulate(
    forward_backward: ForwardBackward,
    batches: BatchFn,
    step: int,
    k: int,
    grads: GradSync,
    scale: float = 1.0,
) -> Tensor:
    """k micro-steps of forward and backward; gradients are synchronized on the last one only.

    With a loss scale, backward runs on the scaled loss (gradients come out scaled); the
    returned loss is unscaled.
    """
    total = torch.zeros((), dtype=torch.float64)  # as precise as a float64 model's loss
    for micro in range(k):
        input_ids, labels = batches(step, micro)  # (B, T), (B, T)
        last = micro == k - 1
        with grads.no_sync() if not last else contextlib.nullcontext():
            loss = forward_backward(input_ids, labels, k, scale)
        total += loss.double().cpu()
    grads.finish()
    return total


def _update_scale(scale: float, good_steps: int, overflowed: bool, interval: int) -> tuple[float, int]:
    """Dynamic loss scaling: halve on overflow, double after `interval` steps without one."""
    if overflowed:
        return max(scale / 2, 1.0), 0
    good_steps += 1
    if good_steps >= interval:
        return scale * 2, 0
    return scale, good_steps


def _maybe_resume(root: Path, sync: GradSync, config: TrainConfig, axes: Axes) -> tuple[int, tuple[str, ...]]:
    """The step the run starts at (the latest checkpoint's, resumed, or 0), and what did not
    resume as it was saved (`Restored.notes`)."""
    if not config.resume:
        return 0, ()
    path = checkpoint.latest(root)
    if path is None:
        return 0, ()
    try:
        restored = checkpoint.load(path, sync, axes=axes)
        return restored.step, restored.notes
    except checkpoint.CheckpointError as e:
        older = checkpoint.before(path)
        if older is None:
            raise
        raise checkpoint.CheckpointError(
            f"{e} (hint: move {path.name} out of {root} to resume from {older.name})"
        ) from None


def _sampled(done: int, start: int, config: TrainConfig) -> bool:
    """Whether a CPU measures step `done`'s peak (`StepPeak`): this run's first step and every
    `log_every`-th after it (1, 11, 21, ...), so the steps the display shows (10, 20, ...)
    keep their speed."""
    return (done - start - 1) % max(config.log_every, 1) == 0


def _held_bytes(sync: GradSync, module: nn.Module) -> int:
    """Bytes of tensors live before a step: the training state and the module's buffers."""
    return sync.memory()["total"] + storage_bytes(module.buffers(), set())


def _should_save(done: int, config: TrainConfig) -> bool:
    if config.save_every > 0 and done % config.save_every == 0:
        return True
    return config.save_every > 0 and done == config.steps


class Display(Protocol):
    """What the loop shows a person as it trains (rank 0's, usually): the command line draws it
    (`meshplan.display`); the runtime itself draws nothing."""

    def begin(self, config: TrainConfig, start: int) -> None:
        """Training starts at step `start` (0, or the step a checkpoint resumed at)."""
        ...

    def update(self, record: dict[str, Any]) -> None:
        """A step's metrics record (what `metrics/rank<R>.jsonl` gets)."""
        ...

    def note(self, text: str) -> None:
        """A line of news (a checkpoint saved)."""
        ...

    def close(self, summary: Summary) -> None:
        """Training ended (or stopped): its summary."""
        ...


def summary_dict(summary: Summary) -> dict[str, Any]:
    return asdict(summary) | {"tokens_per_s": summary.tokens_per_s}
