"""Data parallelism over one mesh axis: bucketed gradient all-reduce that overlaps backward.

    torchrun --nproc-per-node 2 -m meshplan.run examples/tiny_dp.plan      # or: meshplan run ...

    dp = DataParallel(program, mesh.get_group("dp"), bucket_bytes=plan.data_parallel.bucket_bytes)
    optimizer = dp.optimizer(config)        # AdamW over program's parameters (`grad_sync.make_optimizer`)
    for micro in range(k):
        with dp.no_sync() if micro < k - 1 else contextlib.nullcontext():
            loss = dp(*inputs)[0] / k
            loss.backward()                 # buckets are all-reduced as their grads become ready
    dp.finish()                             # wait for the last buckets; grads are now averaged
    optimizer.step()

How it works (the design of PyTorch's DDP, written out so the collectives are visible):

- Parameters are packed into buckets of about `bucket_bytes`, in reverse registration
  order, which approximates the order backward produces their gradients.
- Each parameter gets a `register_post_accumulate_grad_hook`. When the last gradient of
  a bucket has been accumulated, the bucket is flattened and all-reduced with
  `async_op=True`, so communication runs while backward computes earlier layers.
- Buckets are launched strictly in bucket order (a ready bucket waits for the ones
  before it): every rank then issues the same collectives in the same order, which a
  process group requires.
- `finish()` launches whatever backward did not (a parameter that got no gradient on
  this step contributes zeros), waits, divides by the group size and writes the average
  back into `.grad`. A parameter that got no gradient at all keeps `.grad` None, as on one
  device (AdamW then leaves it alone: no weight decay). Every rank runs the same program,
  so a gradient no backward of this rank reached is one no rank's reached (a parameter used
  only through `argmax`, say); an expert that got no tokens still gets a (zero) gradient.
- Gradients live in the buckets (DDP's `gradient_as_bucket_view`): each bucket is one
  buffer, and a parameter's `.grad` becomes a view of its slice once backward has made it
  (later micro-steps accumulate into it in place). The all-reduce runs on the buffer and
  the average is written in place: no copy in, none out, and no second copy of the
  gradients alive. Under a reduce dtype other than the gradients' (`reduce = bf16` on fp32
  gradients) the bucket is converted into a flat of that dtype and back, as before.
- Under `compression` (`compress = powersgd(...)` or `bf16`), a bucket's flat goes to its
  `compression.BucketCompressor` instead of one all-reduce: the parts it can send while backward
  runs are launched then, the rest when `finish()` waits for the bucket, in bucket order on
  every rank. `launches` then lists each all-reduce it issued, in its compressed bytes.

Rank arithmetic: the group is the mesh's dp axis. With `mesh dp=2, tp=2` (last axis
fastest) ranks 0 and 2 hold tp shard 0 and form dp group {0, 2}; ranks 1 and 3 form
{1, 3}. Each averages the gradient of the same shard, so DP composes with the
compiler's tensor parallelism by construction.

A rank waiting for a bucket tells `runtime/watchdog.py` (bucket, bytes, axis): if a
peer is stuck, the report names the bucket it never contributed.

Every bucket's all-reduce is recorded in `launches` as (bucket index, bytes,
during_backward), and `ledger()` lists (bytes, count per optimizer step) per bucket,
for reporting next to the compiler's collective ledger.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import watchdog
from .buckets import compressed_wire, dp_buckets
from .compression import BucketCompressor, Compression, Reduction, compressor, restore_state, saved_state
from .grad_sync import Accumulates, WholeParams, held_weakly, param_grad_squares, scale_param_grads_
from .hollow import is_deferred


@dataclass
class Bucket:
    """Parameters reduced together in one flat all-reduce."""

    index: int
    params: list[Tensor]
    nbytes: int  # bytes on the wire (in the reduce dtype)
    ready: int = 0  # parameters whose gradient is accumulated this step
    work: dist.Work | Reduction | None = None  # a Reduction under compression
    compressor: BucketCompressor | None = None
    flat: Tensor | None = None  # (sum of numels,) the buffer being reduced
    # the gradients themselves, each param's `.grad` a view of its slice (None: another reduce dtype)
    buffer: Tensor | None = None
    views: list[Tensor] = field(default_factory=list)
    missing: list[Tensor] = field(default_factory=list)  # params no backward gave a gradient this step


@dataclass(frozen=True)
class Launch:
    bucket: int
    nbytes: int
    during_backward: bool  # launched from a backward hook (overlapping compute), not from finish()


class DataParallel(nn.Module, WholeParams, Accumulates):
    """Wraps a module so its gradients are averaged over `group` (see the module docstring);
    its optimizer is `WholeParams`' AdamW over `module`."""

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup,
        *,
        bucket_bytes: int = 25_000_000,
        reduce_dtype: torch.dtype | None = None,
        axis: str = "dp",
        params: Sequence[nn.Parameter] | None = None,
        late: Collection[nn.Parameter] = (),
        divisor: int | None = None,
        compression: Compression | None = None,
    ) -> None:
        """`divisor`: what the summed gradient is divided by (default: the group's size; the
        data ranks alone where the group also spans an axis the gradient is partial over, whose
        sum is the gradient: `runtime/expert_data_parallel.averaged_over`).
        `params`: the trainable parameters this engine averages (default: all of `module`'s);
        expert parallelism averages its experts over fewer ranks than the rest. `late`: those
        whose gradient is whole only when `finish()` runs (a weight several stages of a pipeline
        rank read: each stage's last backward is synchronized, neither is the weight's last);
        they go in the last buckets, which `finish()` launches. `compression`: the buckets'
        all-reduce made lossy (the module docstring; gradients reduced in their own dtype)."""
        nn.Module.__init__(self)
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.module = module
        self.group = group
        self.axis = axis  # the mesh axis of `group`, for the watchdog's report
        self.world = dist.get_world_size(group)
        self.divisor = divisor or self.world
        self.reduce_dtype = reduce_dtype
        self.compression = compression
        self.launches: list[Launch] = []
        self._sync = True
        self._next = 0  # the next bucket to launch, in bucket order
        self._in_finish = False
        params = list(params) if params is not None else _unique_trainable(module)
        self._late = {id(p) for p in late}
        params = [p for p in params if id(p) in self._late] + [p for p in params if id(p) not in self._late]
        self.params = params
        broadcast_parameters(params, group)
        if compression is not None and reduce_dtype is not None:
            raise ValueError("DataParallel: a compressed bucket is reduced in the gradients' dtype")
        self.buckets = _make_buckets(params, bucket_bytes, reduce_dtype)
        if compression is not None:
            for bucket in self.buckets:
                numel = sum(p.numel() for p in bucket.params)
                bucket.compressor = compressor(compression, bucket.params, bucket.index, numel)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._view_of = {
            id(p): v
            for b in self.buckets
            if b.buffer is not None
            for p, v in zip(b.params, b.views, strict=True)
        }
        self._hooks = [p.register_post_accumulate_grad_hook(held_weakly(self._on_grad)) for p in params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def ledger(self) -> list[tuple[int, int]]:
        """(bytes, all-reduces per optimizer step) for each bucket, in launch order; a compressed
        bucket's parts each (`buckets.compressed_wire`: after PowerSGD's warm-up)."""
        if self.compression is None:
            return [(b.nbytes, 1) for b in self.buckets]
        method, rank = self.compression.method, self.compression.rank
        return [(nbytes, 1) for b in self.buckets for _, nbytes in compressed_wire(b.params, method, rank)]

    def finish(self) -> None:
        """Launch the buckets backward left, wait for all, and write the averaged gradients back."""
        self._in_finish = True
        try:
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
        finally:
            self._in_finish = False
        for bucket in self.buckets:
            assert bucket.work is not None and bucket.flat is not None
            where = f"bucket {bucket.index + 1} of {len(self.buckets)}, {watchdog.size_text(bucket.nbytes)}"
            watchdog.note("all_reduce", self.axis, where, self.group)
            if isinstance(bucket.work, Reduction):  # averaged by its compressor, which may send more
                for nbytes in bucket.work.wait():
                    self.launches.append(Launch(bucket.index, nbytes, during_backward=False))
            else:
                bucket.work.wait()
                bucket.flat.div_(self.divisor)
            if bucket.buffer is None:
                _unflatten_into_grads(bucket.flat, bucket.params)
            for p in bucket.missing:  # the zeros it contributed are no gradient: as on one device
                p.grad = None
            bucket.work, bucket.flat, bucket.ready, bucket.missing = None, None, 0, []
        self._next = 0

    def grad_squares(self, kinds: Sequence[Collection[str]]) -> Tensor:
        """After `finish()` every replica holds the same averaged gradient: local sums."""
        mine = {id(p) for p in self.params}
        return param_grad_squares(((n, p) for n, p in self.module.named_parameters() if id(p) in mine), kinds)

    def scale_grads_(self, factor: Tensor | float) -> None:
        scale_param_grads_(self.params, factor)

    def own_local(self) -> dict[str, Tensor]:
        """`compress`'s state of every bucket (`compression.saved_state`), for checkpoints."""
        return saved_state(self.compressors())

    def restore_local(self, saved: dict[str, Tensor]) -> bool:
        return restore_state(self.compressors(), saved)

    def compressors(self) -> list[BucketCompressor]:
        """Each compressed bucket's compressor, in bucket order."""
        return [b.compressor for b in self.buckets if b.compressor is not None]

    def grad_buffers(self) -> list[Tensor]:
        """The buckets' buffers, which hold the gradients (`.grad` views them) and outlive
        `zero_grad`; under `compress`, what error feedback keeps beside them (`compression.py`:
        bf16's residual, PowerSGD's errors and Q), counted with the gradients."""
        kept = [t for b in self.buckets if b.compressor is not None for t in b.compressor.state()]
        return [*(b.buffer for b in self.buckets if b.buffer is not None), *kept]

    def _on_grad(self, param: Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.work is not None and id(param) not in self._late:
            # its bucket is being reduced (in place): this gradient would change it mid-flight
            raise RuntimeError(
                f"DataParallel over {self.axis}: a gradient of a parameter of bucket {bucket.index + 1} "
                "arrived after the bucket was launched this step (a second synchronized backward "
                "reaching it): pass it as `late`, or run the earlier backwards under no_sync()"
            )
        if bucket.buffer is not None:
            _into_view(param, self._view_of[id(param)])
        if not self._sync or id(param) in self._late:
            return
        bucket.ready += 1
        # launch every consecutive ready bucket: same order on every rank
        while self._next < len(self.buckets):
            head = self.buckets[self._next]
            if head.ready < len(head.params):
                break
            self._launch(head)

    def _launch(self, bucket: Bucket) -> None:
        bucket.missing = [p for p in bucket.params if p.grad is None]
        if bucket.buffer is not None:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is None:  # no gradient this step: it contributes zeros
                    view.zero_()
                    p.grad = view
                else:
                    _into_view(p, view)  # a late param's, made while its hook was quiet
            bucket.flat = bucket.buffer
        else:
            bucket.flat = _flatten_grads(bucket.params, self.reduce_dtype)
        during_backward = not self._in_finish
        if bucket.compressor is not None:
            reduction = bucket.compressor.launch(bucket.flat, self.group, self.divisor)
            self.launches += [Launch(bucket.index, nbytes, during_backward) for nbytes in reduction.launched]
            bucket.work = reduction
        else:
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
            self.launches.append(Launch(bucket.index, bucket.nbytes, during_backward))
        self._next += 1


def broadcast_parameters(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Give every rank of `group` the values of its first rank (one broadcast per parameter, at wrap time).
    A hollow parameter is skipped: its value is made the same on every rank (`hollow.py`)."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in params:
            if is_deferred(p):
                continue
            dist.broadcast(p.data, src=src, group=group)


def _unique_trainable(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, tied ones once, in registration order."""
    return [p for p in module.parameters() if p.requires_grad]


def _make_buckets(
    params: Sequence[Tensor], bucket_bytes: int, reduce_dtype: torch.dtype | None
) -> list[Bucket]:
    buckets = []
    for i, (ps, nbytes) in enumerate(dp_buckets(params, bucket_bytes, reduce_dtype)):
        bucket = Bucket(i, ps, nbytes)
        dtype, device = ps[0].dtype, ps[0].device
        if reduce_dtype in (None, dtype) and all(p.dtype == dtype and p.device == device for p in ps):
            bucket.buffer = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device)
            pieces = bucket.buffer.split([p.numel() for p in ps])
            bucket.views = [piece.view_as(p) for piece, p in zip(pieces, ps, strict=True)]
        buckets.append(bucket)
    return buckets


def _into_view(param: Tensor, view: Tensor) -> None:
    """Make `param.grad` the bucket's view of it (a copy once per step; autograd then adds the
    next micro-steps' gradients into it in place)."""
    grad = param.grad
    if grad is not None and grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
        param.grad = view


def _flatten_grads(params: list[Tensor], dtype: torch.dtype | None) -> Tensor:
    """One flat buffer of the bucket's gradients, zeros where a parameter got none: (sum numel,)."""
    parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
    flat = torch.cat(parts)
    return flat.to(dtype) if dtype is not None and dtype != flat.dtype else flat


def _unflatten_into_grads(flat: Tensor, params: list[Tensor]) -> None:
    offset = 0
    for p in params:
        chunk = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += p.numel()
