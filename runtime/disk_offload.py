"""ZeRO-Infinity's offload to disk: each rank's fp32 masters and optimizer moments
(`offload = optimizer:disk`, `DiskState`) and its ZeRO-3 parameter shards (`params:disk`,
`ParamFiles`) live in files between uses; the host holds at most two flats' state and about
two units' shards.

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

While flat i steps, flat i-1 is written and freed, then flat i+1 read: the I/O thread does one
at a time, and a read gives its tensors storage only when it starts, after the write queued
before it freed its own, so at most two flats are in memory (`peak_resident`, the bench's
measure; a step right after a checkpoint starts with all).
A step ends when every write is done, so a write that fails (a full disk) fails the step that
made it, before any later checkpoint, and between steps the state is on disk only. The step
count (AdamW's `step`, a scalar) stays in memory.

A checkpoint reads the state through `own_elements()`'s views, so the checkpoint code needs no
knowledge of disks: for it, every flat's tensors are mapped onto their file (`map_all`: shared
mappings, pages the kernel reads in as the checkpoint's writer reads them and may drop again),
not read into memory, so a checkpoint costs page cache, not a copy of the state a rank cannot
hold. A resume reads into the mappings, which writes the files; the next step (or `put_back`
after a resume) writes each flat from its mapping, which is its file already, and unmaps it.

The parameter shards (`params:disk`, ZeRO-3 only) are a `DiskState` of one tensor per flat,
`Flat.shard` in its dtype, in the same folder:

    OFFLOAD_DIR/rank{r}/params0000.bin  shard                            shard numel x its dtype's bytes

Stage 3 gathers each unit before its forward and again before its backward. A flat asks for
its shard just before its all-gather (`ParamFiles.need`) and lets it go once the all-gather is
done (`gathered`: freed, not written: the file holds it). Each need also reads ahead, on the
I/O thread, the flats that followed it in the last step (one unit's worth): the engine
all-gathers unit i+1 while unit i computes, so unit i+2's shards are read meanwhile, in
forward order and then in backward order, as the last step went (the first step's guess is
the units in order, then the refetched ones in reverse; an evaluation's gathers in between
only find their place again). About two units' shards are in memory at once (`gathers_peak`,
any other read is freed). The step writes every shard from its master: with the optimizer's
state on disk each shard is read and written back with its flat's state in `DiskState.walk`
(`alongside`, on the optimizer's I/O thread); otherwise the step walks the shards' own files
the same way (`ParamFiles.walk`, `ShardedOptimizer.walker`: one flat stepped at a time, the next
read meanwhile), so a step holds about two flats' shards either way. A shard that is its flat's fp32 master (the optimizer's state in memory, on the
shard's device) is in its file too: the step reads it back, and a checkpoint
(`Zero.own_elements`, `masters_in_memory`) reads such masters into memory until the next
gather or step. A checkpoint never reads the other shards (it saves the masters); a resume
reads every shard, copies the masters into them and writes them back (`all_in_memory`).

Files are preallocated (`os.posix_fallocate`) so an in-place write needs no new blocks: a disk
that fills up later fails a write only on filesystems that copy on write. The launcher checks
the folder and its free space before any process starts (`cli/launcher.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .zero_flats import Flat, Unit


class OffloadError(OSError):
    """The offload folder cannot be written or read: one line naming it (the run ends with exit 2;
    the last checkpoint is whole, as saves are atomic)."""


def state_bytes(numel: int, num_state: int) -> int:
    """The bytes one flat's file holds: the fp32 master and `num_state` fp32 moments of `numel`."""
    return numel * 4 * (1 + num_state)


class DiskState:
    """The tensors of each flat (`tensors[i]`: the optimizer's fp32 master first, then the
    moments, all 1-D of one length; or a parameter shard alone) kept in files under `folder`
    (`{name}{i:04d}.bin`), fetched and written back by one I/O thread (`io`: another state's, so
    that the disk sees one stream). `what` names them in errors ("the optimizer's")."""

    def __init__(
        self,
        folder: Path,
        tensors: Sequence[Sequence[Tensor]],
        *,
        name: str = "flat",
        what: str = "the optimizer's",
        io: ThreadPoolExecutor | None = None,
    ) -> None:
        self.folder, self.name, self.what = folder, name, what
        self.tensors = [list(ts) for ts in tensors]
        self._numel = [ts[0].numel() for ts in self.tensors]  # every tensor of a flat has its length
        self._pending: dict[int, Future[None]] = {}  # flat -> its read or write in flight
        self._resident = [True] * len(self.tensors)  # the tensors start in memory, then go to disk
        self.peak_resident = 0  # the most flats in memory at once during the last step
        # walked with these flats: another state whose item i is read and written with flat i
        self.alongside: Alongside | None = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for i, ts in enumerate(self.tensors):
                with open(self._path(i), "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, sum(t.nbytes for t in ts))
        except OSError as e:
            raise OffloadError(
                f"cannot create {what} offload files in {folder}: {e.strerror or e} "
                "(hint: pass --offload-dir with a writable folder)"
            ) from None
        self.io = io or ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshplan-offload")
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
        n, also = len(self.tensors), self.alongside
        self.peak_resident = 0
        if n:
            self._fetch(0)
            if also is not None:
                also.fetch(0)
        for i in range(n):
            self._wait(i)
            if also is not None:
                also.wait(i)
            if i + 1 < n:
                self._fetch(i + 1)
                if also is not None:
                    also.fetch(i + 1)
            self.peak_resident = max(self.peak_resident, self.held())  # i - 1 may not be freed yet
            yield i
            self._write(i)
            if also is not None:
                also.write(i)
        self._drain()
        if also is not None:
            also.drain()

    def map_all(self) -> None:
        """Every flat's tensors views of a shared mapping of its file (a checkpoint reads or writes
        them in place, and the kernel pages them in and out), until the next `walk`. A flat
        already in memory stays as it is."""
        self._drain()
        with torch.no_grad():
            for i, ts in enumerate(self.tensors):
                if self._resident[i]:
                    continue
                nbytes = sum(self._numel[i] * t.element_size() for t in ts)
                mapped = torch.UntypedStorage.from_file(str(self._path(i)), shared=True, nbytes=nbytes)
                assert isinstance(mapped, torch.UntypedStorage)
                offset = 0
                for t in ts:
                    t.set_(mapped, offset // t.element_size(), (self._numel[i],), (1,))
                    offset += self._numel[i] * t.element_size()
                self._resident[i] = True

    def fetch_all(self) -> None:
        """Every flat in memory (a checkpoint reads or writes them in place), until the next `walk`."""
        for i in range(len(self.tensors)):
            self._fetch(i)
        self._drain()

    def held(self) -> int:
        """How many flats' tensors have their storage now (read, being read or being written)."""
        return sum(ts[0].numel() > 0 for ts in self.tensors)

    def _path(self, i: int) -> Path:
        return self.folder / f"{self.name}{i:04d}.bin"

    def _fetch(self, i: int) -> None:
        if not self._resident[i]:
            self._resident[i] = True
            self._pending[i] = self.io.submit(self._read_now, i)

    def _write(self, i: int) -> None:
        self._resident[i] = False
        self._pending[i] = self.io.submit(self._write_now, i)

    def _drop(self, i: int) -> None:
        """Free flat i's tensors without writing them: its file holds what they hold (they were
        read and not changed since)."""
        self._wait(i)
        if self._resident[i]:
            self._resident[i] = False
            with torch.no_grad():
                for t in self.tensors[i]:
                    t.set_(torch.empty(0, dtype=t.dtype).untyped_storage())

    def _wait(self, i: int) -> None:
        done = self._pending.pop(i, None)
        if done is None:
            return
        try:
            done.result()
        except OSError as e:
            raise OffloadError(
                f"{self.what} offload file {self._path(i)} failed mid-run: {e.strerror or e} "
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


class Alongside(Protocol):
    """What `DiskState.walk` reads with its flat i and writes back after it (by the optimizer's
    flat index): the parameter shards of the same flats (`ParamFiles`)."""

    def fetch(self, i: int) -> None: ...
    def wait(self, i: int) -> None: ...
    def write(self, i: int) -> None: ...
    def drain(self) -> None: ...


class ParamFiles:
    """`offload = params:disk`: this rank's ZeRO-3 parameter shards (`Flat.shard`) in files
    `params{k:04d}.bin` under `folder`, in memory only around their all-gathers and the step.

    `flats` are the engine's, `masters` the optimizer's for each (a master may be its shard:
    fp32 parameters where the optimizer runs, its state not on disk; the step and a checkpoint
    then find it in memory, `stepping` and `masters_in_memory`). `optimizer_files`: the
    optimizer's `DiskState` when its state is on disk too; its walk then reads and writes each
    shard with its flat's state, on its I/O thread. Each flat calls `need` before its
    all-gather and `gathered` after; `units` give the first step's guess of the order (each unit
    forward, then the refetched ones backward).
    """

    def __init__(
        self,
        folder: Path,
        units: Sequence[Unit],
        flats: Sequence[Flat],
        masters: Sequence[Tensor],
        optimizer_files: DiskState | None = None,
    ) -> None:
        self.flats = list(flats)
        self._index = {id(f): k for k, f in enumerate(self.flats)}
        self._masters = [k for k, (f, m) in enumerate(zip(flats, masters, strict=True)) if m is f.shard]
        self.state = DiskState(
            folder,
            [[f.shard] for f in self.flats],
            name="params",
            what="the parameters'",
            io=optimizer_files.io if optimizer_files is not None else None,
        )
        self.linked = optimizer_files is not None
        if optimizer_files is not None:
            optimizer_files.alongside = self
        for f in self.flats:
            f.files = self
        order = [f for u in units for f in u.flats] + [
            f for u in reversed(units) if u.refetch for f in u.flats
        ]
        self._trace = [self._index[id(f)] for f in order]  # the flats the last step needed, in order
        self._now: list[int] = []  # this step's
        self._pos = 0  # where this step is in the last one's
        # read ahead: one unit's flats (the next unit's are gathered while this one computes)
        self.ahead = max((len(u.flats) for u in units), default=1)
        self._window: list[int] = []
        self._gathering: set[int] = set()  # needed, their all-gather not yet waited for
        self.peak_resident = 0  # the last step's most shards in memory at once (flats)
        self.peak_bytes = 0  # ... and their bytes
        self.gathers_peak = 0  # the most in memory at once in its forwards and backwards (flats)
        self.gathers_peak_bytes = 0  # ... and their bytes
        self._peak = (0, 0, 0, 0)

    # ------------------------------------------------------------ a flat's all-gather

    def need(self, f: Flat) -> None:
        """Flat `f`'s shard in memory, for its all-gather; the flats that followed it in the
        last step are read meanwhile, and any other shard still in memory is freed."""
        k = self._index[id(f)]
        self._now.append(k)
        self._gathering.add(k)
        self._window = self._next(k)
        self.state._fetch(k)  # first: the I/O thread reads in order
        for j in self._window:
            self.state._fetch(j)
        self.state._wait(k)
        keep = {k, *self._window, *self._gathering}
        for j, resident in enumerate(self.state._resident):
            if resident and j not in keep:
                self.state._drop(j)
        self._track(gathers=True)

    def gathered(self, f: Flat) -> None:
        """Flat `f`'s all-gather is done: its shard leaves memory (its file holds it), unless
        the next gathers need it again."""
        k = self._index[id(f)]
        self._gathering.discard(k)
        if k not in self._window:
            self.state._drop(k)

    def _next(self, k: int) -> list[int]:
        """The flats the last step needed after `k`, one unit's worth (`ahead`): this step
        follows it, and finds its place again after a gather it did not have (an evaluation)."""
        t = self._trace
        if not (self._pos < len(t) and t[self._pos] == k):
            at = [j for j in range(self._pos, len(t)) if t[j] == k] or [j for j in range(len(t)) if t[j] == k]
            if not at:
                return []
            self._pos = at[0]
        self._pos += 1
        return [j for j in t[self._pos : self._pos + self.ahead] if j != k]

    def _track(self, *, gathers: bool = False) -> None:
        """Count the shards in memory now: those with a storage (read, or being written; a read
        in flight has its storage only once the I/O thread starts it, after the writes queued
        before it have freed theirs)."""
        state = self.state
        held = [k for k, (t,) in enumerate(state.tensors) if t.numel() > 0]
        now = sum(state._numel[k] * state.tensors[k][0].element_size() for k in held)
        flats, nbytes, in_gathers, gathers_bytes = self._peak
        self._peak = (
            max(flats, len(held)),
            max(nbytes, now),
            max(in_gathers, len(held)) if gathers else in_gathers,
            max(gathers_bytes, now) if gathers else gathers_bytes,
        )

    # ------------------------------------------------------------ the step and checkpoints

    def walk(self) -> Iterator[int]:
        """The step's walk when the optimizer's state is in memory (`ShardedOptimizer.walker`):
        each flat's shard read (the next one meanwhile), stepped, written back and freed."""
        for i in self.state.walk():
            self._track()
            yield i

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around the optimizer's step, which writes every shard from its master, flat by flat:
        with the optimizer's state on disk each shard is read and written back with its flat's
        state (`DiskState.walk`), else on its own (`walk`). Then this step's order of gathers is
        the next one's guess."""
        self._settle()
        yield
        self._trace, self._now, self._pos = self._now or self._trace, [], 0
        self.peak_resident, self.peak_bytes, self.gathers_peak, self.gathers_peak_bytes = self._peak
        self._peak = (0, 0, 0, 0)

    @contextlib.contextmanager
    def all_in_memory(self) -> Iterator[None]:
        """Every shard in memory inside the block (a checkpoint's values copied into them), then
        written back to its file and freed. A shard already in memory is kept as it is: it may
        be a master a checkpoint was just read into (`masters_in_memory`)."""
        self.state._drain()
        self.state.fetch_all()
        yield
        self.state.put_back()
        self._gathering.clear()
        self._window = []

    def masters_in_memory(self) -> None:
        """The shards that are the optimizer's masters read into memory, where a checkpoint
        reads or writes them (`Zero.own_elements`), until a gather or the step frees them."""
        for k in self._masters:
            self.state._fetch(k)
        self.state._drain()

    def _settle(self) -> None:
        """No read in flight, no shard in memory: between gathers, every file is current."""
        self.state._drain()
        for j, resident in enumerate(self.state._resident):
            if resident:
                self.state._drop(j)
        self._gathering.clear()
        self._window = []

    # ------------------------------------------------------------ `DiskState.walk`'s companion

    def fetch(self, i: int) -> None:
        self.state._fetch(i)

    def wait(self, i: int) -> None:
        self.state._wait(i)
        self._track()

    def write(self, i: int) -> None:
        self.state._write(i)

    def drain(self) -> None:
        self.state._drain()


def shards_in_memory(
    files: ParamFiles | None, *, step: bool = False
) -> contextlib.AbstractContextManager[None]:
    """`files.stepping()` (`step`) or `files.all_in_memory()`; nothing without files."""
    if files is None:
        return contextlib.nullcontext()
    return files.stepping() if step else files.all_in_memory()


def _bytes_of(t: Tensor) -> memoryview:
    """`t`'s memory as bytes, for a file read or write, without a numpy array (which would keep
    the storage alive as long as the view)."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def rank_folder(root: Path, rank: int) -> Path:
    """This rank's folder under the run's offload folder (`RUN_DIR/offload` or `--offload-dir`)."""
    return root / f"rank{rank}"
