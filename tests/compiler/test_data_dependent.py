"""Models with data-dependent sizes (a dropless MoE looping over per-expert token counts).

Export leaves those sizes symbolic (`u0`, ...); passes read them without guarding on them.
Tensor rules elsewhere in the model compile and train exactly; a rule that would shard a
tensor into the data-dependent part is a located error.
"""

from pathlib import Path

import pytest
from gloo_pool import spawn
from parity import grad_parity

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import load_model
from meshplan.dsl import PlanError, check_text

MOE = f"{Path(__file__).resolve().parent}/factories.py:dropless_moe"
ATTENTION_TP = """
mesh tp=2

modules {
    layers.*.{q,k,v}: column over tp
    layers.*.o:       row over tp
    embed:            vocab over tp
    head:             vocab over tp
}
"""


@pytest.mark.slow
def test_tensor_parallel_attention_beside_dropless_experts_is_exact():
    results = spawn(grad_parity, 2, (ATTENTION_TP, MOE, "float64"))
    for r in results:
        assert r["loss"] < 1e-12 and r["grad"] < 1e-10, r
        assert "all_reduce_tp" in r["collectives"]


def test_a_split_feeding_the_data_dependent_part_is_a_located_error():
    plan = check_text(
        "mesh tp=2\n\nmodules {\n    layers.*.moe.router: column over tp\n}\n", "moe.plan", world_size=2
    )
    with pytest.raises(PlanError) as e:
        compile_plan(plan, load_model(MOE))
    (d,) = e.value.diagnostics
    assert (d.span.line, d.span.col) == (4, 5)
    assert "sharded over `tp`" in d.message
