"""ZeRO-Infinity's offload to disk (`offload = optimizer:disk`): each rank's fp32 masters and
optimizer moments live in files between steps, and the host holds at most three flats' of them.

The unit of I/O is one ZeRO flat's shard on this rank: its fp32 master and each moment
(`OptimizerChoice.state_keys`: AdamW's exp_avg and exp_avg_sq), one after the other in one file
per flat, preallocated when the engine is built:

    OFFLOAD_DIR/rank{r}/flat0000.bin    master | exp_avg | exp_avg_sq    3 x shard numel x 4 bytes
    OFFLOAD_DIR/rank{r}/flat0001.bin    ...

The tensors the optimizer steps stay the same Python objects for the whole run (its param
groups and an LR scheduler keep working); between steps each is set to an empty storage
(`Tensor.set_`), and a fetch gives it a new one and reads the file into it. Not FSDP's
`untyped_storage().resize_(0)`: a checkpoint's writer takes `numpy()` views, which mark a
storage as not resizable for good. `own_elements()`'s views are taken afresh by each checkpoint.

A step walks the flats in order on one I/O thread, so reads and writes never race for a file
and the disk sees one stream:

    I/O thread:  read 0 | read 1 | write 0, read 2 | write 1, read 3 | ...
    step:               | step 0 | step 1          | step 2          | ...

While flat i steps, flat i+1 is read and flat i-1 written and freed: at most three flats are in
memory (`peak_resident`, the bench's measure; a step right after a checkpoint starts with all).
A step ends when every write is done, so a write that fails (a full disk) fails the step that
made it, before any later checkpoint, and between steps the state is on disk only. The step
count (AdamW's `step`, a scalar) stays in memory.

A checkpoint reads the state through `own_elements()`'s views, so saving or resuming fetches
every flat: the checkpoint code needs no knowledge of disks, at the cost of the whole state in
host memory while it runs. A resume writes it back at once (`put_back`); after a save the next
step does, flat by flat.

Files are preallocated (`os.posix_fallocate`) so an in-place write needs no new blocks: a disk
that fills up later fails a write only on filesystems that copy on write. The launcher checks
the folder and its free space before any process starts (`cli/launcher.py`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor


class OffloadError(OSError):
    """The offload folder cannot be written or read: one line naming it (the run ends with exit 2;
    the last checkpoint is whole, as saves are atomic)."""


def state_bytes(numel: int, num_state: int) -> int:
    """The bytes one flat's file holds: the fp32 master and `num_state` fp32 moments of `numel`."""
    return numel * 4 * (1 + num_state)


class DiskState:
    """The fp32 tensors of each flat (`tensors[i]`: master first, then the moments, all 1-D of
    one length) kept in files under `folder`, fetched and written back by one I/O thread."""

    def __init__(self, folder: Path, tensors: Sequence[Sequence[Tensor]]) -> None:
        self.folder = folder
        self.tensors = [list(ts) for ts in tensors]
        self._numel = [ts[0].numel() for ts in self.tensors]  # every tensor of a flat has its length
        self._pending: dict[int, Future[None]] = {}  # flat -> its read or write in flight
        self._resident = [True] * len(self.tensors)  # the tensors start in memory, then go to disk
        self.peak_resident = 0  # the most flats in memory at once during the last step
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for i, ts in enumerate(self.tensors):
                with open(self._path(i), "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, state_bytes(ts[0].numel(), len(ts) - 1))
        except OSError as e:
            raise OffloadError(
                f"cannot create the optimizer's offload files in {folder}: {e.strerror or e} "
                "(hint: pass --offload-dir with a writable folder)"
            ) from None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshplan-offload")
        self.put_back()

    def put_back(self) -> None:
        """Every flat in memory written to its file and freed (after a checkpoint was read into them)."""
        for i, resident in enumerate(self._resident):
            if resident:
                self._write(i)
        self._drain()

    def walk(self) -> Iterator[int]:
        """Each flat's index, in order, once its tensors are in memory; the next one is read
        meanwhile, and each is written back and freed when the loop comes back for the next.
        Returns once every write is on disk."""
        n = len(self.tensors)
        self.peak_resident = 0
        if n:
            self._fetch(0)
        for i in range(n):
            self._wait(i)
            if i + 1 < n:
                self._fetch(i + 1)
            held = sum(ts[0].numel() > 0 for ts in self.tensors)  # i - 1 may not be freed yet
            self.peak_resident = max(self.peak_resident, held)
            yield i
            self._write(i)
        self._drain()

    def fetch_all(self) -> None:
        """Every flat in memory (a checkpoint reads or writes them in place), until the next `walk`."""
        for i in range(len(self.tensors)):
            self._fetch(i)
        self._drain()

    def _path(self, i: int) -> Path:
        return self.folder / f"flat{i:04d}.bin"

    def _fetch(self, i: int) -> None:
        if not self._resident[i]:
            self._resident[i] = True
            self._pending[i] = self._io.submit(self._read_now, i)

    def _write(self, i: int) -> None:
        self._resident[i] = False
        self._pending[i] = self._io.submit(self._write_now, i)

    def _wait(self, i: int) -> None:
        done = self._pending.pop(i, None)
        if done is None:
            return
        try:
            done.result()
        except OSError as e:
            raise OffloadError(
                f"the optimizer's offload file {self._path(i)} failed mid-run: {e.strerror or e} "
                "(hint: the last checkpoint is whole: free space there, then continue with --resume)"
            ) from None

    def _drain(self) -> None:
        for i in list(self._pending):
            self._wait(i)

    def _read_now(self, i: int) -> None:
        """(I/O thread) Give flat i's tensors a storage again and fill it from its file."""
        numel = self._numel[i]
        with open(self._path(i), "rb") as f, torch.no_grad():
            for t in self.tensors[i]:
                t.set_(torch.empty(numel, dtype=t.dtype).untyped_storage())  # 1-D, numel long
                if f.readinto(_bytes_of(t)) != t.nbytes:
                    raise OSError(f"{self._path(i)} is shorter than the state it holds")

    def _write_now(self, i: int) -> None:
        """(I/O thread) Write flat i's tensors to its file, then free their storage."""
        with open(self._path(i), "r+b") as f:
            for t in self.tensors[i]:
                f.write(_bytes_of(t))
        with torch.no_grad():
            for t in self.tensors[i]:
                t.set_(torch.empty(0, dtype=t.dtype).untyped_storage())  # the old storage is freed


def _bytes_of(t: Tensor) -> memoryview:
    """`t`'s memory as bytes, for a file read or write, without a numpy array (which would keep
    the storage alive as long as the view)."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def rank_folder(root: Path, rank: int) -> Path:
    """This rank's folder under the run's offload folder (`RUN_DIR/offload` or `--offload-dir`)."""
    return root / f"rank{rank}"
