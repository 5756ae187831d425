"""`meshplan verify`: train a plan's program on its ranks beside the unpartitioned model, and tell
rounding from bugs (importable as `meshplan.verify`).

    meshplan verify examples/llama_tp.plan --model examples/models/llama.py:build
    meshplan verify my.plan --model hf.py:build --steps 3 --batch 2 --seq 32

Three trainings on the same batches of random token ids (over the whole vocabulary), each with
`meshplan run`'s own loop (`runtime/train.py`: AdamW, LR schedule, clipping, accumulation, loss
scaling):

- **partitioned**: the real program on as many gloo processes as the mesh has ranks: compiled
  once before they start and loaded by each, as `meshplan run`'s launcher and workers do
  (`session.open_session`), its weights consolidated as `run --export` writes them;
- **reference**: the unpartitioned model in float64 (complex tensors in complex128); under an
  experts rule with a `capacity_factor`, its experts drop the pairs that rule drops
  (`capacity_applied`: the routing weights of the pairs over capacity multiplied by 0), and
  with a `z_loss` its routers' z-losses are added to its loss (`z_loss_applied`). A list of
  experts with a capacity hands each expert its rows in the model's own loop, where nothing
  says which pair a row is: the reference is then the plan's one-device program (below)
  compiled from the float64 model, whose experts unit drops them;
- **yardstick**: the unpartitioned model as the plan computes it on one device (fp32 master
  weights, the plan's precision policy and nothing else): rounding alone.

A correct program differs from the reference by rounding, as the yardstick does. AdamW divides
by the square root of tiny second moments and amplifies rounding, so no fixed tolerance separates
a correct float32 plan from a broken one; the yardstick's own distance to float64 does. The
program passes when, for the losses, the gradient norms and the whole model's weights, its
distance to the reference is within `--tolerance` times the yardstick's, and within
`TENSOR_FACTOR` times that for every single weight tensor. One tensor's rounding is a noisy
sample (GPT-2's first attention projection: 1.1e-6 from float64 on one thread, 4.2e-6 on two),
so the yardstick is trained a second time from weights one float32 rounding away, and a
tensor's yardstick distance is the larger of the two samples; so is the whole model's (an
element whose first gradient cancels to within rounding of zero, below Adam's eps, moves by
lr x its rounding / eps, in whichever run rounding picks). Gradient norms after the first
step are computed from weights that already carry Adam's amplified rounding, so their floor,
like a tensor's, is the yardstick's distance in the whole model's weights. Under 16-bit compute
a tensor's distance leaves out one element that rounding sent the other way (`adam_flip`). A
dropped reduction or a wrong shard is off by orders of magnitude.

An op PyTorch has here only in lower precision is computed in the reference by a float64
stand-in held to its kernel (`float64_kernels.py`: `torch._grouped_mm`, the grouped matmul of
Hugging Face's MoE experts). A model that still cannot run in float64 is compared with the
yardstick instead, against fixed bounds (`FALLBACK`), and verify says so.

A plan that compresses its gradients (`compress`) is lossy on purpose: it is held to the
convergence of the same plan trained uncompressed instead (`verify_lossy.py`), and the report
says so.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshplan.batches import token_batches, whole_job_batches
from meshplan.float64_kernels import float64_kernels
from meshplan.verify_lossy import LOSS_MARGIN, convergence_measures, uncompressed_job
from meshplan.verify_measure import (  # noqa: F401  (verify's constants, read by the tests)
    FALLBACK,
    FLOOR,
    TENSOR_FACTOR,
    Measure,
    Trajectory,
    adam_flip,
    measure,
    relative,
)

if TYPE_CHECKING:
    from meshplan.runtime.data import CallBatch

__all__ = ["token_batches", "verify", "whole_job_batches"]

EXIT_OK, EXIT_MISMATCH = 0, 1  # a mismatch is a program meshplan got wrong: its bug, not the user's


@dataclass(frozen=True)
class Job:
    """What every rank and the references train on."""

    plan: str
    model: str
    steps: int
    batch: int
    seq: int
    lr: float
    grad_clip: float  # 0: no clipping
    seed: int
    vocab: int  # token ids are drawn from [0, vocab)
    out: str
    microbatches: int = 1  # a pipeline's micro-step: this many batches of `batch` sequences
    program: str = ""  # the compiled program every rank loads (`meshplan run --program`)
    between_steps: str = ""  # `run --between-steps`: the model's update after each step
    init: str | None = None  # `run --init`: pretrained weights every rank and the references start from
    # a model that takes no token ids: its example call, drawn afresh for every micro-batch
    example: CallBatch | None = None


# what `meshplan verify` takes from its command line and every rank's `meshplan run` options
# get from the job: the training settings, under the same names all the way
_TRAINING_SETTINGS = ("steps", "batch", "seq", "lr", "grad_clip", "seed", "init")


def _training_settings(source: Any) -> dict[str, Any]:
    """The training settings of `source` (parsed arguments, a `Job`), by name."""
    return {name: getattr(source, name) for name in _TRAINING_SETTINGS}


@dataclass(frozen=True)
class Report:
    job: Job
    world_size: int
    reference: Trajectory
    partitioned: Trajectory
    yardstick: Trajectory | None
    measures: list[Measure]
    float64: bool  # False: the model could not run in float64; compared with the yardstick
    why_not_float64: str = ""
    # the model decides by comparing values (a router's top-k): rounding can flip a near-tie
    routes: bool = False
    flip: float = 0.0  # > 0: a tensor's distance leaves out one Adam sign flip (`adam_flip`)
    lossy: str = ""  # the compression held to the uncompressed run's convergence (`verify_lossy.py`)
    optimizer: str = "AdamW"  # the plan's, as `OptimizerChoice.title` names it: every run steps it

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.measures)


# ---------------------------------------------------------------------------- the partitioned run


def _rank(rank: int, world_size: int, job: Job):
    """One rank of the partitioned program, set up and trained exactly as `meshplan run` does."""
    import torch

    from meshplan.options import RunOptions
    from meshplan.session import consolidated_state, open_session, train_config, train_session

    options = RunOptions(
        job.plan,
        model=job.model,
        warmup=1,
        out=str(Path(job.out) / "partitioned"),
        program=job.program or None,
        between_steps=job.between_steps or None,
        **_training_settings(job),
    )
    prepared = open_session(options, rank, world_size)
    dp_rank, dp_size = prepared.axes.data_rank, prepared.axes.data_size
    batches = token_batches(job, dp_rank=dp_rank, dp_size=dp_size, accumulation=prepared.accumulation)
    prepared = replace(prepared, batches=batches)
    summary = train_session(prepared, show_progress=False)
    weights = consolidated_state(prepared)
    if rank != 0:
        return None
    # through a file: tensors sent back through the result queue would outlive their process
    torch.save(weights, Path(job.out) / "partitioned.pt")
    return summary.losses, summary.grad_norms, train_config(prepared), dp_size


# ---------------------------------------------------------------------------- the unpartitioned runs


def _train_one_device(
    model, loss_of, job: Job, config, dp_size: int, name: str, between_steps: Callable | None = None
) -> Trajectory:
    """`model` trained by `runtime.train.train` on one process, on every rank's micro-batches;
    `between_steps()` after each step (the model's own update, `--between-steps`)."""
    from meshplan.runtime.train import train

    one = replace(
        config,
        accumulation=dp_size * config.accumulation * job.microbatches,
        run_dir=Path(job.out) / name,
        save_every=0,
    )
    batches = whole_job_batches(job, dp_size=dp_size, accumulation=config.accumulation)
    summary = train(model, loss_of, batches, one, between_steps=between_steps)
    return Trajectory(summary.losses, summary.grad_norms, _named_weights(model))


def _named_weights(module) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


def _one_rounding_away(module, start: dict[str, Any], seed: int) -> None:
    """Set `module`'s weights to `start`, each element moved by one float32 rounding (a relative
    2^-23, up or down at random): the yardstick run from there differs from the first only
    by how far training carries a rounding, which is what a tensor's floor must measure."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            sign = torch.randint(0, 2, p.shape, generator=generator).to(p.dtype) * 2 - 1
            p.copy_(start[name] * (1 + sign * 2.0**-23))


def _eager_loss(model, source, dtype=None) -> Callable:
    """The model's own forward, called as `run` calls the program; float inputs cast to `dtype`."""
    from meshplan.compiler.graph import find_loss
    from meshplan.session import call_inputs

    def cast(x):
        return (
            x.to(dtype)
            if dtype is not None and hasattr(x, "is_floating_point") and x.is_floating_point()
            else x
        )

    def loss_of(input_ids, labels):
        args, kwargs = call_inputs(source.args, source.kwargs, input_ids, labels)
        out = model(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})
        return find_loss(out)

    return loss_of


def _one_device_program(plan, source, precision: bool = True, captured=None):
    """The plan's precision policy alone (`precision=False`: not even that), compiled for one
    rank: the unpartitioned model as the plan computes it. Returns (program, loss_of).
    `captured`: the plan's own capture (`Compiled.captured`), taken instead of capturing the
    model again where it is what this compile would capture (the same compute dtype and experts
    units); else None."""
    from meshplan.compiler.capture import bind_inputs
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.graph import find_loss
    from meshplan.compiler.lower import build_rank_program
    from meshplan.compiler.passes.experts.capacity import capacity_factor
    from meshplan.compiler.passes.experts.router_loss import z_loss_of
    from meshplan.compiler.passes.experts.units import expert_modules
    from meshplan.dsl.axes import MeshSpec
    from meshplan.dsl.settings import PrecisionSpec
    from meshplan.runtime.expert_list import stacked_lists
    from meshplan.session import call_inputs

    mesh = MeshSpec(tuple(replace(a, size=1) for a in plan.mesh.axes), plan.mesh.span)
    # experts rules stay: over one rank their unit runs the model's experts module whole, which
    # export may not capture itself (Mixtral's eager loop); not for a list of experts, whose
    # parent's loop export captured: without the rule the yardstick is that loop, not the unit
    # (unless the rule adds a z-loss or drops pairs, which the yardstick must do too)
    lists = set(stacked_lists(source.model))
    governed = expert_modules(plan, source.model)
    experts = tuple(
        r
        for r in plan.rules_of("experts")
        if z_loss_of(r) is not None
        or capacity_factor(r) is not None
        or not {p for p, w in governed.items() if w is r} <= lists
    )
    rules = (plan.rules_of("dtype") if precision else ()) + experts
    alone = replace(plan, mesh=mesh, rules=rules, pipeline=None, data_parallel=None)
    if not precision:  # the model's own dtype (float64, for the reference): no policy at all
        alone = replace(alone, precision=PrecisionSpec())
    # the plan's capture serves where the capture would be the same: the same compute dtype and
    # the same experts rules (which experts modules run as units)
    same = precision and experts == plan.rules_of("experts")
    compiled = compile_plan(  # it runs the job's one shape
        alone, source, world_size=1, dynamic=False, captured=captured if same else None
    )
    program = build_rank_program(compiled, source.model, 0)

    def loss_of(input_ids, labels):
        args, kwargs = call_inputs(source.args, source.kwargs, input_ids, labels)
        return find_loss(program(*bind_inputs(source.model, compiled.graph, args, kwargs)))

    return program, loss_of


# ---------------------------------------------------------------------------- the command


def verify(
    plan_path: str,
    model_spec: str,
    *,
    world_size: int | None = None,
    steps: int = 3,
    batch: int = 2,
    seq: int | None = None,
    lr: float = 1e-3,
    grad_clip: float = 1.0,
    seed: int = 0,
    tolerance: float = 4.0,
    timeout_s: float = 900.0,
    worker: Callable = _rank,
    between_steps: str = "",
    init: str | None = None,
) -> Report:
    """Check, compile, train the three ways, compare. Plan and model mistakes raise `PlanError`
    or `CompileError` (located, before any process starts). `worker(rank, world_size, job)`
    trains one rank (tests pass a broken one to see verify fail). `seq`: 32 by default; given for
    a model whose inputs have no sequence, it is refused."""
    import torch

    from meshplan.batches import example_batch
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.executable import PROGRAM, save_executable, to_executable
    from meshplan.compiler.load import load_function, load_model
    from meshplan.compiler.materialize import is_meta, materialize_model
    from meshplan.compiler.passes.experts.capacity import capacity_applied, capacity_lists
    from meshplan.compiler.passes.experts.router_loss import z_loss_applied, z_loss_units
    from meshplan.compiler.passes.precision import cast_floating
    from meshplan.compiler.pretrained import InitError, load_whole
    from meshplan.dsl import load_plan
    from meshplan.errors import RunError
    from meshplan.pretrained import open_init
    from meshplan.runtime.axes import Axes
    from meshplan.runtime.launch import spawn
    from meshplan.session import between_steps_hook, check_supported, pipeline_microbatches

    plan = load_plan(plan_path, world_size=world_size)
    world = plan.mesh.world_size
    if world is None:
        raise RunError(f"{plan_path}: the mesh has a `*` axis; pass --world-size N to size it")
    check_supported(plan)
    torch.manual_seed(seed)  # the ranks build the model from the same seed: the same weights
    source = with_token_shape(load_model(model_spec), batch=batch, seq=seq or 32, seq_asked=seq is not None)
    example = example_batch(source)  # None: the model takes token ids
    seq = 1 if example is not None else seq or 32
    if is_meta(source.model):  # the whole model for the reference: what every rank takes its pieces of
        materialize_model(source.model, seed)
    if init:  # checked key by key before any rank starts, then read whole for the references
        try:
            load_whole(source.model, open_init(init))
        except InitError as e:
            raise RunError(str(e)) from None
    if between_steps:  # said before any process starts: a missing function
        load_function(between_steps, "--between-steps")
    # every refusal, before processes start; for the job's one shape (as `run` compiles)
    compiled = compile_plan(plan, source, world_size=world, dynamic=False)
    draws = random_draws(compiled.graph)
    routes = decides(compiled.graph)
    if draws:
        shown = ", ".join(f"{op} in {where}" for where, op in draws[:3])
        more = f" and {len(draws) - 3} more" if len(draws) > 3 else ""
        raise RunError(
            f"{model_spec}: the model draws random numbers while it trains ({shown}{more}): the "
            "partitioned program and one device draw different ones, so their numbers cannot be "
            "compared\nhint: verify the model built with its dropout at 0 (a Hugging Face config's "
            "`*_pdrop`, `*_dropout` = 0.0); meshplan run trains it with dropout as it is"
        )
    vocab = token_range(compiled, source)

    with tempfile.TemporaryDirectory(prefix="meshplan-verify-") as out:
        micro = pipeline_microbatches(plan, compiled.layout)
        # every rank loads the program compiled above instead of compiling it again, as the ranks
        # of `meshplan run` load the launcher's
        program = Path(out) / PROGRAM
        save_executable(to_executable(compiled), program)
        job = Job(
            plan_path,
            model_spec,
            steps,
            batch,
            seq,
            lr,
            grad_clip,
            seed,
            vocab,
            out,
            micro,
            str(program),
            between_steps,
            init,
            example,
        )
        losses, grad_norms, config, dp_size = spawn(worker, world, (job,), timeout_s=timeout_s)[0]
        partitioned = Trajectory(losses, grad_norms, torch.load(Path(out) / "partitioned.pt"))
        if plan.data_parallel is not None and plan.data_parallel.compress is not None:

            def compile_program(path: Path, folder: Path) -> Path:
                again = replace(source, model=copy.deepcopy(source.model))
                compiled = compile_plan(
                    load_plan(path, world_size=world), again, world_size=world, dynamic=False
                )
                save_executable(to_executable(compiled), folder / PROGRAM)
                return folder / PROGRAM

            plain = uncompressed_job(job, plan, compile_program)
            losses, grad_norms, _, _ = spawn(worker, world, (plain,), timeout_s=timeout_s)[0]
            reference = Trajectory(losses, grad_norms, torch.load(Path(plain.out) / "partitioned.pt"))
            measures = convergence_measures(partitioned, reference)
            compress = plan.data_parallel.compress.text
            return Report(
                job,
                world,
                reference,
                partitioned,
                None,
                measures,
                False,
                lossy=compress,
                optimizer=config.optimizer.title,
            )

        def one_device(model, loss_of, name, update=None):
            return _train_one_device(model, loss_of, job, config, dp_size, name, update)

        float64 = cast_floating(copy.deepcopy(source.model), torch.float64)
        yard_source = replace(source, model=copy.deepcopy(source.model))
        program, yard_loss = _one_device_program(plan, yard_source, captured=compiled.captured)
        # the model's update between steps, on the program's buffers (one device: nothing to sum)
        update = (
            between_steps_hook(between_steps, program, [program], yard_source.model, Axes())
            if between_steps
            else None
        )
        start, buffers = _named_weights(program), {n: b.clone() for n, b in program.named_buffers()}
        yardstick = one_device(program, yard_loss, "yardstick", update)
        _fill_tied(yardstick.weights, source.model)
        _one_rounding_away(program, start, seed)  # a second sample of rounding, for each tensor
        with torch.no_grad():  # from the same buffers (token counts, an expert bias)
            for name, b in program.named_buffers():
                b.copy_(buffers[name])
        spread = one_device(program, yard_loss, "yardstick-perturbed", update)
        _fill_tied(spread.weights, source.model)
        stand_ins = float64_kernels()
        try:
            # the model as the plan's capacity rules make it drop (the yardstick's unit drops
            # alike), its routers' z-losses (`z_loss`) added to its loss as the program adds them;
            # kernels without a float64 one here computed by their float64 stand-ins
            stand_ins.__enter__()
            if capacity_lists(plan, source.model):  # which pair a row is: the unit's graph knows
                ref_program, ref_loss = _one_device_program(plan, replace(source, model=float64), False)
                hook = (
                    between_steps_hook(between_steps, ref_program, [ref_program], float64, Axes())
                    if between_steps
                    else None
                )
                reference = one_device(ref_program, ref_loss, "reference", hook)
                _fill_tied(reference.weights, source.model)
            else:
                eager = _eager_loss(float64, source, torch.float64)
                own = load_function(between_steps, "--between-steps") if between_steps else None
                with (
                    capacity_applied(plan, float64),
                    z_loss_applied(z_loss_units(compiled.graph), float64) as z,
                ):
                    reference = one_device(
                        float64,
                        lambda ids, labels: eager(ids, labels) + z(),
                        "reference",
                        (lambda: own(float64)) if own is not None else None,
                    )
            why_not = ""
        except (RuntimeError, NotImplementedError) as e:  # no float64 kernel for an op here
            reference, why_not = yardstick, str(e).strip().splitlines()[0]
        finally:
            stand_ins.__exit__(None, None, None)
    has_yardstick = not why_not
    flip = adam_flip(plan.precision.compute, lr, steps)
    measures = measure(
        partitioned,
        reference,
        yardstick if has_yardstick else None,
        tolerance,
        spread if has_yardstick else None,
        flip,
    )
    return Report(
        job,
        world,
        reference,
        partitioned,
        yardstick if has_yardstick else None,
        measures,
        has_yardstick,
        why_not,
        routes,
        flip,
        optimizer=config.optimizer.title,
    )


def _fill_tied(weights: dict[str, Any], model) -> None:
    """Give a tied weight every name the model has for it (a program holds it under one)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        held = next((weights[n] for n in group if n in weights), None)
        if held is not None:
            weights.update({n: held for n in group if n not in weights})


_RANDOM = (
    "bernoulli", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like",
    "randperm", "multinomial", "normal", "uniform", "exponential",
)  # fmt: skip
_DROPOUT = ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")


def decides(gm) -> bool:
    """Whether the program chooses by comparing values (a router's top-k, an argmax), where
    rounding alone can flip a near-tie."""
    import torch

    aten = torch.ops.aten
    ops = (aten.topk, aten.argmax, aten.argmin, aten.sort, aten.argsort)
    return any(getattr(n.target, "_overloadpacket", None) in ops for n in gm.graph.nodes)


def random_draws(gm) -> list[tuple[str, str]]:
    """(module path, op) of each node of the captured program that draws random numbers when
    it trains: dropout with p > 0, attention with dropout_p > 0, sampling ops."""
    from meshplan.compiler.graph import module_path

    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")
        name = name.removesuffix("_")
        if name in _DROPOUT:
            p, train = [*node.args[1:3], True, True][:2]
            random = bool(train) and p != 0
        elif name == "scaled_dot_product_attention":
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            random = p != 0
        else:
            random = name in _RANDOM
        if random:
            out.append((module_path(node) or "the model", f"aten.{name}"))
    return out


def token_range(compiled, source) -> int:
    """The vocabulary the token ids are drawn from: rows of the embedding the input ids index
    (the smallest, if several), else the model's `config.vocab_size`, else one past the largest
    id in the model's example inputs."""
    import torch

    graph = compiled.captured.graph_module.graph
    placeholders = {n for n in graph.nodes if n.op == "placeholder"}
    rows = []
    for node in graph.nodes:
        if node.target is torch.ops.aten.embedding.default and _comes_from(node.args[1], placeholders):
            rows.append(int(node.args[0].meta["val"].shape[0]))
    if rows:
        return min(rows)
    vocab = getattr(getattr(source.model, "config", None), "vocab_size", None)
    if vocab:
        return int(vocab)
    ids = [
        x
        for x in (*source.args, *source.kwargs.values())
        if isinstance(x, torch.Tensor) and not x.is_floating_point()
    ]
    return max((int(x.max()) + 1 for x in ids), default=2)


def _comes_from(node, sources: set) -> bool:
    """Whether `node` is one of `sources` or computed from one through single-input ops (views).
    A size read from a source (`sym_size`: the positions `arange(seq)` of a symbolic sequence)
    is not its values."""
    import torch

    while node not in sources:
        inputs = [a for a in node.all_input_nodes]
        if len(inputs) != 1 or node.target is torch.ops.aten.sym_size.int:
            return False
        node = inputs[0]
    return True


def cmd_verify(args: argparse.Namespace) -> int:
    """Entry of `meshplan verify`."""
    from meshplan.args import given

    settings = _training_settings(args) | {"seq": args.seq if given(args.seq) else None}
    report = verify(
        args.plan,
        args.model,
        world_size=args.world_size,
        tolerance=args.tolerance,
        between_steps=args.between_steps or "",
        **settings,
    )
    print(render(report))
    return EXIT_OK if report.ok else EXIT_MISMATCH


def render(report: Report) -> str:
    job = report.job
    lines = [
        f"verify {job.plan} on {report.world_size} rank{'s' * (report.world_size != 1)}: {job.steps} steps "
        f"of `meshplan run`'s {report.optimizer} "
        f"({f'clipped at {job.grad_clip:g}' if job.grad_clip else 'no clipping'}), "
        + (
            f"{job.batch} x {job.seq} random token ids (< {job.vocab})"
            if job.example is None
            else f"{job.batch} random samples drawn like the model's example inputs"
        )
        + " per rank and "
        + (
            f"microbatch, {job.microbatches} microbatches per micro-step"
            if job.microbatches > 1
            else "micro-step"
        ),
    ]
    if report.lossy:
        lines.append(f"  reference  the same plan without `compress = {report.lossy}`, on its ranks")
        lines.append(
            f"  yardstick  convergence: compression is lossy, so each step's loss is held within "
            f"{LOSS_MARGIN:.0%} of the uncompressed run's, not to float64 parity"
        )
    elif report.float64:
        lines.append("  reference  the unpartitioned model in float64")
        lines.append(
            "  yardstick  the unpartitioned model as the plan computes on one device: rounding alone"
        )
    else:
        lines.append(f"  the model does not run in float64 here ({report.why_not_float64})")
        lines.append("  reference  the unpartitioned model as the plan computes on one device; fixed bounds")
    if report.flip:
        lines.append(
            f"  16-bit compute: a tensor's distance leaves out its one element farthest off if that is "
            f"within {report.flip:.1e} (an Adam step turned by rounding)"
        )
    lines.append("")
    lines.append(f"  {'step':>4}  {'loss':>12}  {'partitioned':>12}  {'diff':>9}")
    for step, (ref, mine) in enumerate(zip(report.reference.losses, report.partitioned.losses, strict=True)):
        lines.append(f"  {step + 1:>4}  {ref:>12.6f}  {mine:>12.6f}  {relative(mine, ref):>9.2e}")
    lines.append("")
    title = "relative distance to the reference"
    width = max(len(title), *(len(m.what) for m in report.measures))
    head = "yardstick" if report.float64 else ""
    lines.append(f"  {title:<{width}}  {'partitioned':>11}  {head:>9}  {'limit':>8}")
    for m in report.measures:
        theirs = f"{m.yardstick:9.2e}" if m.yardstick is not None else " " * 9
        verdict = "ok" if m.ok else "FAILED"
        lines.append(f"  {m.what:<{width}}  {m.partitioned:11.2e}  {theirs}  {m.limit:8.2e}  {verdict}")
    lines.append("")
    if report.ok and report.lossy:
        lines.append(f"ok: the program with `compress = {report.lossy}` converges as it does uncompressed")
    elif report.ok:
        what = "as close to float64 as one device is" if report.float64 else "within the fixed bounds"
        lines.append(f"ok: the partitioned program trains {what}")
    elif report.lossy:
        lines.append(
            f"FAILED: with `compress = {report.lossy}` the losses leave the uncompressed run's by more than "
            f"{LOSS_MARGIN:.0%}: the compression loses too much for this model (a higher rank, a warm-up) "
            "or meshplan's compression is wrong"
        )
    else:
        failed = ", ".join(m.what for m in report.measures if not m.ok)
        bug = "a meshplan bug: please report it with the plan"
        lines.append(
            f"FAILED: {failed} differ{'s' * (',' not in failed)} by more than rounding: the program "
            + (
                f"meshplan compiled computes something else ({bug})"
                if not report.routes
                else "meshplan compiled computes something else, or the model's routing sits at a near-tie"
            )
        )
        if report.routes:
            lines.append(
                "hint: the model routes tokens by comparing scores (a top-k), and rounding alone can flip a "
                "token whose scores nearly tie (a few rows of one tensor far off, the rest within rounding); "
                f"run again with --seed {job.seed + 1}: a program that fails with every seed is {bug}"
            )
    return "\n".join(lines)
