"""One rank's program on a CUDA device, in this process: a `tp=4` rank and a `dp=2, pp=2` rank
alone on the device under the fake process group (collectives that only keep shapes), so one GPU
runs every kind of per-rank program; and a `dp=1` rank on a real process group, whose training
state must live on the device, stepped by the fused AdamW, with no weight copied to the host;
and a `dp=1` rank whose embedding and LM head a device rule holds on the host (`on cpu`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from gpu_tier import (
    DEVICE,
    DP1_BF16,
    MODEL_8_HEADS,
    open_rank_session,
    process_group,
    real_backend,
    tier,
    write_plan,
)
from plans import llama_rules, llama_sequence, plan
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = tier

aten = torch.ops.aten

TP4 = plan(
    llama_rules() + llama_sequence() + "    layers.*: checkpoint\n",
    mesh="tp=4",
    extra="\nprecision {\n    compute = bf16\n}\n",
)

DP2_PP2 = """
mesh dp=2, pp=2

data_parallel over dp {
    zero = 1
}

pipeline over pp {
    schedule = 1f1b
    microbatches = 4
}

precision {
    compute = bf16
}
"""


# the embedding and the LM head held on the host (`on cpu`), the rest of the rank on the device
ON_CPU = plan("\n    lm_head:      on cpu\n    embed_tokens: on cpu\n", mesh="dp=1")
HOST = {"lm_head.weight", "embed_tokens.weight"}


class HostCopies(TorchDispatchMode):
    """Records every copy of a tensor of more than one element from the device to the host
    (`.item()` of a loss or a norm reads a scalar and is not one)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (aten._to_copy.default, aten.copy_.default):
            source = args[1] if func is aten.copy_.default else args[0]
            target = args[0] if func is aten.copy_.default else out
            if source.device.type != "cpu" and target.device.type == "cpu" and source.numel() > 1:
                self.seen.append(f"{func}: {tuple(source.shape)} {source.dtype}")
                self.shapes.append(tuple(source.shape))
        return out


@contextmanager
def adamw_instances(monkeypatch) -> Iterator[list[torch.optim.AdamW]]:
    """Every AdamW made inside: the training loop's, which it does not hand out."""
    made: list[torch.optim.AdamW] = []
    init = torch.optim.AdamW.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(torch.optim.AdamW, "__init__", recording)
    yield made


def train_two_steps(session) -> tuple[object, list[str]]:
    from meshplan.session import train_session

    copies = HostCopies()
    with copies:
        summary = train_session(session, show_progress=False)
    return summary, copies.seen


def on_device(tensors) -> bool:
    return all(t.device.type == DEVICE for t in tensors)


def test_dp1_training_state_lives_on_the_device_and_no_weight_visits_the_host(tmp_path, monkeypatch):
    plan = write_plan(tmp_path, DP1_BF16)
    with process_group(real_backend()), adamw_instances(monkeypatch) as made:
        session = open_rank_session(plan, tmp_path / "run", 0, "--steps", "2")
        summary, copies = train_two_steps(session)
    assert summary.steps_done == 2 and all(map(torch.isfinite, map(torch.tensor, summary.losses)))
    assert on_device(session.program.parameters())
    (adamw,) = made
    assert adamw.defaults["fused"]  # one kernel over every tensor of the device
    assert on_device(t for state in adamw.state.values() for t in state.values())
    assert copies == []


def test_an_on_cpu_module_keeps_its_state_on_the_host_and_trains_as_without_it(tmp_path, monkeypatch):
    """`lm_head`/`embed_tokens: on cpu`: their weights and AdamW state in host memory, the rest of
    the rank's on the device; the only tensors that reach the host are the activations (and their
    gradients) at the modules' boundaries, never a weight; and the losses are those of the same run
    with everything on the device (fp32: the head's matmul on another processor, rounding apart)."""
    steps = ("--steps", "4", "--warmup", "1", "--batch", "4", "--seq", "32")
    from meshplan.session import train_session

    runs = {}
    with adamw_instances(monkeypatch) as made:
        for name, text in (("placed", ON_CPU), ("plain", "mesh dp=1\n")):
            with process_group(real_backend()):
                session = open_rank_session(
                    write_plan(tmp_path, text, f"{name}.plan"), tmp_path / name, 0, *steps
                )
                copies = HostCopies()
                with copies:
                    summary = train_session(session, show_progress=False)
            runs[name] = (session, summary, copies)
    adamw = made[0]  # the placed run's
    session, summary, copies = runs["placed"]
    params = dict(session.program.named_parameters())
    assert all(params[n].device.type == "cpu" for n in HOST)
    assert on_device(p for n, p in params.items() if n not in HOST)
    held = {n: adamw.state[p] for n, p in params.items()}
    assert all(t.device.type == "cpu" for n in HOST for t in held[n].values() if t.dim() > 0)
    assert on_device(t for n, state in held.items() if n not in HOST for t in state.values())
    weights = {tuple(p.shape) for p in params.values()}
    assert not weights & set(copies.shapes), copies.seen  # activations only: (4, 32), (4, 32, 64), ...
    if DEVICE == "cuda":
        assert copies.shapes, "the head's input and the embedding's gradient reach the host"
    placed, plain = runs["placed"][1].losses, runs["plain"][1].losses
    assert len(placed) == 4 and all(map(math.isfinite, placed))
    assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(placed, plain, strict=True)), (placed, plain)


def test_a_tp4_rank_trains_alone_on_the_device_under_the_fake_process_group(tmp_path):
    plan = write_plan(tmp_path, TP4)
    with process_group("fake", rank=1, world_size=4):
        session = open_rank_session(plan, tmp_path / "run", 1, "--steps", "2", "--model", MODEL_8_HEADS)
        summary, copies = train_two_steps(session)
    params = dict(session.program.named_parameters())
    assert params["layers.0.self_attn.q_proj.weight"].shape == (16, 64)  # 8 heads x 8 dims / 4 ranks
    assert params["layers.0.self_attn.k_proj.weight"].shape == (8, 64)  # 4 kv heads x 8 dims / 4
    assert params["embed_tokens.weight"].shape == (64, 64)  # 256 tokens / 4
    assert summary.steps_done == 2
    assert on_device(params.values())
    assert copies == []


@pytest.mark.parametrize("rank", [0, 3])  # the first stage of data rank 0, the last of data rank 1
def test_a_dp2_pp2_rank_runs_its_stage_on_the_device_under_the_fake_process_group(tmp_path, rank):
    """The stage alone, forward and backward, its neighbour's activation or gradient made here.

    Not the pipeline's message exchange: it learns the boundary's shapes from a header the
    neighbour sends, and under the fake process group nothing arrives."""
    plan = write_plan(tmp_path, DP2_PP2)
    with process_group("fake", rank=rank, world_size=4):
        session = open_rank_session(
            plan, tmp_path / "run", rank, "--steps", "2", "--batch", "2", "--seq", "16"
        )
    names = {name for name, _ in session.program.named_parameters()}
    assert ("embed_tokens.weight" in names) == (rank == 0)  # each rank holds its stage alone
    assert ("lm_head.weight" in names) == (rank == 3)
    assert on_device(session.program.parameters())
    input_ids, labels = (t.to(DEVICE) for t in session.batches(0, 0))
    (stage,) = pipeline_stages(session).values()
    # one microbatch's activation at the cut, in the compute dtype
    hidden = torch.randn(2, 16, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    copies = HostCopies()
    with copies:
        if rank == 0:
            (out,) = stage(input_ids[:2], labels[:2])
            out.backward(torch.randn_like(out))
            assert out.shape == hidden.shape and out.device.type == DEVICE
        else:
            loss = stage(input_ids[:2], labels[:2], hidden)
            loss = loss[0] if isinstance(loss, (tuple, list)) else loss
            loss.backward()
            assert hidden.grad is not None and hidden.grad.device.type == DEVICE
    assert copies.seen == []


def pipeline_stages(session) -> dict:
    """This rank's stage programs, by stage index (the session's pipeline step holds them)."""
    step = session.forward_backward.__closure__
    found = [c.cell_contents for c in step or () if hasattr(c.cell_contents, "stages")]
    assert found, "the session's micro-step holds its pipeline step"
    return found[0].stages
