"""Token batches for training: byte-level text, deterministic by (seed, step, micro-step, dp rank).

    source = TextBatches.from_file("examples/data/corpus.txt", batch=8, seq=64, seed=0,
                                   dp_rank=1, dp_size=2, accumulation=4)
    input_ids, labels = source(step=10, micro_step=3)      # each (8, 64), int64

A batch is a pure function of its position, never of what was read before, so a resumed
run sees exactly the batches an uninterrupted run would have seen, with no reader state
to checkpoint beyond the step number.

Layout independence: the optimizer step `step` draws one global batch of
`batch * accumulation * dp_size` windows from a generator seeded by (seed, step); dp rank
`r` takes rows `[(m * dp_size + r) * batch, ... + batch)` on micro-step `m`. So the same
global batch is trained whether it is split over 2 ranks, 4 micro-steps, or neither,
which is what the parity tests compare (and what resuming on another dp size needs).

Tokens are bytes (vocabulary 256), matching the built-in tiny Llama's `vocab_size`.
Given the model's `vocab_size`, ids it cannot embed are a `DataError` naming the source and
the batch, not an IndexError deep in an embedding: a text file's bytes are checked when it
is read, a factory's batches as they are made (`within_vocab`).

A user's own data is a Python factory, `--data path/to/file.py:make_batches`:

    def make_batches(*, batch, seq, seed, dp_rank, dp_size, accumulation):
        def get(step: int, micro_step: int) -> tuple[Tensor, Tensor]:
            ...                                  # (batch, seq) input ids and labels
        return get

or, for a model whose inputs are not token ids (a vision model's `model(pixels, labels)`), `get`
returns the call's inputs: a tuple of positional arguments or a dict of keyword arguments, each
batched tensor with `batch` rows. Such a batch travels as `(CallBatch, None)` where a token
batch is `(input_ids, labels)`: the loop hands both parts to the loss function as they are.
The caller checks it against the program's inputs (`make_batches(call=...)`).

Only the file named is run (as a private module); nothing next to it is imported. An
exception raised by the file, the factory or `get` is the user's to fix: a `DataError`
naming the source and the line of the file where it was raised.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

VOCAB_SIZE = 256
IGNORE_INDEX = -100  # a label cross-entropy skips (torch's and Hugging Face's default)

_FACTORY_ARGS = "(*, batch, seq, seed, dp_rank, dp_size, accumulation)"  # how a data factory is called

# (step, micro_step) -> (input_ids, labels), or (CallBatch, None) for a model that takes other inputs
BatchFn = Callable[[int, int], tuple[Any, Any]]
# a factory's batch that is not (input_ids, labels) -> the call's inputs, checked (step, micro_step)
CallFn = Callable[[object, int, int], "CallBatch"]


@dataclass(frozen=True)
class CallBatch:
    """One micro-batch of a model's call inputs (images and labels, any kind): positional and
    keyword arguments, `rows` of them (dim 0 of every batched tensor)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    rows: int = 1

    def _map(self, fn: Callable[[Any], Any], rows: int) -> CallBatch:
        return CallBatch(tuple(fn(a) for a in self.args), {k: fn(v) for k, v in self.kwargs.items()}, rows)

    def _batched(self, x: Any) -> bool:
        return isinstance(x, Tensor) and x.dim() >= 1 and x.shape[0] == self.rows

    def chunk(self, n: int) -> list[CallBatch]:
        """`n` micro-batches of `rows / n`, each batched tensor cut on dim 0 (a pipeline's)."""
        size = self.rows // n

        def piece(i: int) -> Callable[[Any], Any]:
            return lambda x: x[i * size : (i + 1) * size] if self._batched(x) else x

        return [self._map(piece(i), size) for i in range(n)]

    def to(self, device: torch.device | str) -> CallBatch:
        return self._map(lambda x: x.to(device) if isinstance(x, Tensor) else x, self.rows)


class DataError(ValueError):
    """A problem with the user's data (missing file, too short, bad factory); one line, with a hint."""


def read_bytes(path: str | Path) -> Tensor:
    """A text file as a 1-D uint8 tensor of its bytes."""
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"data file {str(path)!r} does not exist (hint: pass --data FILE.txt or FILE.py:factory)"
        )
    data = p.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class TextBatches:
    """Random windows of a byte stream: `(input_ids, labels)`, labels shifted left by one byte."""

    tokens: Tensor  # (N,) uint8
    batch: int
    seq: int
    seed: int
    dp_rank: int = 0
    dp_size: int = 1
    accumulation: int = 1

    @classmethod
    def from_file(cls, path: str | Path, *, vocab_size: int | None = None, **kwargs: int) -> TextBatches:
        source = cls(read_bytes(path), **kwargs)
        if source.tokens.numel() < source.seq + 2:
            raise DataError(
                f"data file {str(path)!r} has {source.tokens.numel()} bytes, fewer than --seq {source.seq} + 2 "
                "(hint: use a longer text or a smaller --seq)"
            )
        top = int(source.tokens.max())
        if vocab_size is not None and top >= vocab_size:
            raise DataError(
                f"data file {str(path)!r} is byte-level and has byte values up to {top}, but the model "
                f"embeds only {vocab_size} token ids (0..{vocab_size - 1}) (hint: build the model with "
                f"vocab_size >= {top + 1}, or pass --data FILE.py:factory with ids below {vocab_size})"
            )
        return source

    def global_rows(self) -> int:
        return self.batch * self.accumulation * self.dp_size

    def offsets(self, step: int) -> Tensor:
        """Start offsets of every window of the global batch of `step`: (batch * accumulation * dp,)."""
        generator = torch.Generator().manual_seed(_mix(self.seed, step))
        high = self.tokens.numel() - self.seq - 1
        return torch.randint(0, high + 1, (self.global_rows(),), generator=generator)

    def __call__(self, step: int, micro_step: int = 0) -> tuple[Tensor, Tensor]:
        first = (micro_step * self.dp_size + self.dp_rank) * self.batch
        starts = self.offsets(step)[first : first + self.batch]  # (B,)
        index = starts.unsqueeze(1) + torch.arange(self.seq + 1)  # (B, T+1)
        windows = self.tokens[index].long()  # (B, T+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T), (B, T)


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step): nearby pairs give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def make_batches(
    spec: str,
    *,
    batch: int,
    seq: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    accumulation: int,
    vocab_size: int | None = None,
    call: CallFn | None = None,
    tokens: bool = True,
) -> BatchFn:
    """`spec` is a text file or `file.py:factory` (see the module docstring); with `vocab_size`,
    a token id the model cannot embed is a `DataError`. `call` makes a factory's batch that is
    not `(input_ids, labels)` the call's inputs, checked; for a model without token inputs
    (`tokens` False) every batch is one."""
    kwargs = dict(
        batch=batch, seq=seq, seed=seed, dp_rank=dp_rank, dp_size=dp_size, accumulation=accumulation
    )
    path, colon, factory = spec.rpartition(":")
    if colon and path.endswith(".py"):
        make = _load_factory(path, factory)
        try:
            fn = make(**kwargs)
        except Exception as exc:
            raise DataError(
                f"--data {spec} raised {_describe(exc, path)} (hint: it is called as {factory}{_FACTORY_ARGS})"
            ) from exc
        checked = _checked(fn, spec, batch, seq, path, call, tokens)
        return checked if vocab_size is None else within_vocab(checked, vocab_size, spec)
    return TextBatches.from_file(spec, vocab_size=vocab_size, **kwargs)


def within_vocab(batches: BatchFn, vocab_size: int, spec: str) -> BatchFn:
    """`batches` with every batch checked against the model's vocabulary: input ids in
    [0, vocab_size), labels too or `IGNORE_INDEX`. One reduction per tensor, before the forward
    (on a GPU an out-of-range id is a device-side assert that leaves the process unusable)."""

    def get(step: int, micro_step: int = 0) -> tuple[Any, Any]:
        ids, labels = batches(step, micro_step)
        if isinstance(ids, CallBatch):  # not token ids: the caller checked it against the program
            return ids, labels
        for what, tensor in (("input id", ids), ("label", labels[labels != IGNORE_INDEX])):
            if tensor.numel() == 0:
                continue
            low, high = (int(v) for v in torch.aminmax(tensor))
            if low >= 0 and high < vocab_size:
                continue
            if low < 0:
                bad, fix = low, "token ids start at 0"
            else:
                bad, fix = (
                    high,
                    f"map the ids below {vocab_size}, or build the model with vocab_size >= {high + 1}",
                )
            raise DataError(
                f"--data {spec}: step {step}, micro-step {micro_step} has {what} {bad}, outside the "
                f"model's vocabulary of {vocab_size} token ids (0..{vocab_size - 1}) (hint: {fix})"
            )
        return ids, labels

    return get


def _load_factory(path: str, name: str) -> Callable[..., BatchFn]:
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"data factory file {path!r} does not exist (hint: --data path/to/file.py:make_batches)"
        )
    module_name = "_meshplan_data_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file.resolve())
    if spec is None or spec.loader is None:
        raise DataError(f"cannot load {path!r} as Python (hint: --data path/to/file.py:make_batches)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        raise DataError(
            f"running {path!r} raised {_describe(exc, path)} (hint: run `python {path}`)"
        ) from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise DataError(f"{path!r} defines no function {name!r} (hint: def {name}{_FACTORY_ARGS})")
    return factory


def _checked(
    fn: object, spec: str, batch: int, seq: int, path: str, call: CallFn | None = None, tokens: bool = True
) -> BatchFn:
    """Wrap a user's batch function so a wrong shape or dtype, or an exception it raises, is one
    clear error naming the batch. A batch other than a pair of tensors (or any batch, for a model
    without token inputs) goes to `call`, which makes it the call's inputs."""
    if not callable(fn):
        raise DataError(
            f"{spec} returned {type(fn).__name__}, not a function (step, micro_step) -> (ids, labels)"
        )

    def get(step: int, micro_step: int = 0) -> tuple[Any, Any]:
        try:
            out = fn(step, micro_step)
        except torch.distributed.DistError:
            raise  # a peer lost while the function communicated: the run's failure, not the data's
        except Exception as exc:
            raise DataError(
                f"--data {spec}: the batch of step {step}, micro-step {micro_step} raised "
                f"{_describe(exc, path)} (hint: call the function it returned as get({step}, {micro_step}) "
                "to see the full traceback)"
            ) from exc
        pair = isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)
        if call is not None and not (tokens and pair):
            return call(out, step, micro_step), None
        if not pair:
            raise DataError(f"{spec}: a batch must be a tuple (input_ids, labels) of tensors")
        ids, labels = out
        if tuple(ids.shape) != (batch, seq) or tuple(labels.shape) != (batch, seq):
            raise DataError(
                f"{spec}: batch shapes {tuple(ids.shape)}, {tuple(labels.shape)}; the program was compiled "
                f"for ({batch}, {seq}) (hint: pass matching --batch/--seq)"
            )
        return ids.long(), labels.long()

    return get


def _describe(exc: BaseException, path: str) -> str:
    """`KeyError: 'shard 7' (at data.py:12)`: the exception and the innermost line of the user's
    file that raised it, so no traceback is needed."""
    text = exc.msg if isinstance(exc, SyntaxError) and exc.msg else str(exc)
    lines = text.strip().splitlines()
    what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{what} (at {path}:{exc.lineno})"
    wanted = Path(path).resolve()
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == wanted]
    return f"{what} (at {path}:{frames[-1].lineno})" if frames else what
