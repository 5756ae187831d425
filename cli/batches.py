"""The batches `verify` and `run` train on when the data is not a text file of tokens: random
batches of the kinds a model's example inputs have, and a `--data` factory's batches of any kind
checked against the program's inputs.

    batches = token_batches(job, dp_rank=0, dp_size=2, accumulation=1)   # (ids, labels) per (step, micro)
    batches = drawn_batches(example, rows=8, seed=0, dp_rank=0, dp_size=2, accumulation=1)
    example_batch, _ = batches(step, micro)                              # a CallBatch: the call's inputs

A model whose inputs are token ids trains on token ids (uniform over its vocabulary). Any other
model (a vision model's `model(pixels, labels)`) trains on its `example_inputs()` drawn afresh
for each micro-batch: floats normal, integers (class labels, ids) in the range the example
used, bool masks as given; dim 0 of every batched input is the micro-batch. A batch is a pure
function of (seed, step, data rank, micro-step), as `runtime/data.py`'s are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from meshplan.compiler.load import batch_rows, describe_inputs, draw_like, is_batched, named_inputs
from meshplan.runtime.data import BatchFn, CallBatch, CallFn, DataError

if TYPE_CHECKING:
    from meshplan.compiler.load import ModelSource


class Drawn(Protocol):
    """What drawing needs of a job (`verify.Job`): its shapes, seed and vocabulary."""

    batch: int
    seq: int
    seed: int
    vocab: int
    microbatches: int
    example: CallBatch | None


def example_batch(source: ModelSource) -> CallBatch | None:
    """The model's call as a `CallBatch` to draw batches like, or None for a model that takes
    token ids (it trains on (input_ids, labels))."""
    from meshplan.compiler.capture import token_tensors

    if token_tensors(source.args, source.kwargs):
        return None
    rows = batch_rows(source.args, source.kwargs)
    return CallBatch(source.args, source.kwargs, rows or 1)


def _generator(seed: int, step: int, dp_rank: int, dp_size: int, accumulation: int, micro: int):
    index = (step * dp_size + dp_rank) * accumulation + micro
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def token_batches(job: Drawn, *, dp_rank: int, dp_size: int, accumulation: int) -> BatchFn:
    """`(step, micro) -> (input_ids, labels)` for one data-parallel rank: uniformly random ids,
    the same in every process that asks for the same (step, dp rank, micro-step). A model that
    takes other inputs gets `(CallBatch, None)`, drawn like its example (`drawn_batches`)."""
    if job.example is not None:
        return drawn_batches(
            job.example,
            rows=job.batch * job.microbatches,
            seed=job.seed,
            dp_rank=dp_rank,
            dp_size=dp_size,
            accumulation=accumulation,
        )

    def get(step: int, micro: int):
        g = _generator(job.seed, step, dp_rank, dp_size, accumulation, micro)
        tokens = torch.randint(0, job.vocab, (job.batch * job.microbatches, job.seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as a data loader hands them

    return get


def drawn_batches(
    example: CallBatch, *, rows: int, seed: int, dp_rank: int, dp_size: int, accumulation: int
) -> BatchFn:
    """`(step, micro) -> (CallBatch, None)`: `example`'s inputs drawn afresh (`draw_like`) with
    `rows` on dim 0 of each batched one; inputs that are not batched are the example's."""

    def get(step: int, micro: int) -> tuple[CallBatch, None]:
        g = _generator(seed, step, dp_rank, dp_size, accumulation, micro)

        def draw(x: Any) -> Any:
            return draw_like(x, rows, g) if is_batched(x, example.rows) else x

        args = tuple(draw(a) for a in example.args)
        kwargs = {k: draw(v) for k, v in example.kwargs.items()}
        return CallBatch(args, kwargs, rows), None

    return get


def whole_job_batches(job: Drawn, *, dp_size: int, accumulation: int) -> BatchFn:
    """Every rank's micro-batches of a step, for one process: micro-step i is dp rank
    i // accumulation's micro-step i % accumulation, or under a pipeline one of its
    microbatches (the pipeline's micro-step is `job.microbatches` of them, each loss / m)."""
    ranks = [
        token_batches(job, dp_rank=r, dp_size=dp_size, accumulation=accumulation) for r in range(dp_size)
    ]
    m = job.microbatches

    def get(step: int, micro: int):
        rank, rest = divmod(micro, accumulation * m)
        j, chunk = divmod(rest, m)
        first, second = ranks[rank](step, j)
        if isinstance(first, CallBatch):
            return first.chunk(m)[chunk], None
        return first.chunk(m)[chunk], second.chunk(m)[chunk]

    return get


def checked_call(source: ModelSource, rows: int, spec: str) -> CallFn:
    """A `--data` factory's batch -> the call's inputs (`CallBatch`), checked against the inputs
    the program was captured with (the example at this run's shapes): every tensor input given,
    with the same dtype and shape, `rows` on dim 0 of a batched one. A mismatch is a `DataError`
    naming the factory, the batch and the input."""
    example_rows = batch_rows(source.args, source.kwargs)
    expected = {
        name: x for name, x in named_inputs(source.model, source.args, source.kwargs).items() if _tensor(x)
    }
    # arguments that are not tensors (`use_cache=False`) stay the example's
    constants = {k: v for k, v in source.kwargs.items() if not _tensor(v)}
    takes = describe_inputs(source.model, source.args, source.kwargs)
    where = f" ({source.inputs_from})" if source.inputs_from else ""

    def check(out: object, step: int, micro: int) -> CallBatch:
        batch = f"--data {spec}: the batch of step {step}, micro-step {micro}"
        args: tuple[Any, ...]
        if _tensor(out):
            args, kwargs = (out,), dict(constants)
        elif isinstance(out, tuple | list):
            args, kwargs = tuple(out), dict(constants)
        elif isinstance(out, dict) and all(isinstance(k, str) for k in out):
            args, kwargs = (), constants | out
        else:
            raise DataError(
                f"{batch} is a {type(out).__name__} (hint: return the model's inputs as "
                f"example_inputs(){where} gives them: a tuple of positional arguments or a dict of "
                "keyword arguments)"
            )
        given = named_inputs(source.model, args, kwargs)
        for name, want in expected.items():
            shape = (rows, *want.shape[1:]) if is_batched(want, example_rows) else tuple(want.shape)
            wanted = f"{name} {shape} {_dtype(want)}"
            got = given.get(name)
            if not _tensor(got):
                what = "has no input" if got is None else f"has a {type(got).__name__} for input"
                raise DataError(f"{batch} {what} `{name}`; the program takes {wanted} (hint: {_HINT})")
            if tuple(got.shape) != shape or got.dtype != want.dtype:
                raise DataError(
                    f"{batch}: input `{name}` is {tuple(got.shape)} {_dtype(got)}; the program takes "
                    f"{wanted} (hint: {_HINT})"
                )
        extra = [name for name, x in given.items() if _tensor(x) and name not in expected]
        if extra:
            raise DataError(
                f"{batch} has input `{extra[0]}`, which the program does not take (it takes {takes}; "
                f"hint: return the inputs example_inputs(){where} gives)"
            )
        return CallBatch(args, kwargs, rows)

    return check


_HINT = "dim 0 of each batched input is --batch (times the pipeline's microbatches), the rest as example_inputs() gives it"


def _tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor)


def _dtype(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def run_batches(
    source: ModelSource,
    data: str | None,
    *,
    batch: int,
    seq: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    accumulation: int,
    vocab_size: int | None = None,
    corpus: str,
) -> BatchFn:
    """A run's batches of `--data` (`batch` rows a micro-step): a text file or a factory for a
    model that takes token ids, a factory of its inputs for one that does not, or without
    `--data` the shipped corpus, or for a model that takes no token ids its example's inputs
    drawn afresh (`drawn_batches`)."""
    from meshplan.runtime.data import make_batches

    example = example_batch(source)
    if example is not None and data is None:
        return drawn_batches(
            example, rows=batch, seed=seed, dp_rank=dp_rank, dp_size=dp_size, accumulation=accumulation
        )
    if example is not None and not _factory(data):
        raise DataError(
            f"--data {data}: a text file gives token ids, and {source.spec!r} takes "
            f"{describe_inputs(source.model, source.args, source.kwargs)} (hint: pass --data "
            "FILE.py:factory returning the model's inputs, or leave out --data to train on random ones)"
        )
    return make_batches(
        data or corpus,
        batch=batch,
        seq=seq,
        seed=seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        accumulation=accumulation,
        vocab_size=vocab_size,
        call=checked_call(source, batch, data or corpus),
        tokens=example is None,
    )


def _factory(data: str | None) -> bool:
    path, colon, _ = (data or "").rpartition(":")
    return bool(colon) and path.endswith(".py")


def drawn_note(source: ModelSource, rows: int) -> str:
    """What a run without `--data` trains a model that takes no token ids on, in one line."""
    return (
        f"note: no --data: {source.spec} takes {describe_inputs(source.model, source.args, source.kwargs)}; "
        f"training on random batches of {rows} drawn like its example inputs (floats normal, integers "
        "in the example's range); pass --data FILE.py:factory to train on your data"
    )
