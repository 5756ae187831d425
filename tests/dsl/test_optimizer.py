"""`train { optimizer = ... }`: parsed, formatted, checked with its defaults, and what composes.
The refusals' rendered errors are golden files (`invalid/optimizer_*.plan`)."""

from __future__ import annotations

import pytest

from meshplan.dsl import ast as A
from meshplan.dsl import check_text, parse
from meshplan.dsl.fmt import format_plan
from meshplan.grammar import OPTIMIZERS


def _plan(optimizer: str, *, zero: int = 0, rules: str = "") -> str:
    modules = f"modules {{\n    {rules}\n}}\n" if rules else ""
    return (
        f"mesh dp=2, tp=2\n{modules}data_parallel over dp {{\n    zero = {zero}\n}}\n"
        f"train {{\n    optimizer = {optimizer}\n}}\n"
    )


def test_parsed_with_each_hyperparameter_as_written() -> None:
    block = parse("mesh dp=2\ntrain {\n    optimizer = adafactor(beta2_decay=-0.5,  d=2)\n}\n").statements[1]
    assert isinstance(block, A.TrainBlock)
    setting = block.items[0]
    assert setting.value == A.OptimizerChoice(
        A.Name("adafactor"),
        (A.OptimizerArg(A.Name("beta2_decay"), -0.5, "-0.5"), A.OptimizerArg(A.Name("d"), 2.0, "2")),
    )
    assert setting.text == "adafactor(beta2_decay=-0.5, d=2)"  # what `meshplan fmt` prints


def test_formatting_is_canonical_and_parses_back() -> None:
    text = "mesh dp=2\ntrain { optimizer = sgd( momentum = 0.9 ) }\n"
    out = format_plan(parse(text), text)
    assert "    optimizer = sgd(momentum=0.9)\n" in out
    assert parse(out) == parse(text)


def test_defaults_are_filled_in_and_adamw_is_the_default() -> None:
    plan = check_text(_plan("sgd"), world_size=4)
    assert plan.train.optimizer.kind == "sgd"
    assert dict(plan.train.optimizer.args) == {"momentum": 0.0}
    lion = check_text(_plan("lion(beta2=0.98)"), world_size=4).train.optimizer
    assert dict(lion.args) == {"beta1": 0.9, "beta2": 0.98}
    default = check_text("mesh dp=2\n", world_size=2).train.optimizer
    assert (default.kind, dict(default.args)) == ("adamw", OPTIMIZERS["adamw"])


@pytest.mark.parametrize("optimizer", ["adamw", "sgd(momentum=0.9)", "lion", "adafactor"])
def test_every_optimizer_composes_with_zero_and_split_parameters(optimizer: str) -> None:
    plan = check_text(_plan(optimizer, zero=3, rules="layers.*.mlp.up_proj: column over tp"), world_size=4)
    assert plan.train.optimizer.kind == optimizer.split("(")[0]


def test_adafactor_composes_with_whole_parameters() -> None:
    """Plain data parallelism, and a `replicate` rule, which splits nothing."""
    plan = check_text(_plan("adafactor", rules="layers.*: replicate"), world_size=4)
    assert plan.train.optimizer.kind == "adafactor"


def test_adafactor_composes_with_split_rules_under_every_zero_stage() -> None:
    for zero in (1, 2, 3):
        plan = check_text(
            _plan("adafactor", zero=zero, rules="layers.*.mlp.down_proj: row over tp"), world_size=4
        )
        assert plan.data_parallel is not None and plan.data_parallel.zero == zero
