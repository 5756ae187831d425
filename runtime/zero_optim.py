"""ZeRO's optimizer state: a real `torch.optim.AdamW` over this rank's fp32 shards of the flats,
and that state as whole tensors by parameter name for checkpoints.

The master copy is the shard itself when the shard is fp32 and on the optimizer's device;
otherwise (bf16/fp16 parameters, or the state offloaded to the CPU) an fp32 copy that each
step writes back into the shard. LR schedulers work on `ShardedAdamW.optimizer` unchanged.

Checkpoints do not see flats: `full_state()` gives each parameter's whole value and moments
by name, what a plain AdamW would hold, so any stage, bucket size or dp size (or no ZeRO)
resumes it (`runtime/checkpoint.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .zero_flats import Flat, all_gather_single

_OPTIMIZER_KEYS = ("master", "exp_avg", "exp_avg_sq")


class ShardedAdamW:
    """AdamW over the fp32 masters of `flats` (this rank's shards); decayed and undecayed flats
    (`decays` by id of a flat's first param: a flat holds only one class) in two param groups."""

    def __init__(
        self,
        flats: Sequence[Flat],
        group: dist.ProcessGroup,
        decays: dict[int, bool],
        *,
        device: torch.device,
        offload: bool,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float,
    ) -> None:
        self.flats, self.group = flats, group
        self.device = device  # the params' device, where `full_state`'s gathers run
        self.opt_device = torch.device("cpu") if offload else device
        self.masters = [self._master_for(f) for f in flats]
        param_groups: list[dict[str, Any]] = [
            {"params": [m for f, m in zip(flats, self.masters, strict=True) if decays[id(f.params[0])]]},
            {
                "params": [
                    m for f, m in zip(flats, self.masters, strict=True) if not decays[id(f.params[0])]
                ],
                "weight_decay": 0.0,
            },
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in param_groups if g["params"]],
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            eps=eps,
            foreach=False,
        )
        for m in self.masters:  # eager state: memory() and full_state() are right before step 1
            self.optimizer.state[m] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
            }

    def _master_for(self, f: Flat) -> Tensor:
        """The fp32 tensor AdamW updates: the shard itself when it is fp32 and already in place."""
        if f.dtype == torch.float32 and f.shard.device == self.opt_device:
            return f.shard
        return f.shard.detach().to(self.opt_device, torch.float32, copy=True)

    def step(self) -> None:
        """One AdamW step on each master from its flat's reduced gradient shard (zero if none),
        written back into the shard when the master is a copy."""
        for f, master in zip(self.flats, self.masters, strict=True):
            grad = f.own_grad()
            master.grad = (
                torch.zeros_like(master) if grad is None else grad.to(self.opt_device, torch.float32)
            )
        self.optimizer.step()
        for f, master in zip(self.flats, self.masters, strict=True):
            master.grad = None
            if master is not f.shard:
                with torch.no_grad():
                    f.shard.copy_(master)  # fp32 master -> bf16 shard, or CPU -> device

    def full_state(self) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
        """Every parameter's fp32 value and AdamW state, whole, keyed by name (`Zero.full_state`).
        Every rank of the group calls it: one all-gather per flat and tensor."""
        values: dict[str, Tensor] = {}
        moments: dict[str, dict[str, Tensor]] = {}
        for f, master in zip(self.flats, self.masters, strict=True):
            state = self.optimizer.state[master]
            whole = {
                key: self._gather_flat(f, t)
                for key, t in zip(
                    _OPTIMIZER_KEYS, (master, state["exp_avg"], state["exp_avg_sq"]), strict=True
                )
            }
            for name, p, off, n in zip(f.names, f.params, f.offsets, f.numels, strict=True):
                values[name] = whole["master"][off : off + n].view(p.shape).clone()
                moments[name] = {"step": state["step"].clone()} | {
                    key: whole[key][off : off + n].view(p.shape).clone() for key in _OPTIMIZER_KEYS[1:]
                }
        return values, moments

    def load_full_state(self, values: dict[str, Tensor], moments: dict[str, dict[str, Tensor]]) -> None:
        """The inverse of `full_state`: keep this rank's elements of each whole tensor, in the
        masters and the shards (the caller refreshes gathered copies)."""
        with torch.no_grad():
            for f, master in zip(self.flats, self.masters, strict=True):
                state = self.optimizer.state[master]
                state["step"] = torch.as_tensor(moments[f.names[0]]["step"]).float().clone()
                for name, mine, theirs in f.own_slices():
                    master[mine].copy_(values[name].reshape(-1)[theirs])
                    for key in _OPTIMIZER_KEYS[1:]:
                        state[key][mine].copy_(moments[name][key].reshape(-1)[theirs])
                if master is not f.shard:
                    f.shard.copy_(master)

    def _gather_flat(self, f: Flat, shard: Tensor) -> Tensor:
        """(padded,) every rank's (S,) piece of one flat-shaped fp32 tensor, on the optimizer's device."""
        out = torch.empty(f.padded, dtype=shard.dtype, device=self.device)
        all_gather_single(out, shard.detach().to(self.device), group=self.group)
        return out.to(self.opt_device)
