"""The trained weights as the unpartitioned model loads them: one file, or a folder as
Hugging Face writes one.

    meshplan run examples/llama_tp.plan --steps 100 --export runs/llama_tp/model.safetensors
    meshplan run my_llama.plan --steps 100 --export runs/my_llama/hf

Every rank takes part: shards are all-gathered over each axis that cuts them (fused
projections block by block), ZeRO-3 parameters are gathered by the caller
(`Zero.gathered_by_unit()`: one layer at a time), and rank 0 writes. A file (`FileWriter`):
`.safetensors`, or any other suffix written with `torch.save` (load it with
`torch.load(path, weights_only=True)`), each tensor's bytes put on disk as it arrives, so rank 0
holds one tensor, never the model. A folder (`ShardWriter`): safetensors shards of at most
`MAX_SHARD_BYTES` with Hugging Face's index, written while the tensors arrive, so rank 0 holds
one shard at a time.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

from .axes import Axes


def consolidate(module: nn.Module, axes: Axes, names: set[str] | None = None) -> dict[str, Tensor]:
    """Full tensors for the parameters and buffers of `module` named in `names` (all if None),
    on every rank. `names` is the unpartitioned model's `state_dict()` keys,
    which leaves out buffers it does not persist (e.g. RoPE tables)."""
    return dict(consolidate_each(module, axes, names))


def consolidate_each(
    module: nn.Module, axes: Axes, names: set[str] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """`consolidate`, one full tensor at a time: a caller that writes each and lets it go holds
    one, not the module. Every rank iterates to the end (the gathers are collectives)."""
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        if names is not None and name not in names:
            continue
        yield name, axes.unshard(name, tensor.detach()).cpu().clone()


class FileWriter:
    """One weights file, filled one tensor at a time without holding them.

    Each tensor's bytes are appended to `FILE.data.tmp` as it arrives. `finish()` then writes
    the file: a `.safetensors` file is its header (every tensor's dtype, shape and byte range,
    which must come first) and the bytes copied behind it; any other suffix is `torch.save` of
    the tensors read back through a memory map of those bytes (file pages, not the process's
    memory), a tied weight under each of its names (one storage). The file is written as
    `FILE.tmp` and renamed: a run that dies while exporting leaves an earlier export whole.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.staging = path.with_name(path.name + ".data.tmp")
        self.data = self.staging.open("wb")
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}  # at [begin, end)
        self.aliases: dict[str, list[str]] = {}  # a tied weight's other names (a torch file keeps them)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def add(self, name: str, tensor: Tensor, *, also: Iterable[str] = ()) -> None:
        """Append `tensor`'s bytes under `name` (and, in a torch file, under the names `also`)."""
        if name in self:
            raise ValueError(f"{name} is exported twice")
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        begin = self.data.tell()
        self.data.write(raw.data)
        self.entries[name] = (tensor.dtype, tuple(tensor.shape), begin, begin + raw.size)
        self.aliases[name] = [n for n in also if n != name]

    def finish(self) -> int:
        """Write the file; returns the number of tensors it holds."""
        self.data.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            if self.path.suffix == ".safetensors":
                self._write_safetensors(tmp)
            else:
                torch.save(self._mapped(), tmp)
            tmp.replace(self.path)
        finally:
            self.staging.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
        if self.path.suffix == ".safetensors":  # a tied weight once
            return len(self.entries)
        return sum(1 + len(others) for others in self.aliases.values())

    def _write_safetensors(self, tmp: Path) -> None:
        header: dict[str, object] = {
            name: {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
            for name, (dtype, shape, begin, end) in self.entries.items()
        }
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with tmp.open("wb") as out, self.staging.open("rb") as data:
            out.write(struct.pack("<Q", len(text)))
            out.write(text)
            shutil.copyfileobj(data, out, 1 << 24)

    def _mapped(self) -> dict[str, Tensor]:
        """Every tensor as a view of the staged bytes through a memory map, under all its names."""
        state: dict[str, Tensor] = {}
        for name, (dtype, shape, begin, end) in self.entries.items():
            if end == begin:
                tensor = torch.empty(shape, dtype=dtype)
            else:
                raw = np.memmap(self.staging, dtype=np.uint8, mode="c", offset=begin, shape=(end - begin,))
                tensor = torch.from_numpy(raw).view(dtype).view(shape)
            state.update({n: tensor for n in (name, *self.aliases[name])})
        return state


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


# `--export` paths written as one file; any other path that is not an existing file is a folder
FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
# a folder's shards hold at most this many bytes (a larger tensor: a shard of its own), as
# Hugging Face's `max_shard_size="5GB"`; read when a `ShardWriter` starts, so tests can lower it
MAX_SHARD_BYTES = 5_000_000_000
WEIGHTS_NAME = "model.safetensors"  # the one shard of a folder whose weights fit in one
INDEX_NAME = "model.safetensors.index.json"  # which shard holds each tensor, when there are several


def exports_a_folder(path: Path) -> bool:
    """Whether `--export path` writes a folder: an existing folder, or a path that is not an
    existing file and does not end in one of `FILE_SUFFIXES`."""
    return path.is_dir() or (not path.is_file() and path.suffix not in FILE_SUFFIXES)


def written_by_export(folder: Path) -> list[Path]:
    """The files in `folder` a folder export writes (and an overwriting one replaces)."""
    patterns = (WEIGHTS_NAME, INDEX_NAME, "model-*-of-*.safetensors", "config.json", "generation_config.json")
    return sorted({f for pattern in patterns for f in folder.glob(pattern) if f.is_file()})


class SavesPretrained(Protocol):
    """What writes itself into a folder: a Hugging Face `PretrainedConfig`, a `GenerationConfig`."""

    def save_pretrained(self, save_directory: str) -> object: ...


class ShardWriter:
    """A folder of safetensors shards, filled one tensor at a time.

    Tensors are held until the next one would take the shard past `max_bytes`; then the shard
    is written and let go (Hugging Face's rule, so one bigger tensor gets a shard of its own).
    Everything is written to `FOLDER.tmp` first and moved into the folder by `finish()`: a run
    that dies while exporting leaves an earlier export whole.
    """

    def __init__(self, folder: Path, max_bytes: int | None = None) -> None:
        self.folder = folder
        self.max_bytes = MAX_SHARD_BYTES if max_bytes is None else max_bytes
        self.staging = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self.shards: list[list[str]] = []  # the names in each shard written so far
        self.names: set[str] = set()  # every tensor added
        self.pending: dict[str, Tensor] = {}  # the current shard's, not written yet
        self.pending_bytes = 0
        self.total_bytes = 0
        self.total_numel = 0

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def add(self, name: str, tensor: Tensor) -> None:
        """Hold `tensor` (on the CPU, its own storage) for the current shard."""
        if name in self:
            raise ValueError(f"{name} is exported twice")
        self.names.add(name)
        tensor = tensor.detach().cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != nbytes:
            tensor = tensor.clone(memory_format=torch.contiguous_format)  # a view: safetensors wants its own
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._write_shard()
        self.pending[name] = tensor
        self.pending_bytes += nbytes
        self.total_bytes += nbytes
        self.total_numel += tensor.numel()

    def finish(self, metadata: Iterable[SavesPretrained] = ()) -> int:
        """Write the last shard, name the shards as Hugging Face does (`model.safetensors` when
        there is one, else `model-00001-of-0000N.safetensors` and the index), write `metadata`
        (e.g. the model's config) beside them, and replace the folder's earlier export with it.
        Returns the number of tensors written."""
        if self.pending or not self.shards:
            self._write_shard()
        n = len(self.shards)
        names = (
            [WEIGHTS_NAME] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        )
        for i, name in enumerate(names):
            self._staged(i).rename(self.staging / name)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total_bytes, "total_parameters": self.total_numel},
                "weight_map": {
                    key: name for name, shard in zip(names, self.shards, strict=True) for key in sorted(shard)
                },
            }
            (self.staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for item in metadata:
            item.save_pretrained(str(self.staging))
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in written_by_export(self.folder):
            old.unlink()
        for new in self.staging.iterdir():
            new.replace(self.folder / new.name)
        self.staging.rmdir()
        return len(self.names)

    def _write_shard(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self._staged(len(self.shards))), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _staged(self, i: int) -> Path:
        return self.staging / f"shard-{i + 1:05d}.safetensors"
