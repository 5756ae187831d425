"""What a run calls besides the program: each step's extra metrics (expert load, pipeline idle
time) and `--between-steps`, the model's own update of its buffers after each optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshplan.dsl.axes import axes_of
from meshplan.errors import RunError

if TYPE_CHECKING:
    import torch
    from torch import fx, nn

    from meshplan.runtime.axes import Axes


def step_metrics(*sources: Callable[[], dict[str, Any]] | None) -> Callable[[], dict[str, Any]] | None:
    """The facts of each source, in one record (None without any)."""
    present = [m for m in sources if m is not None]
    if not present:
        return None
    return lambda: {k: v for m in present for k, v in m().items()}


def expert_metrics(programs: list[fx.GraphModule], axes: Axes) -> Callable[[], dict[str, Any]]:
    """Each step's expert load: the (token, slot) pairs routed to each expert of each MoE
    layer over the whole job, and its overload factor (the most loaded expert-parallel rank's
    pairs over the balanced share); under a capacity, `dropped`: those of them each expert
    had no room for. One all-reduce of the counts per data axis. Under a pipeline, the layers
    of this rank's stages (`programs`)."""
    import torch

    from meshplan.runtime.experts import ExpertParallel

    units = [m for program in programs for m in program.modules() if isinstance(m, ExpertParallel)]

    def metrics() -> dict[str, Any]:
        if not units:
            return {}
        local = torch.cat([torch.cat([u.take_tokens(), u.take_dropped()]) for u in units])
        # every rank's routed rows: the data ranks', those of experts borrowing a tensor axis, and
        # those of an axis that cuts the tokens by rows (a sequence shard each)
        routing = {a for u in units for a in (*axes_of(u.axis), *getattr(u, "rows_cut", ()))}
        over = (*axes.data, *sorted(routing - set(axes.data)))
        counts = axes.sum_over(local, over, "expert load")
        load = {}
        for unit, both in zip(units, counts.split([2 * u.num_experts for u in units]), strict=True):
            tokens, dropped = both.chunk(2)
            per_rank = tokens.view(math.prod(axes.size(a) for a in axes_of(unit.axis)), -1).sum(1)
            share = float(tokens.sum()) / len(per_rank)
            load[unit.path] = {
                "tokens": tokens.tolist(),
                "overload": float(per_rank.max()) / share if share else 0.0,
            }
            if unit.capacity_factor is not None:
                load[unit.path]["dropped"] = dropped.tolist()
        return {"expert_load": load}

    return metrics


def between_steps_hook(
    spec: str,
    held: fx.GraphModule,
    programs: list[fx.GraphModule],
    model: nn.Module,
    axes: Axes,
    *,
    pipeline: bool = False,
) -> Callable[[], None]:
    """`--between-steps FILE.py:update`: after each optimizer step, `update(model)` on the
    user's own model object, its buffers this rank's (`held`'s, under the model's names). The
    buffers the rank's programs write while they run (a router's token counts) are statistics
    of this rank's tokens: they are summed over the data axes first, so every rank calls
    `update` on the same numbers and the buffers it sets (an expert bias) stay identical
    everywhere, as on one device over the whole batch. Under a pipeline `programs` are the
    rank's stages and the model's other layers are other ranks': `update` runs over them too,
    on whatever this rank's model holds of them, and only this rank's stages' buffers are read
    back."""
    import torch

    from meshplan.compiler.graph import mutated_buffers
    from meshplan.compiler.load import describe_error, load_function

    update = load_function(spec, "--between-steps")
    # (a checkpointed layer may not write any: the checkpoint pass)
    written = list(dict.fromkeys(name for program in programs for name in mutated_buffers(program)))
    own = dict(held.named_buffers())
    theirs = dict(model.named_buffers())
    mirrored = [n for n, b in own.items() if n in theirs and theirs[n].shape == b.shape]
    for n in mirrored:  # the model's buffers are the program's: an in-place update needs no copy
        _set_buffer(model, n, own[n])

    def between_steps() -> None:
        with torch.no_grad():
            stats = [own[n] for n in written]
            if stats and axes.data:
                total = axes.sum_over(torch.cat([s.flatten().double() for s in stats]), axes.data, spec)
                for s, part in zip(stats, total.split([s.numel() for s in stats]), strict=True):
                    s.copy_(part.view_as(s))
            # the buffers the plan cuts (usually none); under a pipeline, of this rank's stages
            cut = {
                n: b.clone() for n, b in theirs.items() if n not in mirrored and (n in own or not pipeline)
            }
        try:
            update(model)
        except Exception as e:
            raise RunError(
                f"--between-steps {spec} raised {describe_error(e, spec.rpartition(':')[0])}"
            ) from e
        with torch.no_grad():
            for n in mirrored:
                if (value := model.get_buffer(n)) is not own[n]:  # assigned anew, not updated in place
                    own[n].copy_(value)
                    _set_buffer(model, n, own[n])
            changed = [n for n, b in cut.items() if not torch.equal(b, model.get_buffer(n))]
        if changed:
            raise RunError(
                f"--between-steps {spec} changed `{changed[0]}`, a buffer this plan cuts over ranks: "
                "meshplan cannot give it back to the program"
            )

    return between_steps


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Make `value` the tensor of `model`'s buffer `name` (its persistence unchanged)."""
    owner, _, leaf = name.rpartition(".")
    model.get_submodule(owner)._buffers[leaf] = value
