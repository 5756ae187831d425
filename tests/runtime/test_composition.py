"""Every composition of the axes that exist, on the example Llama (two layers), on dp=2 x tp=2 gloo processes.

The matrix: {TP, TP+SP} x ZeRO {0, 1, 2, 3} x {activation checkpointing, bf16 compute,
gradient accumulation}. Each cell is trained for a few AdamW steps through `meshplan run`'s
own worker setup (`session.open_session`, `train_session`) and compared with the unpartitioned model trained on
the whole global batch in the same process:

- fp32 cells (checkpointing, accumulation) against the eager model: losses and final
  parameters within float32 rounding (see `FP32_TOL`);
- bf16 cells against the same plan's precision policy on one rank (the plan with its mesh,
  tensor and data-parallel rules removed, compiled and run without any process group), so
  partitioning is the only difference. Losses agree within a fraction of a bf16 epsilon; a
  parameter, after AdamW (whose update is nearly sign(gradient) where gradients are noisy),
  may differ as much as bf16 rounding alone moves it: its distance to the one-rank bf16 run
  is measured in units of that run's distance to the fp32 model (see `BF16_YARDSTICK`).

All cells run in one spawn of four processes: starting processes and importing torch is most
of a cell's cost, so the 24 cells take about as long as a handful of separate tests. Each cell's
plan is compiled once (as `meshplan run`'s launcher compiles it) by one of the ranks, the cells
spread over them, and every rank loads it; cells whose reference is the same computation (the
eight bf16 cells, the fp32 cells of one global batch) share it: each rank trains it once.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from gloo_pool import spawn
from plans import llama_rules, llama_sequence
from reference import single_device_losses

from meshplan.compiler.lower import local_shard
from meshplan.options import parse
from meshplan.session import open_session, train_config, train_session

pytestmark = pytest.mark.slow

TENSOR, SEQUENCE = llama_rules(), llama_sequence()
EXTRAS = {
    "checkpoint": ("    layers.*: checkpoint every 2\n", ""),
    "bf16": ("", "precision {\n    compute = bf16\n}\n"),
    "accumulation": ("", "train {\n    gradient_accumulation = 2\n}\n"),
    "broken": ("", ""),
}
CELLS = [
    f"{tp}-zero{zero}-{extra}"
    for tp, zero, extra in itertools.product(
        ("tp", "tp_sp"), range(4), ("accumulation", "bf16", "checkpoint")
    )
]
BROKEN = "tp-zero1-broken"  # the row splits' forward all-reduce dropped: the check must fail
# The same program on other meshes of the same four ranks: axis order (the rank layout follows
# the plan's order, so here tp groups are {0,2} {1,3}) and an axis of size one in the middle.
MESHES = {"tp_first": "tp=2, dp=2", "three_axes": "dp=2, cp=1, tp=2"}
MESH_CELLS = {
    "tp_sp-zero2-accumulation-tp_first": "tp_sp-zero2-accumulation",
    "tp-zero3-checkpoint-three_axes": "tp-zero3-checkpoint",
}

STEPS, MICRO_BATCH, SEQ, CLIP, DP = 3, 2, 32, 0.5, 2
RUN_FLAGS = ("--steps", str(STEPS), "--warmup", "1", "--grad-clip", str(CLIP))
# The example Llama with two layers (its other sizes as they are): every rule still has a
# layer it applies to and one beside it (`checkpoint every 2` recomputes layer 0, not layer 1),
# at half the compile time of its four; 27 cells are compiled.
MODEL = """
from meshplan.examples.models.llama import build as _build, example_inputs  # its inputs too


def build():
    return _build(num_hidden_layers=2)
"""

# float32: the partitioned program sums the same terms in another order (matmuls split over tp,
# gradients summed over dp in buckets), a relative error of a few float32 epsilons per
# reduction; AdamW's division by sqrt(v) and three steps of compounding make it a few hundred
# epsilons on the parameters at most. A wrong program (a dropped reduction, a wrong shard) is
# off by 1e-2 or more.
FP32_TOL = 400 * torch.finfo(torch.float32).eps  # 4.8e-5
# bf16: the loss is computed in fp32 from bf16 logits, so its error is a fraction of one bf16
# epsilon (2**-8). Partitioning rounds activations at other points (a row split's partial sums
# are rounded to bf16 before they are reduced, as in Megatron): one more bf16 rounding of the
# size the yardstick measures. Over the whole model the drift stays within twice the
# yardstick; a single tensor, a noisy sample of it, within `BF16_TENSOR_YARDSTICK` times (how
# noisy depends on the CPU's bf16 matmul: a norm weight's sample stayed under 6 on the CPUs
# this was first run on, and was 6.04 on an AMD EPYC). A bug (a lost reduction, a wrong
# shard) is off by orders of magnitude, and moves the loss.
BF16_LOSS_TOL = torch.finfo(torch.bfloat16).eps / 4
BF16_YARDSTICK = 2.0
BF16_TENSOR_YARDSTICK = 10.0


def plan_text(cell: str) -> str:
    tp, zero, extra, *mesh = cell.split("-")
    modules, blocks = EXTRAS[extra]
    rules = TENSOR + (SEQUENCE if tp == "tp_sp" else "") + modules
    axes = MESHES[mesh[0]] if mesh else f"dp={DP}, tp=2"
    text = f"mesh {axes}\n\nmodules {{{rules}}}\n\ndata_parallel over dp {{\n    zero = {zero[-1]}\n}}\n"
    return text + blocks


def one_rank_plan_text(cell: str) -> str:
    """The cell's precision policy alone: the unpartitioned model as the plan would run it."""
    extra = cell.split("-")[2]
    return "mesh dp=1\n\n" + EXTRAS[extra][1]


def model_spec(tmp: Path) -> str:
    return f"{tmp / 'model.py'}:build"


def compile_cell(world_size: int, tmp: Path, cell: str) -> None:
    """The cell's program, compiled as `meshplan run`'s launcher compiles it, for every rank to load."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.executable import save_executable, to_executable
    from meshplan.compiler.load import load_model
    from meshplan.dsl import load_plan

    plan_path = tmp / f"{cell}.plan"
    plan_path.write_text(plan_text(cell))
    shaped = with_token_shape(load_model(model_spec(tmp)), batch=MICRO_BATCH, seq=SEQ)
    plan = load_plan(plan_path, world_size=world_size)
    compiled = compile_plan(plan, shaped, world_size=world_size, dynamic=False)
    save_executable(to_executable(compiled), tmp / f"{cell}.program.pt")


# (precision policy, global batch, training config) -> what `reference` returns, per process
_REFERENCES: dict[tuple[str, int, str], tuple[list[float], dict, dict | None]] = {}


def reference(
    tmp: Path, rank: int, cell: str, model: str, cfg, global_batch: int
) -> tuple[list[float], dict, dict | None]:
    """`cell`'s reference, trained on one device on the whole global batch: its losses, its
    parameters, and for a bf16 cell the parameters of the fp32 model trained the same way (the
    yardstick), else None. Cells whose reference is the same computation share one."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model
    from meshplan.compiler.lower import build_rank_program
    from meshplan.dsl import load_plan

    key = (one_rank_plan_text(cell), global_batch, repr(dataclasses.replace(cfg, run_dir=Path())))
    if key in _REFERENCES:
        return _REFERENCES[key]
    source = load_model(model)
    full_params = dict(source.model.named_parameters())
    if cell.endswith("bf16"):
        one = tmp / f"{cell}.rank{rank}.plan"
        one.write_text(one_rank_plan_text(cell))
        shaped = with_token_shape(source, batch=global_batch, seq=SEQ)
        program = build_rank_program(compile_plan(load_plan(one, world_size=1), shaped), shaped.model, 0)
        model_run: torch.nn.Module = _LossOnly(program)
        ref_params = dict(program.named_parameters())
        single_device_losses(source.model, cfg, batch=global_batch, seq=SEQ, clip=CLIP)  # fp32 yardstick
    else:
        model_run = source.model
        ref_params = full_params
    ref_losses = single_device_losses(model_run, cfg, batch=global_batch, seq=SEQ, clip=CLIP)
    _REFERENCES[key] = ref_losses, ref_params, full_params if ref_params is not full_params else None
    return _REFERENCES[key]


def run_cell(rank: int, world_size: int, tmp: Path, cell: str) -> dict:
    from meshplan.compiler.executable import load_executable

    plan_path, program_path = tmp / f"{cell}.plan", tmp / f"{cell}.program.pt"
    options = parse(
        [
            str(plan_path),
            "--program",
            str(program_path),
            "--batch",
            str(MICRO_BATCH),
            "--seq",
            str(SEQ),
            "--model",
            model_spec(tmp),
            "--out",
            str(tmp / cell),
            *RUN_FLAGS,
        ]
    )
    prepared = open_session(options, rank, world_size)
    if cell == BROKEN:
        prepared.program.all_reduce_tp.forward = lambda x: x  # each rank keeps its partial sums
    summary = train_session(prepared, show_progress=False)
    cfg = train_config(prepared)
    global_batch = DP * MICRO_BATCH * prepared.accumulation
    ref_losses, ref_params, fp32_params = reference(tmp, rank, cell, options.model, cfg, global_batch)

    compiled = load_executable(program_path)  # the placements the ranks ran with
    coords = compiled.layout.coords(rank)
    worst, worst_name = 0.0, ""
    drift = yard = 0.0  # bf16: squared distances to the one-rank run, and of that run to fp32
    gathered = prepared.dp.gathered() if hasattr(prepared.dp, "gathered") else _nothing()
    with gathered:
        for name, local in prepared.program.named_parameters():
            if name.endswith("k_proj.bias"):
                continue  # softmax cancels it: its gradient is rounding noise, which Adam scales up
            placement = compiled.param_placements.get(name, {})
            expected = local_shard(ref_params[name].detach(), placement, coords, compiled.layout)
            diff = float((local.detach() - expected).norm() / expected.norm())
            if fp32_params is not None:  # bf16: in units of bf16's own distance to fp32
                fp32 = local_shard(fp32_params[name].detach(), placement, coords, compiled.layout)
                yardstick = float((expected - fp32).norm() / expected.norm())
                drift, yard = drift + diff**2, yard + yardstick**2
                diff /= max(yardstick, FP32_TOL)
            if diff > worst:
                worst, worst_name = diff, name
    return {
        "losses": summary.losses,
        "ref_losses": ref_losses,
        "worst": worst,
        "worst_name": worst_name,
        "drift": (drift / yard) ** 0.5 if yard else 0.0,
    }


class _LossOnly(torch.nn.Module):
    """A compiled program called like the model: (input_ids, labels) -> the scalar loss."""

    def __init__(self, program: torch.nn.Module):
        super().__init__()
        self.program = program

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.program(input_ids, labels)
        return out[0] if isinstance(out, (tuple, list)) else out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def worker(rank: int, world_size: int, tmp: str) -> dict[str, dict]:
    cells = [*CELLS, *MESH_CELLS, BROKEN]
    for cell in cells[rank::world_size]:  # each compiled once, by one rank
        compile_cell(world_size, Path(tmp), cell)
    torch.distributed.barrier()
    return {cell: run_cell(rank, world_size, Path(tmp), cell) for cell in cells}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, dict]]:
    tmp = tmp_path_factory.mktemp("composition")
    (tmp / "model.py").write_text(MODEL)
    return spawn(worker, 4, (str(tmp),), timeout_s=900)


def problems(r: dict, *, bf16: bool) -> list[str]:
    """What makes one rank's result differ from one device by more than rounding."""
    out = [
        f"step {step} loss {loss:.6f} vs {ref:.6f}"
        for step, (loss, ref) in enumerate(zip(r["losses"], r["ref_losses"], strict=True))
        if abs(loss - ref) / ref > (BF16_LOSS_TOL if bf16 else FP32_TOL)
    ]
    if r["worst"] > (BF16_TENSOR_YARDSTICK if bf16 else FP32_TOL):
        out.append(f"{r['worst_name']} off by {r['worst']:.3g}")
    if r["drift"] > BF16_YARDSTICK:
        out.append(f"parameters drift {r['drift']:.3g} yardsticks")
    return out


@pytest.mark.parametrize("cell", CELLS)
def test_cell_matches_one_device(results, cell: str) -> None:
    for rank, by_cell in enumerate(results):
        assert problems(by_cell[cell], bf16=cell.endswith("bf16")) == [], (rank, by_cell[cell])


@pytest.mark.parametrize("cell", MESH_CELLS)
def test_axis_order_and_unit_axes_change_nothing(results, cell: str) -> None:
    """Another order of the same axes, or an extra axis of size one, trains the same model: it
    matches one device, and its losses are the dp=2 x tp=2 cell's up to float32 rounding."""
    for rank, by_cell in enumerate(results):
        r, same = by_cell[cell], by_cell[MESH_CELLS[cell]]
        assert problems(r, bf16=False) == [], (rank, r)
        assert r["losses"] == pytest.approx(same["losses"], rel=FP32_TOL), rank


def test_a_broken_program_fails_the_same_check(results) -> None:
    for by_cell in results:
        assert problems(by_cell[BROKEN], bf16=False)
