"""The ZeRO nodes a compiled program calls: what the compiler's ZeRO pass inserts and the
engine (`runtime/zero.py`) binds itself to.

    zero_gather_layers_0 = self.zero_gather_layers_0(layers_0_attn_q_proj_weight, ...)
    ...
    zero_release_layers_0 = self.zero_release_layers_0(add_3)  # frees; backward gathers

Unbound (no engine: `meshplan verify`'s one-device runs, `compile`'s graphs) both are
identities. They live apart from the engine so the compiler depends on these nodes only,
never on the optimizer-state machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, fx, nn

# Gradient reductions the engine leaves running while backward goes on: enough to overlap, and
# a bound on the full-size gradient buffers alive at once (each is one bucket or one stage-3
# unit). Here, beside the nodes, because the compiler's estimate emulates the engine too.
MAX_IN_FLIGHT = 2


def in_backward() -> bool:
    """Whether autograd's engine is running a backward now (a node's forward called again in it
    is a recomputation, under activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class Engine(Protocol):
    """What a bound node calls: ZeRO's engine, by index of the unit in program order."""

    def on_gather(self, index: int, params: Sequence[Tensor]) -> tuple[Tensor | None, ...] | None: ...

    def on_release(self, index: int) -> None: ...

    def before_backward(self, index: int) -> None: ...


class ZeroGather(nn.Module):
    """A compiled graph's node before a layer's first parameter use (see runtime/zero.py).

    Stage 3: gather the layer's params (or wait for their prefetch) and prefetch the next
    layer's; stages 1/2: wait for the all-gather of the layer's updated params. Unbound
    (no ZeRO engine, e.g. under `meshplan verify`) it does nothing: the params are whole.

    `dtypes` (stage 3 under mixed precision): the dtype the graph reads each parameter in, or
    None. Then the node returns one value per parameter, that parameter in its dtype, and the
    graph reads those instead of casting the parameters itself: a bound engine gathers them
    in that dtype (half the bytes of fp32 for bf16) into a buffer the release frees, so no
    compute-dtype copy outlives the layer; unbound, they are the casts the graph had.
    """

    _is_impure = True  # no output: keep fx's dead-code elimination away from it

    def __init__(
        self, axis: str, unit: str, params: Sequence[str], dtypes: Sequence[torch.dtype | None] = ()
    ) -> None:
        super().__init__()
        self.axis, self.unit, self.params = axis, unit, tuple(params)
        self.dtypes = tuple(dtypes) or (None,) * len(self.params)
        self._engine: Engine | None = None
        self._index = -1

    def bind(self, engine: Engine | None, index: int) -> None:
        self._engine, self._index = engine, index

    def forward(self, *params: Tensor) -> tuple[Tensor | None, ...] | None:
        if self._engine is not None:
            cast = self._engine.on_gather(self._index, params)
            if cast is not None:
                return cast
        if not any(self.dtypes):
            return None
        return tuple(p.to(d) if d is not None else None for p, d in zip(params, self.dtypes, strict=True))

    def extra_repr(self) -> str:
        cast = sorted({str(d).removeprefix("torch.") for d in self.dtypes if d is not None})
        return f"axis={self.axis!r}, unit={self.unit!r}, params={len(self.params)}" + (
            f", read_as={'/'.join(cast)}" if cast else ""
        )


class Gathered(torch.autograd.Function):
    """Parameters read in another dtype, as views of a flat's gathered buffer in that dtype
    (`Flat.low`): forward hands out the views (what the layer's ops save for backward, freed
    and gathered again with the buffer); backward returns each gradient in its parameter's
    dtype, which autograd accumulates into the fp32 parameter as a cast's backward would."""

    @staticmethod
    def forward(ctx: Any, count: int, *args: Tensor) -> tuple[Tensor, ...]:
        views, params = args[:count], args[count:]
        ctx.count, ctx.dtypes = count, [p.dtype for p in params]
        return tuple(v.view_as(v) for v in views)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        cast = [g.to(d) if g is not None else None for g, d in zip(grads, ctx.dtypes, strict=True)]
        return (None, *([None] * ctx.count), *cast)


class ZeroRelease(nn.Module):
    """A compiled graph's node on the values leaving a layer, after its last parameter use.

    Forward frees the layer's gathered params (stage 3); the values pass through an
    autograd function whose backward gathers them again before the layer's backward runs
    (every gradient into the layer flows through these values). Identity when unbound.
    """

    def __init__(self, axis: str, unit: str, position: int) -> None:
        super().__init__()
        self.axis, self.unit, self.position = axis, unit, position  # position: order in the graph
        self._engine: Engine | None = None
        self._index = -1

    def bind(self, engine: Engine | None, index: int) -> None:
        self._engine, self._index = engine, index

    def forward(self, *values: Tensor) -> Tensor | tuple[Tensor, ...]:
        if self._engine is None:
            return values[0] if len(values) == 1 else values
        out = _Release.apply(self._engine, self._index, *values)
        return out[0] if len(values) == 1 else out

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, unit={self.unit!r}"


class _Release(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, engine: Engine, index: int, *values: Tensor) -> tuple[Tensor, ...]:
        ctx.engine, ctx.index = engine, index
        engine.on_release(index)
        return tuple(v.view_as(v) for v in values)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.engine.before_backward(ctx.index)
        return (None, None, *grads)


def graph_units(module: nn.Module, axis: str | None = None) -> list[tuple[ZeroGather, ZeroRelease | None]]:
    """The `ZeroGather` nodes a compiled program calls, in program order, each with the
    `ZeroRelease` of the same layer (None where the layer stays gathered); only those of the
    group `axis` names, if given (under expert parallelism a layer has one per group)."""
    if not isinstance(module, fx.GraphModule):
        return []
    releases = {m.unit: m for m in module.modules() if isinstance(m, ZeroRelease)}
    out = []
    for node in module.graph.nodes:
        if node.op == "call_module":
            target = module.get_submodule(str(node.target))
            if isinstance(target, ZeroGather) and axis in (None, target.axis):
                out.append((target, releases.get(target.unit)))
    return out
