"""Pretrained weights in (`meshplan run --init PATH`): each rank reads only the bytes of its own
pieces.

    weights = Pretrained.open("llama-1b/")              # a Hugging Face folder, or one file
    weights.check(model)                                 # every key and shape, before any rank starts
    piece = weights.piece("lm_head.weight", placement, coords, layout, torch.float32)

PATH is a Hugging Face folder (`model.safetensors`, or shards listed by
`model.safetensors.index.json`), a `.safetensors` file, or a `.pt`/`.bin` file of a state dict;
each file is a `Source` (its tensors' shapes, and each tensor sliceable without reading it whole).
A meshplan checkpoint is a `Source` too (`runtime.checkpoint.SavedModel`), which the command
line opens (`Pretrained.of`): the compiler does not read the training engine's files.
Names are matched as the model's `state_dict()` spells them; a weight the model ties under
several names (an embedding and the LM head) is read once, under whichever name the file holds.
A missing key, a key the model does not have, and a shape that differs are errors naming the key
and the file (`InitError`), found from the files' headers before anything is read.

A rank reads its piece as boxes of the whole tensor: along each dim, the runs of indices its
placement keeps (`piece_indices`: one run for a plain split, one per block for a blocked q/k/v,
padding where a vocabulary does not divide), each copied out of a memory map of the file
(`SafetensorsFile` reads the header itself and slices with numpy: the safetensors library's slice
of a column split reads whole rows). So a rank reads its own shard bytes, not whole tensors
(`bytes_read` counts them). A `.pt` file is memory-mapped too (`torch.load(mmap=True)`): only the
pages a piece touches are read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from meshplan.runtime.mesh import MeshLayout
from meshplan.runtime.shards import Cut, shard_of

from .errors import CompileError
from .placement import Placement, Shard

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class InitError(CompileError):
    """Weights for `--init` that do not fit the model, or cannot be read: one line, located."""


class Source(Protocol):
    """A file (or folder) of named tensors: their shapes, and each as an array whose `[slices]`
    copies just that box into a torch tensor."""

    path: Path

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def array(self, key: str) -> Any: ...


class Pretrained:
    """The tensors of a weights folder or file, by name: shapes from the headers, pieces read on
    demand."""

    def __init__(self, path: Path, sources: dict[str, Source], shapes: dict[str, tuple[int, ...]]) -> None:
        self.path, self._sources, self.shapes = path, sources, shapes
        self.bytes_read = 0

    @classmethod
    def of(cls, path: Path, source: Source) -> Pretrained:
        """Every tensor of one `source`."""
        shapes = source.shapes()
        return cls(path, dict.fromkeys(shapes, source), shapes)

    @classmethod
    def open(cls, path: str | Path) -> Pretrained:
        path = Path(path)
        if not path.exists():
            raise InitError(f"--init {path}: no such file or folder")
        if path.is_dir():
            if (path / INDEX).is_file():
                try:
                    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
                except (ValueError, KeyError) as e:
                    raise InitError(f"--init {path / INDEX}: not a safetensors index ({e})") from None
                files = {key: path / name for key, name in weight_map.items()}
            elif (path / SINGLE).is_file():
                return cls.of(path, SafetensorsFile(path / SINGLE))
            else:
                raise InitError(
                    f"--init {path}: holds neither {SINGLE} nor {INDEX}, nor a meshplan checkpoint"
                )
        elif path.suffix == ".safetensors":
            return cls.of(path, SafetensorsFile(path))
        elif path.suffix in (".pt", ".bin", ".pth"):
            return cls.of(path, TorchFile(path))
        else:
            raise InitError(f"--init {path}: not a .safetensors, .pt or .bin file, nor a Hugging Face folder")
        opened = {file: SafetensorsFile(file) for file in dict.fromkeys(files.values())}
        shapes: dict[str, tuple[int, ...]] = {}
        for source in opened.values():
            shapes |= source.shapes()
        for key, file in files.items():
            if key not in shapes:
                raise InitError(
                    f"--init {path}: the index names `{key}` in {file.name}, which does not hold it"
                )
        return cls(path, {key: opened[file] for key, file in files.items()}, shapes)

    def check(self, model: nn.Module) -> None:
        """Every tensor of the model's state dict in the files with its shape, and nothing else;
        a tied weight under any one of its names."""
        expected = {name: tuple(t.shape) for name, t in state_tensors(model)}
        for names in names_by_tensor(state_tensors(model)).values():
            held = [n for n in names if n in self.shapes]
            if not held:
                raise InitError(
                    f"--init {self.path}: `{names[0]}` is missing (the model has it, the weights do not)"
                )
            for name in held:
                if self.shapes[name] != expected[name]:
                    raise InitError(
                        f"--init {self.path}: `{name}` is {_shape(self.shapes[name])} in {self._sources[name].path.name}, "
                        f"the model's is {_shape(expected[name])}"
                    )
        # a buffer the model does not persist (RoPE's frequencies) is its own to compute: a
        # meshplan checkpoint holds it, and it is not read
        computed = {name for name, _ in model.named_buffers(remove_duplicate=False)}
        unexpected = sorted(set(self.shapes) - set(expected) - computed)
        if unexpected:
            more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
            raise InitError(
                f"--init {self.path}: `{unexpected[0]}`{more} is not in the model "
                "(hint: the weights were saved from another model, or under other names)"
            )

    def key(self, names: list[str]) -> str | None:
        """The name under which the files hold a tensor the model names `names`."""
        return next((n for n in names if n in self.shapes), None)

    def piece(
        self, key: str, placement: dict[str, Placement], coords: dict[str, int], layout: MeshLayout, dtype
    ) -> Tensor:
        """This rank's piece of tensor `key`, read box by box, in `dtype`."""
        runs = [_runs(ix) for ix in piece_indices(self.shapes[key], placement, coords, layout)]
        tensor = self._sources[key].array(key)

        def read(box: tuple[Run, ...]) -> Tensor:
            if any(start < 0 for start, _ in box):  # padding
                return torch.zeros([n if start < 0 else n - start for start, n in box], dtype=dtype)
            part = tensor[tuple(slice(a, b) for a, b in box)]
            self.bytes_read += part.numel() * part.element_size()
            return part.to(dtype)

        return _assemble(read, runs)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def load_whole(model: nn.Module, weights: Pretrained) -> None:
    """Check `weights` against `model` and copy every tensor in whole (`verify`'s references,
    which hold the unpartitioned model)."""
    weights.check(model)
    state = dict(state_tensors(model))
    layout = MeshLayout((), ())
    with torch.no_grad():
        for names in names_by_tensor(state.items()).values():
            key = weights.key(names)
            assert key is not None, names  # check() found every tensor
            t = state[names[0]]
            t.copy_(weights.piece(key, {}, {}, layout, t.dtype))


class SafetensorsFile:
    """A `.safetensors` file read through a memory map: its header (8 bytes of length, then
    JSON: each tensor's dtype, shape and byte range) and each tensor as a numpy array over the
    map, so a slice copies only the bytes it covers (a column split of a weight reads a segment
    of each row, not the rows whole)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > path.stat().st_size - 8:
                    raise ValueError("its header is longer than the file")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as e:
            raise InitError(f"--init {path}: not a safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self._start = 8 + length
        self.tensors = header

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(entry["shape"]) for key, entry in self.tensors.items()}

    def array(self, key: str) -> _Sliced:
        entry = self.tensors[key]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise InitError(f"--init {self.path}: `{key}` is {entry['dtype']}, which meshplan does not read")
        begin, end = entry["data_offsets"]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._start + begin, shape=(end - begin,))
        return _Sliced(raw, tuple(entry["shape"]), dtype)


class TorchFile:
    """A `.pt`/`.bin` state dict, memory-mapped (`torch.load(mmap=True)`): a box of a tensor
    touches only its pages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state = _torch_state(path)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(t.shape) for key, t in self.state.items()}

    def array(self, key: str) -> _Copied:
        return _Copied(self.state[key])


class _Copied:
    """A tensor of a memory-mapped `.pt` file: `[slices]` copies just that box."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def __getitem__(self, box: tuple[slice, ...]) -> Tensor:
        return self.tensor[box].clone(memory_format=torch.contiguous_format)


class _Sliced:
    """A tensor in a file's memory map: `[slices]` copies just that box into a torch tensor."""

    def __init__(self, raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.array = raw.view(f"<u{itemsize}" if dtype is not torch.bool else np.bool_).reshape(shape)
        self.dtype = dtype

    def __getitem__(self, box: tuple[slice, ...]) -> Tensor:
        part = torch.from_numpy(np.array(self.array[box], order="C", copy=True))  # off the map
        return part if self.dtype is torch.bool else part.view(self.dtype)


Run = tuple[int, int]  # (start, stop) along a dim of the whole tensor; (-1, n): n entries of padding


def piece_indices(
    shape: tuple[int, ...], placement: dict[str, Placement], coords: dict[str, int], layout: MeshLayout
) -> list[Tensor]:
    """For each dim, the indices along it of the whole tensor's entries this rank's piece holds
    (-1: padding): `lower.local_shard` applied to each dim's index range."""
    indices = [torch.arange(1, n + 1) for n in shape]  # from 1: padding shows as 0
    for axis, p in placement.items():
        if isinstance(p, Shard):
            indices[p.dim] = shard_of(
                indices[p.dim], Cut(0, p.blocks, p.padded), coords[axis], layout.size(axis)
            )
    return [ix - 1 for ix in indices]


def _runs(indices: Tensor) -> list[Run]:
    """`indices` as runs of consecutive indices, and of padding."""
    out: list[Run] = []
    for i in indices.tolist():
        if i < 0 and out and out[-1][0] < 0:
            out[-1] = (-1, out[-1][1] + 1)
        elif i < 0:
            out.append((-1, 1))
        elif out and out[-1][0] >= 0 and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _assemble(
    read: Callable[[tuple[Run, ...]], Tensor], runs: list[list[Run]], box: tuple[Run, ...] = ()
) -> Tensor:
    """The piece: the boxes of every combination of runs, concatenated dim by dim."""
    d = len(box)
    if d == len(runs):
        return read(box)
    parts = [_assemble(read, runs, (*box, run)) for run in runs[d]]
    return torch.cat(parts, dim=d) if len(parts) > 1 else parts[0]


def names_by_tensor(named: Iterable[tuple[str, Tensor]]) -> dict[int, list[str]]:
    """Each tensor's names (several for a tied weight), by the tensor's identity."""
    names: dict[int, list[str]] = {}
    for name, t in named:
        names.setdefault(id(t), []).append(name)
    return names


def state_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The tensors of the model's state dict (parameters, persistent buffers), each tied name."""
    persistent = set(model.state_dict(keep_vars=True))
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return ((name, t) for name, t in named if name in persistent)


def _torch_state(file: Path) -> dict[str, Tensor]:
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise InitError(f"--init {file}: cannot be read as a state dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise InitError(f"--init {file}: holds no state dict of tensors")
    return state


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
