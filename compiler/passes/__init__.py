"""The compiler's passes: one module each, one signature, run in the order of
`compiler.compile.PASSES`, the graph linted after each.

    gm = step.run(gm, ctx)

`Context` is what a pass may read (the plan, the mesh, the model and its resolved rules) and
what it leaves for later passes and the printers (diagnostics, the tensor-parallel spec).
A pass that finds a problem in the plan adds an error diagnostic instead of raising: the
passes after it that need a correct graph are skipped, the checks still run, and one compile
reports every problem the plan has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import fx

if TYPE_CHECKING:
    from meshplan.dsl.check import Plan
    from meshplan.dsl.errors import Diagnostic
    from meshplan.runtime.mesh import MeshLayout

    from ..load import ModelSource
    from ..match import Resolution
    from .experts import ExpertParams
    from .tensor_parallel import TensorParallelSpec


@dataclass
class Context:
    plan: Plan
    layout: MeshLayout
    source: ModelSource  # the unpartitioned fp32 model and the inputs the graph is compiled for
    resolution: Resolution  # rules -> modules
    diagnostics: list[Diagnostic] = field(default_factory=list)
    tensor: list[TensorParallelSpec] = field(default_factory=list)  # per tensor axis, in mesh order
    experts: dict[str, ExpertParams] = field(default_factory=dict)  # parameter -> its expert axis
    # parameter -> the axes its gradient is partial over, summed by the gradient sync (`grad_sums.py`)
    grad_sums: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(d.severity == "error" for d in self.diagnostics)


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[fx.GraphModule, Context], fx.GraphModule]
    requires: str  # what the graph and the context must hold before it
    ensures: str  # what holds after it (checked, where it can be, by `compiler/lint.py`)
    checks_after_errors: bool = False  # still run once the plan has errors, to report its own
