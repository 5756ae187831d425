"""The optimizers a plan can choose, built over any parameters: whole ones (`grad_sync.WholeParams`)
or ZeRO's fp32 shards (`zero_optim.ShardedOptimizer`).

    optimizer = build(OptimizerChoice("sgd", {"momentum": 0.9}), groups, lr=3e-3)

    kind        class                      state per parameter (fp32)          elementwise
    adamw       torch.optim.AdamW          exp_avg, exp_avg_sq, step           yes
    sgd         torch.optim.SGD            momentum_buffer (none at 0)         yes
    lion        `Lion` (here)              exp_avg                             yes
    adafactor   torch.optim.Adafactor, or  row_var + col_var (2-D), or         no
                `adafactor.SplitAdafactor` variance (1-D); step
                over pieces

The names and hyperparameters are `meshplan.grammar.OPTIMIZERS` (the plan checker reads the same
table); the learning rate comes from the loop each step and the weight decay from the run, per
param group (`buckets.decays`: none on 1-D parameters). AdamW's and SGD's weight decay are
torch's (decoupled for AdamW, added to the gradient for SGD); Lion's and Adafactor's decoupled.

An elementwise optimizer steps each element from that element's gradient and state alone, so
ZeRO runs it unchanged on a shard that is any element range of a flat: its state is then the
shard's elements of each tensor in `STATE`, saved by parameter name, and a checkpoint resumes on
any layout. Adafactor's state is per row and column of a whole matrix, and its step reads the
whole parameter's RMS: where a rank holds pieces of parameters (a split rule, ZeRO), `build`
takes the pieces (`adafactor.Piece`) and steps `SplitAdafactor`, which sums those over the
ranks holding the other pieces; its row and column moments are whole on every rank, a vector's
second moment (`variance`) is cut as the vector is.

Lion is not in torch.optim: `Lion` is Chen et al. 2023's Algorithm 2, decoupled weight decay.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from meshplan.grammar import OPTIMIZERS

from .adafactor import Piece, SplitAdafactor

# the per-element state tensors each kind keeps beside a parameter (a ZeRO shard's are views of
# its elements; a checkpoint places them in the whole tensor)
STATE: dict[str, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer",),
    "lion": ("exp_avg",),
    "adafactor": (),  # row_var, col_var, variance: shaped by rows and columns, never sharded
}
TITLES = {"adamw": "AdamW", "sgd": "SGD", "lion": "Lion", "adafactor": "Adafactor"}  # as reports name them
ELEMENTWISE = frozenset(kind for kind in STATE if kind != "adafactor")
# every state key that has a parameter's shape (what a checkpoint places as pieces of it):
# Adafactor's second moment of a vector too (a matrix's row and column moments are whole)
PARAMETER_SHAPED = frozenset(key for keys in STATE.values() for key in keys) | {"variance"}


@dataclass(frozen=True)
class OptimizerChoice:
    """An optimizer and its hyperparameters (`OPTIMIZERS`' keys; the others take their defaults)."""

    kind: str = "adamw"
    args: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.kind!r}: the optimizers are {', '.join(OPTIMIZERS)}")
        unknown = set(self.args) - set(OPTIMIZERS[self.kind])
        if unknown:
            raise ValueError(f"{self.kind} has no hyperparameter {', '.join(sorted(unknown))}")
        # every hyperparameter, defaults filled in (a dict: a run's config is pickled to its ranks)
        object.__setattr__(self, "args", OPTIMIZERS[self.kind] | dict(self.args))

    @property
    def title(self) -> str:
        """As reports name it, with the hyperparameters that are not the defaults: `AdamW`,
        `SGD(momentum=0.9)`."""
        changed = [f"{k}={v:g}" for k, v in self.args.items() if v != OPTIMIZERS[self.kind][k]]
        return TITLES[self.kind] + (f"({', '.join(changed)})" if changed else "")

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The parameter-shaped state it keeps (SGD without momentum keeps none)."""
        if self.kind == "sgd" and not self.args["momentum"]:
            return ()
        return STATE[self.kind]

    @property
    def counts_steps(self) -> bool:
        """Whether its state holds a step count per parameter (AdamW's bias correction,
        Adafactor's decay schedule)."""
        return self.kind in ("adamw", "adafactor")


def build(
    choice: OptimizerChoice,
    groups: list[dict[str, Any]],
    *,
    lr: float,
    fused: bool = False,
    pieces: Mapping[int, Sequence[Piece]] | None = None,
) -> torch.optim.Optimizer:
    """`choice` over `groups` (torch param groups, each with its `weight_decay`); `fused`: AdamW's
    one-kernel implementation (`buckets.fusable`). `pieces` (by id of each tensor in `groups`):
    the parameters it holds pieces of, for Adafactor where a rank holds pieces (`SplitAdafactor`)."""
    a = choice.args
    if choice.kind == "adafactor" and pieces is not None:
        eps = (a["eps1"], a["eps2"])
        return SplitAdafactor(groups, pieces, lr=lr, beta2_decay=a["beta2_decay"], eps=eps, d=a["d"])
    match choice.kind:
        case "adamw":
            return torch.optim.AdamW(groups, lr=lr, betas=(a["beta1"], a["beta2"]), eps=a["eps"], fused=fused)
        case "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=a["momentum"])
        case "lion":
            return Lion(groups, lr=lr, betas=(a["beta1"], a["beta2"]))
        case "adafactor":
            return torch.optim.Adafactor(
                groups, lr=lr, beta2_decay=a["beta2_decay"], eps=(a["eps1"], a["eps2"]), d=a["d"]
            )
    raise AssertionError(choice.kind)  # OptimizerChoice admits only OPTIMIZERS' names


def initial_state(choice: OptimizerChoice, param: Tensor) -> dict[str, Tensor]:
    """The state `choice` would make for `param` on its first step, made now: zeros (SGD's first
    momentum is the gradient itself, which a zero buffer times the momentum plus the gradient
    is too), and AdamW's step on the parameter's device (the fused kernel's)."""
    state = {key: torch.zeros_like(param, memory_format=torch.preserve_format) for key in choice.state_keys}
    if choice.kind == "adamw":
        state["step"] = torch.tensor(0.0, device=param.device)
    return state


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2):

        c = beta1 m + (1 - beta1) g
        p = p (1 - lr wd) - lr sign(c)
        m = beta2 m + (1 - beta2) g

    One momentum per parameter, elementwise: a ZeRO shard steps as its elements would whole."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay=0.0,
    ) -> None:
        if lr < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion needs lr >= 0 and betas in [0, 1), not lr={lr}, betas={betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                update = m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss
