"""A consolidated, single-file state dict that the unpartitioned model loads.

    meshplan run examples/llama_tp.plan --steps 100 --export runs/llama_tp/model.safetensors

Every rank takes part: shards are all-gathered over each axis that cuts them (fused
projections block by block), ZeRO-3 parameters are gathered by the caller
(`Zero.gathered_by_unit()`: one layer at a time), and rank 0 writes the file. `.safetensors` needs the safetensors
package; any other suffix is written with `torch.save` (load it with
`torch.load(path, weights_only=True)`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from .axes import Axes


def consolidate(module: nn.Module, axes: Axes, names: set[str] | None = None) -> dict[str, Tensor]:
    """Full tensors for the parameters and buffers of `module` named in `names` (all if None),
    on every rank. `names` is the unpartitioned model's `state_dict()` keys,
    which leaves out buffers it does not persist (e.g. RoPE tables)."""
    out: dict[str, Tensor] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        if names is not None and name not in names:
            continue
        out[name] = axes.unshard(name, tensor.detach()).cpu().clone()
    return out


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
