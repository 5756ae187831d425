"""`estimate`'s optimizer state follows the plan's optimizer: its formula (`optimizer_state.py`)
equals the bytes the engine holds after a step, for each optimizer, on one process (the ZeRO
shards' are `bench/optimizer_state.py`'s and `tests/runtime/test_optimizers.py`'s)."""

from __future__ import annotations

import pytest
import torch

from meshplan.compiler.estimate import state_of
from meshplan.compiler.optimizer_state import shard_state_bytes, whole_state_bytes
from meshplan.dsl.optimizer import OptimizerSpec
from meshplan.examples.models.llama import build, example_inputs
from meshplan.grammar import OPTIMIZERS
from meshplan.runtime.grad_sync import Local
from meshplan.runtime.optimizers import OptimizerChoice
from meshplan.runtime.train import TrainConfig


@pytest.mark.parametrize(
    ("kind", "args"),
    [("adamw", {}), ("sgd", {"momentum": 0.9}), ("sgd", {}), ("lion", {}), ("adafactor", {})],
)
def test_formula_is_what_the_engine_holds(kind: str, args: dict[str, float]) -> None:
    model = build(num_hidden_layers=2)
    local = Local(model)
    optimizer = local.optimizer(TrainConfig(optimizer=OptimizerChoice(kind, args)))
    model(*example_inputs(2, 16)).backward()
    optimizer.step()
    spec = OptimizerSpec(kind, OPTIMIZERS[kind] | args)
    params = dict(model.named_parameters())
    formula = state_of(params, zero=0, group_size=lambda n: 1, engine="none", bucket_bytes=1, optimizer=spec)
    assert formula.optimizer == local.memory()["optimizer"]


def test_adafactor_keeps_rows_and_columns_of_a_matrix() -> None:
    spec = OptimizerSpec("adafactor", OPTIMIZERS["adafactor"])
    assert whole_state_bytes(spec, torch.empty(300, 500)) == (300 + 500) * 4 + 4
    assert whole_state_bytes(spec, torch.empty(500)) == 500 * 4 + 4


def test_adafactor_keeps_the_whole_matrix_rows_and_columns_on_every_piece() -> None:
    """A tensor-parallel slice's moments are the whole matrix's (`runtime/adafactor.py`); under
    ZeRO each parameter of a flat keeps its whole rows and columns, a vector its elements' share."""
    spec = OptimizerSpec("adafactor", OPTIMIZERS["adafactor"])
    assert whole_state_bytes(spec, torch.empty(150, 500), whole=(300, 500)) == (300 + 500) * 4 + 4
    assert whole_state_bytes(spec, torch.empty(250), whole=(500,)) == 250 * 4 + 4
    members = [((300, 500), 150 * 500), ((4, 30, 50), 3000), ((501,), 501)]
    expected = (800 * 4 + 4) + (4 * 80 * 4 + 4) + (251 * 4 + 4)
    assert shard_state_bytes(spec, 40_000, members, world=2) == expected
