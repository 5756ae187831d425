"""Compressed gradient all-reduce: what `DataParallel` sends for a bucket under `compress`.

    data_parallel over dp { compress = powersgd(rank=4) }      # or: compress = bf16

Both methods are lossy and keep each rank's error for the next step (error feedback), so what
one step rounds away is sent later instead of lost: the sum over steps of what was applied
tracks the sum of the true averages. Both keep the parameters replicated bit for bit: every
rank ends the step with the same all-reduced result (verify holds them to a short run's
convergence, not to float64 parity: `cli/verify.py`).

`bf16` (half the bytes): each rank adds its residual to its gradients, sends them rounded to
bf16, keeps `grad - bf16(grad)` as the next residual. The sum is the backend's, in bf16.

`powersgd(rank=r, warmup=k)` (Vogels et al. 2019, as torch's `powerSGD_hook` does it, on
meshplan's buckets): each matrix gradient M (rows x cols: the first dim by the rest) is sent as
two thin factors, r (rows + cols) numbers instead of rows cols:

    M += error                      # error feedback: what the last step's approximation missed
    P = M Q                         # (rows, r); Q (cols, r) is last step's (warm start)
    all-reduce P; orthonormalize P's columns (Gram-Schmidt: the same on every rank, it is one P)
    Q = M^T P                       # (cols, r)
    all-reduce Q; Q /= ranks
    M_hat = P Q^T                   # the average of the Ms projected on P's columns; every rank's
    error = M - M_hat               # this rank's, kept for the next step

1-D tensors (biases, norms) and matrices too small to gain at least 2x (`buckets.low_rank_shape`)
are all-reduced whole, exactly. Q starts as an orthonormalized Gaussian from a generator seeded
by (seed, bucket, matrix): the same on every rank without a broadcast, and not the global RNG.
The first `warmup` optimizer steps all-reduce the bucket uncompressed (torch's
`start_powerSGD_iter`), so the approximation starts from trained-in gradients if asked.

Per bucket, the whole tensors and P are launched during backward (when the bucket is ready),
Q when `finish()` waits for the bucket: Q needs P reduced first. The bytes of each part are
`buckets.compressed_wire`'s, which the compiler's ledger lists too.

Under ZeRO (`zero_grads.py`) a bucket is a flat, padded to a multiple of the group size:

    stage  bf16                                   powersgd
    1      all-reduce, as above                   all-reduce of the parts, as above
    2, 3   reduce-scatter in bf16                 all-reduce of the parts, then each rank keeps
           (`Bf16Feedback.launch_scatter`)        its shard of M_hat (no reduce-scatter form)

ZeRO-1 all-reduces full gradients anyway, so both methods apply unchanged: the flat holds
whole parameters, each matrix's view is there, and every rank then steps its own shard.

Under ZeRO-2/3, bf16 becomes a bf16 reduce-scatter: each rank sent the whole flat, so it keeps
the residual of the whole flat, and the shard it receives is its average. PowerSGD has no
reduce-scatter form: P and Q are sums over ranks of every rank's product, all-reduced, and
M_hat = P Q^T is the same on every rank. Reducing the factors and keeping this rank's shard of
M_hat is exactly PowerSGD's math (the same update as ZeRO-1's, bit for bit), and the factors
are what the bytes are saved on; the alternative, a reduce-scatter of something, would not be
PowerSGD. What it costs: M_hat is made whole, in the (padded,) buffer the flat's gradients were
gathered into before the reduction anyway, and freed when the shard is kept.

Checkpoints keep each rank's state (`saved()`: bf16's residual, PowerSGD's errors, Q and its step
count) under the rank's own keys, and `restore()` takes it back, so a resumed run continues the
uninterrupted one bit for bit. It is this rank's and this bucket layout's: a run resumed on
another layout (other ranks, another bucket size) starts its error feedback from zero, and says so
(`runtime/checkpoint.py`).

The memory both methods cost under ZeRO-2/3, said plainly: error feedback keeps a residual of
the whole flat per rank across steps (bf16's `residual`, PowerSGD's `errors`), so the gradient
memory ZeRO-2 saves comes back as compression state, one full gradient per rank. `state()`
hands it out; `Zero.memory()` counts it under "grads".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .buckets import low_rank_shape
from .collectives import reduce_scatter_single


@dataclass(frozen=True)
class Compression:
    """The plan's `compress` setting as the engine takes it."""

    method: str  # "powersgd" or "bf16"
    rank: int = 4  # powersgd's approximation rank
    warmup: int = 0  # powersgd: optimizer steps all-reduced uncompressed first
    seed: int = 0  # powersgd: Q's initial values (the same on every rank)


class Reduction:
    """A compressed bucket's reduction in flight: the bytes it issued when launched (`launched`),
    and `wait()`, which completes it (writing the average into the bucket's flat) and returns the
    bytes of the all-reduces it issued on the way."""

    def __init__(self, launched: list[int], finish: Callable[[], list[int]]) -> None:
        self.launched = launched
        self._finish = finish

    def wait(self) -> list[int]:
        return self._finish()


class BucketCompressor(Protocol):
    """One bucket's compression and the state it keeps across steps."""

    def launch(self, flat: Tensor, group: dist.ProcessGroup, divisor: int) -> Reduction:
        """Start reducing `flat` (the bucket's gradients, (numel,)); on `wait()` it holds the average."""
        ...

    def state(self) -> list[Tensor]:
        """The tensors it keeps across steps (error feedback, warm starts), for memory counts."""
        ...

    def saved(self) -> dict[str, Tensor]:
        """What a checkpoint keeps of it, by name (empty before a bf16 bucket's first step)."""
        ...

    def fits(self, saved: dict[str, Tensor]) -> bool:
        """Whether `saved` (a checkpoint's `saved()`) is this bucket's kind and shapes."""
        ...

    def restore(self, saved: dict[str, Tensor]) -> None:
        """Take back what `saved()` gave (it `fits`)."""
        ...


def compressor(
    compression: Compression, params: Sequence[Tensor], index: int, numel: int
) -> BucketCompressor:
    """The compressor of bucket `index`, which holds `params` (in bucket order) in a flat of
    `numel` elements (ZeRO's padded)."""
    if compression.method == "bf16":
        return Bf16Feedback(numel)
    if compression.method == "powersgd":
        return PowerSGD(params, compression, index)
    raise ValueError(f"unknown gradient compression {compression.method!r}: powersgd or bf16")


class Bf16Feedback:
    """The bucket sent in bf16; the rounding each rank dropped added back the next step."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.residual: Tensor | None = None  # (numel,) in the gradients' dtype, from the first step

    def state(self) -> list[Tensor]:
        return [self.residual] if self.residual is not None else []

    def saved(self) -> dict[str, Tensor]:
        return {"residual": self.residual} if self.residual is not None else {}

    def fits(self, saved: dict[str, Tensor]) -> bool:
        return not set(saved) - {"residual"} and all(t.shape == (self.numel,) for t in saved.values())

    def restore(self, saved: dict[str, Tensor]) -> None:
        self.residual = saved.get("residual")

    def launch(self, flat: Tensor, group: dist.ProcessGroup, divisor: int) -> Reduction:
        sent = self._rounded(flat)
        work = dist.all_reduce(sent, group=group, async_op=True)

        def finish() -> list[int]:
            work.wait()
            flat.copy_(sent).div_(divisor)
            return []

        return Reduction([sent.nbytes], finish)

    def launch_scatter(
        self, flat: Tensor, group: dist.ProcessGroup, divisor: int, *, via_all_reduce: bool
    ) -> tuple[Reduction, Tensor]:
        """ZeRO-2/3: `flat` (padded,) reduce-scattered in bf16. Returns the reduction and this
        rank's (S,) shard, which holds its part of the average (in `flat`'s dtype) once `wait()`
        returns. `via_all_reduce`: issued as an all-reduce of which this rank keeps its shard
        (gloo's reduce-scatter is slower than its all-reduce: `zero_grads.py`)."""
        sent = self._rounded(flat)  # (padded,) bf16
        size = flat.numel() // dist.get_world_size(group)  # S
        rank = dist.get_rank(group)
        if via_all_reduce:
            work = dist.all_reduce(sent, group=group, async_op=True)
            received = sent[rank * size : (rank + 1) * size]
        else:
            received = sent.new_empty(size)  # (S,) bf16
            work = reduce_scatter_single(received, sent, group=group, async_op=True)
        shard = flat.new_empty(size)  # (S,)

        def finish() -> list[int]:
            work.wait()
            shard.copy_(received).div_(divisor)
            return []

        return Reduction([sent.nbytes], finish), shard

    def _rounded(self, flat: Tensor) -> Tensor:
        """`flat` plus last step's residual, in bf16; the rounding it drops becomes the residual."""
        if self.residual is not None:
            flat.add_(self.residual.to(flat.device))  # (a restored one is read onto the host)
        sent = flat.to(torch.bfloat16)
        self.residual = flat - sent.to(flat.dtype)
        return sent


class PowerSGD:
    """Rank-r PowerSGD over one bucket, with error feedback and warm start (the module docstring)."""

    def __init__(self, params: Sequence[Tensor], compression: Compression, index: int) -> None:
        self.rank = compression.rank
        self.warmup = compression.warmup
        self.steps = torch.zeros((), dtype=torch.int64)  # launches so far (a tensor: checkpoints keep it)
        self.whole: list[slice] = []  # the flat's slices sent exactly
        self.matrices: list[tuple[slice, int, int]] = []  # (slice, rows, cols) sent as factors
        offset = 0
        for p in params:
            part = slice(offset, offset + p.numel())
            shape = low_rank_shape(p, self.rank)
            if shape is None:
                self.whole.append(part)
            else:
                self.matrices.append((part, *shape))
            offset += p.numel()
        dtype, device = params[0].dtype, params[0].device
        self.errors = [torch.zeros(rows, cols, dtype=dtype, device=device) for _, rows, cols in self.matrices]
        # Q of every matrix in one flat (one all-reduce), each warm-started from the last step's
        self.q_flat = torch.empty(sum(cols for _, _, cols in self.matrices) * self.rank, dtype=dtype)
        self.qs = _split(self.q_flat, [(cols, self.rank) for _, _, cols in self.matrices])
        for i, q in enumerate(self.qs):
            generator = torch.Generator().manual_seed(compression.seed * 1_000_003 + index * 10_007 + i)
            q.copy_(torch.randn(q.shape, generator=generator, dtype=dtype))
            _orthonormalize_(q)
        self.q_flat = self.q_flat.to(device)
        self.qs = _split(self.q_flat, [(cols, self.rank) for _, _, cols in self.matrices])

    def state(self) -> list[Tensor]:
        return [*self.errors, self.q_flat]

    def saved(self) -> dict[str, Tensor]:
        return {"q": self.q_flat, "steps": self.steps} | {f"error{i}": e for i, e in enumerate(self.errors)}

    def fits(self, saved: dict[str, Tensor]) -> bool:
        mine = self.saved()
        return set(saved) == set(mine) and all(saved[k].shape == t.shape for k, t in mine.items())

    def restore(self, saved: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for key, t in self.saved().items():
                t.copy_(saved[key])

    def launch(self, flat: Tensor, group: dist.ProcessGroup, divisor: int) -> Reduction:
        self.steps += 1
        if int(self.steps) <= self.warmup:
            return _exact(flat, group, divisor)
        launched = []
        whole = torch.cat([flat[s] for s in self.whole]) if self.whole else None
        whole_work = None
        if whole is not None:
            whole_work = dist.all_reduce(whole, group=group, async_op=True)
            launched.append(whole.numel() * whole.element_size())
        ms = [flat[s].view(rows, cols) for s, rows, cols in self.matrices]  # views: M in place
        for m, error in zip(ms, self.errors, strict=True):
            m.add_(error)
        p_flat = torch.empty(
            sum(rows for _, rows, _ in self.matrices) * self.rank, dtype=flat.dtype, device=flat.device
        )
        ps = _split(p_flat, [(rows, self.rank) for _, rows, _ in self.matrices])
        for m, q, p in zip(ms, self.qs, ps, strict=True):
            torch.mm(m, q, out=p)  # (rows, r)
        p_work = None
        if ms:
            p_work = dist.all_reduce(p_flat, group=group, async_op=True)
            launched.append(p_flat.numel() * p_flat.element_size())

        def finish() -> list[int]:
            if whole_work is not None and whole is not None:
                whole_work.wait()
                whole.div_(divisor)
                offset = 0
                for s in self.whole:
                    flat[s].copy_(whole[offset : offset + s.stop - s.start])
                    offset += s.stop - s.start
            if p_work is None:
                return []
            p_work.wait()
            for p in ps:
                _orthonormalize_(p)
            for m, p, q in zip(ms, ps, self.qs, strict=True):
                torch.mm(m.t(), p, out=q)  # (cols, r)
            dist.all_reduce(self.q_flat, group=group)
            self.q_flat.div_(divisor)
            for m, p, q, error in zip(ms, ps, self.qs, self.errors, strict=True):
                approx = p @ q.t()  # (rows, cols): the same on every rank
                torch.sub(m, approx, out=error)
                m.copy_(approx)
            return [self.q_flat.numel() * self.q_flat.element_size()]

        return Reduction(launched, finish)


def saved_state(compressors: Sequence[BucketCompressor]) -> dict[str, Tensor]:
    """What a checkpoint keeps of an engine's compressors (in bucket order): `bucket{i}.{name}`."""
    return {f"bucket{i}.{key}": t for i, c in enumerate(compressors) for key, t in c.saved().items()}


def restore_state(compressors: Sequence[BucketCompressor], saved: dict[str, Tensor]) -> bool:
    """`saved_state`'s tensors back into `compressors`, if every bucket's fits (the same layout's);
    False, and nothing restored, if not."""
    by_bucket: list[dict[str, Tensor]] = [{} for _ in compressors]
    for key, t in saved.items():
        bucket, _, name = key.partition(".")
        index = int(bucket.removeprefix("bucket")) if bucket.removeprefix("bucket").isdigit() else -1
        if not 0 <= index < len(compressors):
            return False
        by_bucket[index][name] = t
    if not all(c.fits(s) for c, s in zip(compressors, by_bucket, strict=True)):
        return False
    for c, s in zip(compressors, by_bucket, strict=True):
        c.restore(s)
    return True


def _exact(flat: Tensor, group: dist.ProcessGroup, divisor: int) -> Reduction:
    """The bucket all-reduced uncompressed (PowerSGD's warm-up steps)."""
    work = dist.all_reduce(flat, group=group, async_op=True)

    def finish() -> list[int]:
        work.wait()
        flat.div_(divisor)
        return []

    return Reduction([flat.numel() * flat.element_size()], finish)


def _split(flat: Tensor, shapes: list[tuple[int, int]]) -> list[Tensor]:
    """Views of consecutive pieces of `flat`, one per shape."""
    pieces = flat.split([rows * cols for rows, cols in shapes])
    return [piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True)]


def _orthonormalize_(matrix: Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt on `matrix`'s columns, in place: (n, r) with r <= n. `eps` keeps a zero
    column (a gradient that was all zeros) zero instead of NaN."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i]
        col.div_(col.norm() + eps)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(torch.outer(col, col @ rest))
