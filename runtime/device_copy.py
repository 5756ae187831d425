"""The device copies a compiled program makes where a module placed on another device
(`lm_head: on cpu`, `layers.7: on cuda:1`) meets the rest of the rank's program: one module
the graph calls on each activation that crosses, whose forward is `x.to(target)` and whose
backward (autograd's) copies the gradient back.

    to_host = self.to_host(norm_1)                   # (B, T, H) to the host: lm_head runs there
    linear = torch.ops.aten.linear.default(to_host, lm_head_weight)
    to_device = self.to_device(linear)               # the logits back to the rank's device

The graph names targets without a device index where it can: `"cpu"` (the host), `"device"`
(whatever device the rank runs on) and `"cuda:N"` (a device of this process, absolute). So a
compiled program (`program.pt`) serves every rank: `compiler.lower.place` binds `"device"` to
the rank's own (`bind`); unbound, it is the identity, as is every copy whose input is already
where it goes (a CPU run: every copy is a no-op, and still in the program and its ledger).
Tensors on the meta device (the estimate's walk) stay where they are.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

HOST, DEVICE = "cpu", "device"  # the targets a copy names besides `cuda:N`


class DeviceCopy(nn.Module):
    """`x.to(target)`: an activation crossing into (or out of) a module placed elsewhere."""

    kind: ClassVar[str] = "device_copy"  # its rows' kind in the compiler's ledger

    def __init__(self, to: str) -> None:
        super().__init__()
        if to not in (HOST, DEVICE) and not to.startswith("cuda:"):
            raise ValueError(f"a device copy goes to {HOST!r}, {DEVICE!r} or 'cuda:N', not {to!r}")
        self.to_device = to
        self.bound: torch.device | None = None  # the rank's device, for `"device"` (`bind`)

    def bind(self, device: torch.device) -> None:
        """Make `"device"` mean `device`, the device the rank's program is placed on."""
        self.bound = device

    def target(self) -> torch.device | None:
        """Where the copy goes; None: nowhere (`"device"` on a program never placed)."""
        if self.to_device == DEVICE:
            return self.bound
        return torch.device(self.to_device)

    def forward(self, x: Tensor) -> Tensor:
        target = self.target()
        if target is None or x.is_meta or x.device == target:
            return x
        return x.to(target)

    def extra_repr(self) -> str:
        return f"to={self.to_device!r}"
