"""The plan language's grammar, shipped as data: `plan.lark` is the reference.

A leaf that every layer may import: `dsl` parses with the grammar and `runtime` builds the
schedules it names, and neither imports the other.
"""

from importlib.resources import files

# The pipeline schedules a plan can name (`schedule = 1f1b`), in the grammar's order: the
# checker and `runtime.schedules.build` read this list; `plan.lark` spells the names out
# too, and tests/dsl/test_schedule_names.py holds the two equal.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")

# The optimizers a plan can choose (`train { optimizer = sgd(momentum=0.9) }`), each with the
# hyperparameters it takes and their defaults: the checker refuses any other name or key, and
# `runtime.optimizers` builds them. The learning rate, its schedule and the weight decay are the
# run's options, not the plan's. AdamW's betas are meshplan's (0.9, 0.95), as before the choice
# existed; Lion's the paper's; Adafactor's torch.optim's, with `eps1` fixed at float32's epsilon
# (torch's default is the parameters' dtype's: verify's float64 reference must step alike).
OPTIMIZERS: dict[str, dict[str, float]] = {
    "adamw": {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
    "sgd": {"momentum": 0.0},
    "lion": {"beta1": 0.9, "beta2": 0.99},
    "adafactor": {"beta2_decay": -0.8, "eps1": 2.0**-23, "eps2": 1e-3, "d": 1.0},
}


def grammar_text() -> str:
    """Return the text of `plan.lark`."""
    return files(__name__).joinpath("plan.lark").read_text(encoding="utf-8")
