"""`meshplan run` of the example MoE model with its experts over `ep` (minus torchrun:
tests/runs.py), against the same global batch on one process.

One launch checks several things at once: `mesh dp=2, ep=2` on 4 processes (the dense
gradients averaged over dp x ep, the experts' over dp), a checkpointed layer (its
all-to-alls run again in backward) and two accumulated micro-steps of one sequence per
rank. The one-process run trains the same 8 sequences per step: losses and gradient norms
(clipping active) must agree step by step, and the metrics count every routed token once.
Under ZeRO-2 the same run shards each parameter's optimizer state and gradient over the
ranks that average it (the dense ones over all four, an expert's over two); under ZeRO-1
with the experts over the only data axis, an expert's state stays whole on its one rank.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from runs import meshplan_run, metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = f"{ROOT}/examples/models/moe.py:build"
ADAM_BYTES = 8  # two fp32 moments per parameter (an fp32 parameter's shard is its own master)
STEPS, SEQ = 4, 16
EXPERT_PARALLEL = """mesh dp=2, ep=2

modules {
    layers.*.mlp.experts: experts over ep (top_k=2)
    layers.1:             checkpoint
}

data_parallel over dp {
    bucket = 64KB
}

train {
    gradient_accumulation = 2
}
"""


def run(tmp: Path, name: str, text: str, batch: int, *more: str) -> list[dict]:
    """Rank 0's records of `meshplan run` of `text` into the run folder `name` (the last
    --steps given wins: `more` may stop it early)."""
    (tmp / f"{name}.plan").write_text(text)
    argv = [str(tmp / f"{name}.plan"), "--model", MODEL, "--steps", str(STEPS), "--batch", str(batch)]
    argv += ["--seq", str(SEQ), "--warmup", "2", "--grad-clip", "0.5", "--out", str(tmp / name), *more]
    return meshplan_run(*argv)[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The unpartitioned model on one process, trained on the same 8 sequences per step."""
    return run(tmp_path_factory.mktemp("one"), "one", "mesh dp=1\n", batch=8)


def same_training(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), g["step"]


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_experts_over_ep_train_like_one_process(tmp_path: Path, one_process: list[dict], zero: int) -> None:
    plan = EXPERT_PARALLEL.replace("bucket = 64KB", f"bucket = 64KB\n    zero = {zero}")
    got = run(tmp_path, "ep", plan, batch=1)
    same_training(got, one_process)
    if zero:  # the dense params' state over 4 ranks, an expert's over the 2 of the 4 holding it
        n = model_params()
        memory = [r["zero_memory"] for r in got]
        assert [m["optimizer"] for m in memory] == pytest.approx([ADAM_BYTES * n / 4] * STEPS, rel=0.01)
        if zero == 3:  # after the step, a quarter of the fp32 parameters too
            assert [m["params"] for m in memory] == pytest.approx([4 * n / 4] * STEPS, rel=0.01)
    for record in got:  # every (token, slot) pair of the step's 8 sequences, once per layer
        load = record["expert_load"]
        assert sorted(load) == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
        assert all(sum(unit["tokens"]) == 8 * SEQ * 2 and unit["overload"] >= 1.0 for unit in load.values())


@pytest.mark.parametrize("zero", [1, 3])
def test_experts_over_the_only_data_axis_under_zero(
    tmp_path: Path, one_process: list[dict], zero: int
) -> None:
    """`mesh dp=2`, experts over dp: the dense state in halves, each rank's experts' state whole
    (and under ZeRO-3 the dense parameters in halves too, each rank's experts whole)."""
    plan = (
        "mesh dp=2\n\nmodules {\n    layers.*.mlp.experts: experts over dp\n}\n\n"
        f"data_parallel over dp {{\n    zero = {zero}\n}}\n\ntrain {{\n    gradient_accumulation = 2\n}}\n"
    )
    got = run(tmp_path, "ep_dp", plan, batch=2)
    same_training(got, one_process)
    # half the dense params' state, and the whole state of half the experts
    n = model_params()
    assert [r["zero_memory"]["optimizer"] for r in got] == pytest.approx(
        [ADAM_BYTES * n / 2] * STEPS, rel=0.01
    )
    if zero == 3:
        assert [r["zero_memory"]["params"] for r in got] == pytest.approx([4 * n / 2] * STEPS, rel=0.01)


def model_params() -> int:
    build = runpy.run_path(MODEL.removesuffix(":build"))["build"]
    return sum(p.numel() for p in build().parameters())


def test_a_zero_checkpoint_resumes_under_another_expert_layout(
    tmp_path: Path, one_process: list[dict]
) -> None:
    """Saved at step 2 by ZeRO-2 over dp x ep (every state cut in quarters), resumed by `mesh ep=4`
    under ZeRO-1 (each rank one expert, the dense state over ep): the layout-free checkpoint."""
    zero2 = EXPERT_PARALLEL.replace("bucket = 64KB", "bucket = 64KB\n    zero = 2")
    ep4 = (
        "mesh ep=4\n\nmodules {\n    layers.*.mlp.experts: experts over ep (top_k=2)\n    layers.1: checkpoint\n}"
        "\n\ndata_parallel over ep {\n    zero = 1\n}\n\ntrain {\n    gradient_accumulation = 2\n}\n"
    )
    first = run(tmp_path, "run", zero2, 1, "--steps", "2", "--save-every", "2")
    run(tmp_path, "run", ep4, 1, "--resume")
    resumed = metrics(tmp_path / "run")[0]  # the first two steps' records, then the resumed ones
    assert [r["step"] for r in first] == [1, 2]
    same_training(resumed, one_process)


def test_aux_loss_free_balancing_counts_the_whole_job(tmp_path: Path) -> None:
    """`--between-steps` calls the model's bias update after each step: every rank's token counts
    summed first, so the bias (which picks the experts) moves as on one device over all 8
    sequences, and stays the same on every rank (rank 0's is exported, and the losses agree)."""
    factory = f"{ROOT}/tests/cli/aux_free_moe.py"
    more = ["--model", f"{factory}:build", "--between-steps", f"{factory}:update_bias"]
    one = run(tmp_path, "one", "mesh dp=1\n", 8, *more, "--export", str(tmp_path / "one.pt"))
    ep = EXPERT_PARALLEL.replace("    layers.1:             checkpoint\n", "")  # it writes a buffer
    got = run(tmp_path, "ep", ep, 1, *more, "--export", str(tmp_path / "ep.pt"))
    same_training(got, one)
    want, have = (torch.load(tmp_path / f"{name}.pt") for name in ("one", "ep"))
    for layer in (0, 1):
        bias = f"layers.{layer}.mlp.expert_bias"
        assert want[bias].abs().min() > 0  # the update ran, and moved every expert's bias
        torch.testing.assert_close(have[bias], want[bias], rtol=1e-5, atol=1e-7)


def test_experts_split_over_tp_train_like_one_process_and_resume_whole(
    tmp_path: Path, one_process: list[dict]
) -> None:
    """`mesh ep=2, tp=2`: each expert's matrices split over `tp` inside the expert split over
    `ep` (the batch over ep only: 2 sequences per rank and micro-step), saved at step 2 as
    those pieces and resumed by dp=2 x ep=2 under ZeRO-2, where they are whole over tp."""
    tp = (
        "mesh ep=2, tp=2\n\nmodules {\n    layers.*.mlp.experts: experts over ep (top_k=2)\n"
        "    layers.*.mlp.experts.gate_up_proj: column over tp\n    layers.*.mlp.experts.down_proj: row over tp\n"
        "    layers.*.self_attn.{q,k,v}_proj: column over tp\n    layers.*.self_attn.o_proj: row over tp\n"
        "    layers.1: checkpoint\n}\n\ntrain {\n    gradient_accumulation = 2\n}\n"
    )
    zero2 = EXPERT_PARALLEL.replace("bucket = 64KB", "bucket = 64KB\n    zero = 2")
    first = run(tmp_path, "run", tp, 2, "--steps", "2", "--save-every", "2")
    run(tmp_path, "run", zero2, 1, "--resume")
    resumed = metrics(tmp_path / "run")[0]
    assert [r["step"] for r in first] == [1, 2]
    same_training(resumed, one_process)


def test_experts_borrowing_the_tensor_axis_train_like_one_process(
    tmp_path: Path, one_process: list[dict]
) -> None:
    """`mesh dp=2, tp=2`, `experts over tp`: attention split over tp with sequence-parallel norms,
    each tp rank holding half the experts and routing its sequence shard of the tokens. tp
    does not split the batch (2 sequences per rank and micro-step, 8 per step), and the load
    counts every rank's routed pairs once."""
    plan = (
        "mesh dp=2, tp=2\n\nmodules {\n    layers.*.mlp.experts: experts over tp (top_k=2)\n"
        "    layers.*.self_attn.{q,k,v}_proj: column over tp\n    layers.*.self_attn.o_proj: row over tp\n"
        "    layers.*.*_layernorm: sequence over tp\n    layers.1: checkpoint\n}\n\n"
        "data_parallel over dp {\n    zero = 1\n}\n\ntrain {\n    gradient_accumulation = 2\n}\n"
    )
    got = run(tmp_path, "ep_tp", plan, batch=2)
    same_training(got, one_process)
    for record in got:
        assert all(sum(unit["tokens"]) == 8 * SEQ * 2 for unit in record["expert_load"].values())


def test_experts_kept_as_a_list_train_like_one_process_and_export_as_a_list(
    tmp_path: Path, one_process: list[dict]
) -> None:
    """The example model with its experts as an `nn.ModuleList` its block loops over
    (`moe.build_listed`: the same weights as `moe.build`, so the same training as the one
    process of `moe.build`), under the dp=2 x ep=2 plan with ZeRO-2: it trains as one process
    does, counts every routed pair once, and its export loads into the user's model as it is
    written (the list's names, `experts.{e}.gate_proj.weight`)."""
    from meshplan.examples.models.moe import build_listed

    zero2 = EXPERT_PARALLEL.replace("bucket = 64KB", "bucket = 64KB\n    zero = 2")
    more = ["--model", f"{MODEL.removesuffix(':build')}:build_listed", "--export", str(tmp_path / "ep.pt")]
    got = run(tmp_path, "ep", zero2, 1, *more)
    same_training(got, one_process)
    for record in got:
        assert all(sum(unit["tokens"]) == 8 * SEQ * 2 for unit in record["expert_load"].values())
    model = build_listed()
    exported = torch.load(tmp_path / "ep.pt", weights_only=True)
    model.load_state_dict(exported, strict=True)
    name = "layers.0.mlp.experts.3.up_proj.weight"
    assert not torch.equal(exported[name], build_listed().state_dict()[name])  # this run's, trained


def test_experts_over_a_group_of_axes_train_like_one_process_and_resume_elsewhere(
    tmp_path: Path, one_process: list[dict]
) -> None:
    """`experts over dp x tp`: the 4 experts over all 4 ranks as one group (one expert each),
    attention split over tp with sequence-parallel norms, the batch over dp only (2 sequences
    per rank and micro-step). Trains as one process does, counts every routed pair once, and
    its checkpoint (each expert cut over dp, then tp) resumes under `mesh dp=2, ep=2`."""
    group = (
        "mesh dp=2, tp=2\n\nmodules {\n    layers.*.mlp.experts: experts over dp x tp (top_k=2)\n"
        "    layers.*.self_attn.{q,k,v}_proj: column over tp\n    layers.*.self_attn.o_proj: row over tp\n"
        "    layers.*.*_layernorm: sequence over tp\n    layers.1: checkpoint\n}\n\n"
        "data_parallel over dp {\n    zero = 2\n}\n\ntrain {\n    gradient_accumulation = 2\n}\n"
    )
    first = run(tmp_path, "run", group, 2, "--steps", "2", "--save-every", "2")
    for record in first:
        assert all(sum(unit["tokens"]) == 8 * SEQ * 2 for unit in record["expert_load"].values())
    zero2 = EXPERT_PARALLEL.replace("bucket = 64KB", "bucket = 64KB\n    zero = 2")
    run(tmp_path, "run", zero2, 1, "--resume")
    resumed = metrics(tmp_path / "run")[0]
    same_training(resumed, one_process)
