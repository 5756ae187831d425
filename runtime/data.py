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

A user's own data is a Python factory, `--data path/to/file.py:make_batches`:

    def make_batches(*, batch, seq, seed, dp_rank, dp_size, accumulation):
        def get(step: int, micro_step: int) -> tuple[Tensor, Tensor]:
            ...                                  # (batch, seq) input ids and labels
        return get

Only the file named is run (as a private module); nothing next to it is imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

VOCAB_SIZE = 256

BatchFn = Callable[[int, int], tuple[Tensor, Tensor]]  # (step, micro_step) -> (input_ids, labels)


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
    def from_file(cls, path: str | Path, **kwargs: int) -> TextBatches:
        source = cls(read_bytes(path), **kwargs)
        if source.tokens.numel() < source.seq + 2:
            raise DataError(
                f"data file {str(path)!r} has {source.tokens.numel()} bytes, fewer than --seq {source.seq} + 2 "
                "(hint: use a longer text or a smaller --seq)"
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
    spec: str, *, batch: int, seq: int, seed: int, dp_rank: int, dp_size: int, accumulation: int
) -> BatchFn:
    """`spec` is a text file or `file.py:factory` (see the module docstring)."""
    kwargs = dict(
        batch=batch, seq=seq, seed=seed, dp_rank=dp_rank, dp_size=dp_size, accumulation=accumulation
    )
    path, colon, factory = spec.rpartition(":")
    if colon and path.endswith(".py"):
        return _checked(_load_factory(path, factory)(**kwargs), spec, batch, seq)
    return TextBatches.from_file(spec, **kwargs)


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
    except Exception as exc:
        raise DataError(
            f"running {path!r} raised {type(exc).__name__}: {exc} (hint: run `python {path}`)"
        ) from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise DataError(f"{path!r} defines no function {name!r} (hint: def {name}(*, batch, seq, seed, ...))")
    return factory


def _checked(fn: object, spec: str, batch: int, seq: int) -> BatchFn:
    """Wrap a user's batch function so a wrong shape or dtype is one clear error, at the first batch."""
    if not callable(fn):
        raise DataError(
            f"{spec} returned {type(fn).__name__}, not a function (step, micro_step) -> (ids, labels)"
        )

    def get(step: int, micro_step: int = 0) -> tuple[Tensor, Tensor]:
        out = fn(step, micro_step)
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
            raise DataError(f"{spec}: a batch must be a tuple (input_ids, labels) of tensors")
        ids, labels = out
        if tuple(ids.shape) != (batch, seq) or tuple(labels.shape) != (batch, seq):
            raise DataError(
                f"{spec}: batch shapes {tuple(ids.shape)}, {tuple(labels.shape)}; the program was compiled "
                f"for ({batch}, {seq}) (hint: pass matching --batch/--seq)"
            )
        return ids.long(), labels.long()

    return get
