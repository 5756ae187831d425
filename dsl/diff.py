"""What changes between two plans as the compiler reads them, not as their text reads:

    changes = diff_plans(load_plan("a.plan"), load_plan("b.plan"))
    print(diff_text(changes))      # one line per change; nothing when the plans are equivalent

Each plan is reduced to its facts (`plan_facts`): the mesh's axes in order, every setting of
its blocks with its default filled in (a block's `zero = 0` written out and left out are one
plan), and one fact per rule per module pattern, braces expanded (`{q,k,v}_proj: column over
tp` is three rules, `layers.{0..1}` is `layers.0` and `layers.1`). Rule order, formatting and
comments never count: precedence between rules is by specificity, not position. Patterns are
compared as text: `layers.*` and `layers.{0..3}` differ here even where a model has four
layers; `meshplan diff --model` compares what each places on the model's parameters.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from .check import Plan
from .fmt import action_text

# the most module paths one pattern's braces expand to here; a bigger one stays a pattern
MAX_EXPANDED = 4096
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?[0-9]+)\.\.(-?[0-9]+)")


@dataclass(frozen=True)
class Change:
    """One fact that differs: `before` None for one only the second plan has, `after` None for
    one only the first has."""

    what: str  # `mesh`, `data_parallel.zero`, `layers.*.mlp.up_proj (tensor)`
    before: str | None
    after: str | None
    rule: bool = False  # a `modules` rule's (not a setting's)

    @property
    def sign(self) -> str:
        return "+" if self.before is None else "-" if self.after is None else "~"

    def to_json(self) -> dict[str, str | None]:
        return {"what": self.what, "before": self.before, "after": self.after}


def diff_plans(a: Plan, b: Plan) -> list[Change]:
    """Every fact of `a` or `b` that the other does not state alike: settings first, in the
    order a plan file has its blocks, then rules by pattern."""
    before, after = plan_facts(a), plan_facts(b)
    keys = list(dict.fromkeys([*before, *after]))
    settings = sorted(
        (k for k in keys if not k.startswith(RULE)), key=lambda k: BLOCKS.index(k.split(".")[0])
    )
    rules = sorted((k for k in keys if k.startswith(RULE)), key=lambda k: k[len(RULE) :])
    changes = [
        Change(k.removeprefix(RULE), before.get(k), after.get(k), rule=k.startswith(RULE))
        for k in [*settings, *rules]
        if before.get(k) != after.get(k)
    ]
    return _whole_blocks(changes)


def _whole_blocks(changes: list[Change]) -> list[Change]:
    """A block only one plan has, as one change (`+ data_parallel  over dp: zero 1, bucket 25MB, ...`)
    instead of one a setting."""
    out: list[Change] = []
    for block, group in itertools.groupby(
        changes, key=lambda c: c.what.partition(".")[0] if not c.rule else ""
    ):
        items = list(group)
        signs = {c.sign for c in items}
        if block in ("pipeline", "data_parallel") and len(signs) == 1 and signs != {"~"}:
            side = "after" if signs == {"+"} else "before"
            values = {c.what.partition(".")[2]: getattr(c, side) for c in items}
            text = f"over {values.pop('axis')}: " + ", ".join(f"{k} {v}" for k, v in values.items())
            out.append(Change(block, text if side == "before" else None, text if side == "after" else None))
        else:
            out.extend(items)
    return out


RULE = "rule "  # the prefix of a rule's fact
BLOCKS = ("mesh", "pipeline", "data_parallel", "precision", "train")  # the settings' order


def plan_facts(plan: Plan) -> dict[str, str]:
    """The plan as facts: a name -> its value, as plan text writes it."""
    facts = {"mesh": ", ".join(f"{a.name}={a.size if a.size is not None else '*'}" for a in plan.mesh.axes)}
    if plan.pipeline is not None:
        p = plan.pipeline
        facts |= {
            "pipeline.axis": p.axis,
            "pipeline.schedule": p.schedule,
            "pipeline.microbatches": str(p.microbatches) if p.microbatches is not None else "one per stage",
            "pipeline.virtual_stages": str(p.virtual_stages),
            "pipeline.cuts": ", ".join(f"{c.side} {c.pattern.text}" for c in p.cuts) or "balanced",
        }
    if plan.data_parallel is not None:
        d = plan.data_parallel
        facts |= {
            "data_parallel.axis": d.axis,
            "data_parallel.zero": str(d.zero) + (f" over {d.shard}" if d.shard else ""),
            "data_parallel.bucket": _bytes(d.bucket_bytes),
            "data_parallel.offload_optimizer": "disk" if d.optimizer_on_disk else _flag(d.offload_optimizer),
            "data_parallel.offload_params": "disk" if d.params_on_disk else _flag(d.offload_params),
            "data_parallel.compress": d.compress.text if d.compress is not None else "none",
        }
    pr = plan.precision
    facts |= {
        "precision.compute": pr.compute,
        "precision.params": pr.params,
        "precision.grads": pr.grads,
        "precision.reduce": pr.reduce,
        "precision.loss_scale": str(pr.loss_scale) if pr.loss_scale is not None else "none",
        "train.gradient_accumulation": str(plan.train.gradient_accumulation),
        "train.optimizer": plan.train.optimizer.text,
    }
    for rule in plan.rules:
        for path in expanded(rule.pattern):
            facts[f"{RULE}{path} ({rule.kind})"] = action_text(rule.action)
    return facts


def expanded(pattern: str) -> list[str]:
    """The paths `pattern`'s braces stand for (its `*` and `**` kept), or `[pattern]` when they
    stand for more than `MAX_EXPANDED`."""
    choices = [_alternatives(m.group(1)) for m in _BRACE.finditer(pattern)]
    if not choices:
        return [pattern]
    count = 1
    for c in choices:
        count *= len(c)
        if count > MAX_EXPANDED:
            return [pattern]
    pieces = _BRACE.split(pattern)[::2]  # the text between the braces
    return [
        "".join(itertools.chain.from_iterable(zip(pieces, (*picked, ""), strict=True)))
        for picked in itertools.product(*choices)
    ]


def diff_text(changes: list[Change]) -> str:
    """One line a change: `~ data_parallel.zero  1 -> 3`, `+ layers.*.mlp.up_proj (tensor)
    column over tp`, `- ...`; '' when there is none."""
    width = max((len(c.what) for c in changes), default=0)
    return "".join(f"{c.sign} {c.what:<{width}}  {_values(c)}\n" for c in changes)


def _values(change: Change) -> str:
    if change.before is None:
        return str(change.after)
    if change.after is None:
        return str(change.before)
    return f"{change.before} -> {change.after}"


def _alternatives(inside: str) -> list[str]:
    """`q,k,v` -> [q, k, v]; `0..3` -> [0, 1, 2, 3] (a range too long for `MAX_EXPANDED` is
    cut short there: the caller then keeps the pattern)."""
    bounds = _RANGE.fullmatch(inside)
    if bounds is None:
        return inside.split(",")
    lo, hi = int(bounds.group(1)), int(bounds.group(2))
    return [str(i) for i in itertools.islice(range(lo, hi + 1), MAX_EXPANDED + 1)]


def _bytes(n: int) -> str:
    units = (("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10), ("KB", 10**3))
    for unit, size in units:
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def _flag(value: bool) -> str:
    return "true" if value else "false"
