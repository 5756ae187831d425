"""A consolidated, single-file state dict that the unpartitioned model loads.

    meshplan run examples/llama_tp.plan --steps 100 --export runs/llama_tp/model.safetensors

Every rank takes part: tensor-parallel shards are all-gathered over the tensor axis
(fused projections block by block), ZeRO-3 parameters are gathered by the caller
(`Zero.gathered()`), and rank 0 writes the file. `.safetensors` needs the safetensors
package; any other suffix is written with `torch.save` (load it with
`torch.load(path, weights_only=True)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .collectives import all_gather


class Cut(NamedTuple):
    """How a parameter is cut over the tensor axis: along `dim`, each rank holding its chunk of
    every block (`()` is one block). `size` is the dim's global size when it does not divide by
    the axis (a vocabulary of 511 over 2 ranks): chunks are ceil(size / n) long, the last ones
    zero-padded; 0 when it divides."""

    dim: int
    blocks: tuple[int, ...] = ()
    size: int = 0


Sharding = dict[str, Cut]  # parameter name -> its cut over the tensor axis


def consolidate(
    module: nn.Module, sharding: Sharding, tp: dist.ProcessGroup | None, names: set[str] | None = None
) -> dict[str, Tensor]:
    """Full tensors for the parameters and buffers of `module` named in `names` (all if None),
    on every rank of the tp group. `names` is the unpartitioned model's `state_dict()` keys,
    which leaves out buffers it does not persist (e.g. RoPE tables)."""
    out: dict[str, Tensor] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        if names is not None and name not in names:
            continue
        local = tensor.detach()
        if name in sharding and tp is not None:
            local = unshard(local, sharding[name], tp)
        out[name] = local.cpu().clone()
    return out


def unshard(local: Tensor, cut: Cut, tp: dist.ProcessGroup) -> Tensor:
    """All-gather along the cut's dim; a blocked shard [q_r, k_r, v_r] is gathered block by block,
    a padded one loses its padding."""
    n = dist.get_world_size(tp)
    if not cut.blocks:
        whole = all_gather(local, cut.dim, tp)
        return whole.narrow(cut.dim, 0, cut.size) if cut.size else whole
    pieces = local.split([b // n for b in cut.blocks], cut.dim)  # this rank's chunk of each block
    return torch.cat([all_gather(piece.contiguous(), cut.dim, tp) for piece in pieces], cut.dim)


def shard_of(full: Tensor, cut: Cut, rank: int, n: int) -> Tensor:
    """This rank's piece of a full tensor cut over `n` ranks (its chunk of each block)."""
    if cut.size:  # chunks of ceil(size / n), the last ones zero-padded
        chunk = -(-cut.size // n)
        start = min(rank * chunk, cut.size)
        mine = full.narrow(cut.dim, start, min(chunk, cut.size - start))
        pad = [0, 0] * (full.dim() - 1 - cut.dim) + [0, chunk - mine.shape[cut.dim]]
        return torch.nn.functional.pad(mine, pad)
    pieces = full.split(list(cut.blocks), cut.dim) if cut.blocks else (full,)
    return torch.cat([piece.chunk(n, cut.dim)[rank] for piece in pieces], cut.dim)


def full_shape(local: Tensor, cut: Cut, n: int) -> tuple[int, ...]:
    shape = list(local.shape)
    shape[cut.dim] = cut.size or shape[cut.dim] * n
    return tuple(shape)


def write_state_dict(state: dict[str, Tensor], path: Path) -> None:
    """Write atomically: a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        # safetensors stores each storage once: tied weights are saved under their first name
        seen: dict[int, str] = {}
        unique = {}
        for name, tensor in state.items():
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen[key] = name
                unique[name] = tensor.contiguous()
        save_file(unique, str(tmp))
    else:
        torch.save(state, tmp)
    tmp.replace(path)
