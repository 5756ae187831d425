"""`train { optimizer = ... }` checked: which optimizer, its hyperparameters, what it composes with.

    train {
        optimizer = sgd(momentum=0.9)
    }

The names and keys are `meshplan.grammar.OPTIMIZERS` (`runtime.optimizers` builds from the same
table); a key not given takes its default there, and the learning rate, its schedule and the
weight decay stay the run's options (`--lr`, `--weight-decay`). Without the setting a plan trains
with AdamW, as before the choice existed.

Every optimizer composes with every layout. AdamW, SGD and Lion are elementwise: a shard steps
exactly as its elements would whole. Adafactor's step reads a whole parameter three times (the
row and column means of grad^2, the parameter's RMS, the update's RMS): where ranks hold pieces
of a parameter (ZeRO's element ranges, a `column`, `row`, `vocab` or `experts` rule's slices)
each is a sum of the pieces' partial sums over the ranks that hold them, in two all-reduce rounds
per step (`runtime/adafactor.py`); its row and column moments are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from meshplan.grammar import OPTIMIZERS

from . import ast
from .errors import Span, did_you_mean

if TYPE_CHECKING:
    pass

DEFAULT = "adamw"
# each hyperparameter's allowed values: (test, how the hint says it)
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "beta1": (lambda v: 0 <= v < 1, "from 0 up to (not including) 1"),
    "beta2": (lambda v: 0 <= v < 1, "from 0 up to (not including) 1"),
    "momentum": (lambda v: 0 <= v < 1, "from 0 up to (not including) 1"),
    "eps": (lambda v: v > 0, "positive"),
    "eps1": (lambda v: v > 0, "positive"),
    "eps2": (lambda v: v > 0, "positive"),
    "d": (lambda v: v > 0, "positive"),
    "beta2_decay": (lambda v: -1 <= v <= 0, "from -1 to 0 (torch.optim.Adafactor's range)"),
}
V = TypeVar("V")
Error = Callable[..., None]  # `SettingsChecker.error(span, message, hint=..., related=...)`


@dataclass(frozen=True)
class OptimizerSpec:
    """The plan's optimizer: its name, every hyperparameter (defaults filled in) and the
    setting's span (None: not set, AdamW)."""

    kind: str = DEFAULT
    args: Mapping[str, float] = field(default_factory=lambda: MappingProxyType(dict(OPTIMIZERS[DEFAULT])))
    span: Span | None = None

    @property
    def text(self) -> str:
        """As `explain` and `diff` name it: `sgd(momentum=0.9)`, every hyperparameter given."""
        return f"{self.kind}({', '.join(f'{k}={v:g}' for k, v in self.args.items())})"


def check_optimizer(setting: ast.Setting, error: Error) -> OptimizerSpec:
    """`optimizer = NAME(KEY=NUMBER, ...)` checked: a known optimizer, its own keys, each once and
    in range. What is wrong is reported at the name or key and AdamW stands in."""
    value = setting.value
    assert isinstance(value, ast.OptimizerChoice)  # the grammar's `optimizer` rule makes one
    kind = value.name.text
    if kind not in OPTIMIZERS:
        guess = did_you_mean(kind, list(OPTIMIZERS))
        known = ", ".join(f"`{k}`" for k in OPTIMIZERS)
        error(
            value.name.span,
            f"unknown optimizer `{kind}`",
            hint=f"did you mean `{guess}`?" if guess else f"the optimizers are {known}",
        )
        return OptimizerSpec()

    def out_of_range(key: str, arg: ast.OptimizerArg) -> tuple[str, str] | None:
        test, allowed = _RANGES[key]
        return (
            None if test(arg.value) else (f"`{key}` of {arg.text} is out of range", f"`{key}` is {allowed}")
        )

    args = keyword_arguments(kind, value.args, OPTIMIZERS[kind], "hyperparameter", error, out_of_range)
    return OptimizerSpec(kind, MappingProxyType(args), setting.value_span)


def keyword_arguments(
    owner: str,
    given: Sequence[Any],
    allowed: Mapping[str, V],
    what: str,
    error: Error,
    invalid: Callable[[str, Any], tuple[str, str] | None],
) -> dict[str, V]:
    """`owner(KEY=VALUE, ...)`'s arguments checked against `allowed` (their defaults): an unknown
    key (with a did-you-mean), one given twice, or one `invalid` says is wrong (message, hint) is
    reported where it is; the defaults with every good value given. The settings that take
    arguments (`optimizer`, `compress`) share it."""
    values = dict(allowed)
    seen: set[str] = set()
    for arg in given:
        key = arg.name.text
        if key not in allowed:
            guess = did_you_mean(key, list(allowed))
            takes = ", ".join(f"`{a}`" for a in allowed) or "no arguments"
            error(
                arg.name.span,
                f"`{owner}` has no {what} `{key}`",
                hint=f"did you mean `{guess}`?" if guess else f"`{owner}` takes {takes}",
            )
        elif key in seen:
            error(arg.span, f"`{key}` is given twice", hint="keep one")
        elif (wrong := invalid(key, arg)) is not None:
            error(arg.span, wrong[0], hint=wrong[1])
        else:
            values[key] = arg.value
        seen.add(key)
    return values
