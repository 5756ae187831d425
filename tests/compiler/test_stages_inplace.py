"""Pipeline stages of models that build values by writing into them in place.

Each model is compiled with a pipeline (pp=2, cut before `second`), and its two stage programs,
run one after the other on one process (stage 1 given what stage 0 sends, gradients flowing
through), must compute the loss and gradients of the whole program:

- T5's decoder inputs: the labels copied into a tensor of zeros, shifted by one, the first
  column filled: no op reads the writes' results, so a stage that follows only what ops read
  remade zeros (`meshplan verify` of T5 under pp=2 failed from step 1);
- zeros that an activation is written into before the cut and a later stage reads: the writes
  make the zeros an activation, received, not remade;
- an input written into in place by both stages, which one rank may run one after the other:
  each stage writes into a copy of the microbatch, as the whole program writes once.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshplan.compiler.capture import bind_inputs, with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import load_model
from meshplan.compiler.lower import build_rank_program
from meshplan.compiler.stages import compiled_cuts, cut_stages
from meshplan.dsl import check_text

VOCAB, WIDTH, BATCH, SEQ = 32, 16, 2, 8
PLAN = (
    "mesh pp=2\n\npipeline over pp {\n    schedule = gpipe\n    microbatches = 2\n    cut before second\n}\n"
)


class Model(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.extra = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, labels):
        h = self.first(self.embed(input_ids))
        if self.how == "shifted":  # T5's `_shift_right`
            shifted = labels.new_zeros(labels.shape)
            shifted[..., 1:] = labels[..., :-1].clone()
            shifted[..., 0] = 1
            h = self.second(h) + self.extra(shifted)
        elif self.how == "written":
            out = torch.zeros(input_ids.shape[0], input_ids.shape[1], WIDTH)
            out[:, 1:] = h[:, :-1]
            h = self.second(out)
        else:  # "input": both stages read the labels after the write
            labels.add_(1).remainder_(VOCAB)
            h = self.second(h + self.extra(labels))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def shifted() -> Model:
    torch.manual_seed(0)
    return Model("shifted")


def written() -> Model:
    torch.manual_seed(0)
    return Model("written")


def input_written() -> Model:
    torch.manual_seed(0)
    return Model("input")


def example_inputs(batch: int = BATCH, seq: int = SEQ):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(
        0, VOCAB, (batch, seq), generator=g
    )


def _loss(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("factory", ["shifted", "written", "input_written"])
def test_stages_compute_what_the_whole_program_does(factory: str) -> None:
    source = with_token_shape(load_model(f"{__file__}:{factory}"), batch=BATCH, seq=SEQ)
    compiled = compile_plan(check_text(PLAN, path="pp.plan"), source, world_size=2)
    stages = cut_stages(compiled.graph, compiled_cuts(compiled.graph))
    program = build_rank_program(compiled, source.model, 0)
    first, second = stages.programs(program)

    def inputs():  # fresh: the "input" model writes into its labels
        return bind_inputs(source.model, program, example_inputs(), {})

    want = _loss(program(*inputs()))
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in program.named_parameters() if p.grad is not None}
    program.zero_grad()

    microbatch = inputs()
    got = _loss(second(*microbatch, *first(*microbatch)))
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    grads = {n: p.grad for n, p in program.named_parameters() if p.grad is not None}
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], msg=name)
