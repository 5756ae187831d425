"""Faults injected for the tests of the failure paths: `MESHPLAN_FAULT="rank=R,step=S"` makes rank R
exit at step S as if killed; with `,hang` it stays alive and never joins its peers' collectives."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from meshplan.errors import RunError


def restart_attempt() -> int:
    """How many times torchrun has restarted the workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@dataclass(frozen=True)
class Fault:
    """A fault injected into one rank when it starts step `step` (0-based: 3 is the fourth step)."""

    step: int
    hang: bool = False  # stay alive but silent (a stuck rank), instead of exiting as if killed

    def strike(self) -> None:
        """Exit with 137 (as SIGKILL would), or never return."""
        if not self.hang:
            os._exit(137)
        while True:  # stuck: the peers time out in their next collective; torchrun ends this process
            time.sleep(60)


def injected_fault(rank: int) -> Fault | None:
    """This rank's fault from MESHPLAN_FAULT="rank=R,step=S" or "rank=R,step=S,hang" (first attempt only).

    A testing hook for the failure paths: rank R exits abruptly at step S, as if killed,
    while its peers are inside the same step's collectives; with `hang` it stays alive and
    never joins them, as if stuck.
    """
    spec = os.environ.get("MESHPLAN_FAULT")
    if not spec or restart_attempt() > 0:
        return None
    fault_rank, fault = parse_fault(spec)
    return fault if fault_rank == rank else None


def parse_fault(spec: str) -> tuple[int, Fault]:
    """`rank=R,step=S[,hang]` -> (R, its fault); anything else is a `RunError` saying the form."""
    parts = spec.split(",")
    fields = dict(part.split("=", 1) for part in parts if "=" in part)
    extra = [p for p in parts if "=" not in p and p != "hang"] + sorted(set(fields) - {"rank", "step"})
    try:
        if extra:
            raise ValueError
        return int(fields["rank"]), Fault(int(fields["step"]), hang="hang" in parts)
    except (KeyError, ValueError):
        raise RunError(
            f"MESHPLAN_FAULT={spec!r} is not `rank=R,step=S` or `rank=R,step=S,hang` (a testing hook)"
        ) from None
