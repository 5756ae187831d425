"""Run a compiled plan and the unpartitioned model side by side and report the largest differences.

    meshplan verify examples/llama_tp.plan --model examples/models/llama.py:build --steps 3

Every rank builds the full model (same seed) and its compiled program, feeds both the
same batches, steps AdamW on both, and compares: the loss of every step, and after the
last step every gradient and every parameter, shard against the matching slice of the
full tensor. Differences are relative: ||mine - reference|| / ||reference||.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch
from torch import fx


@dataclass(frozen=True)
class VerifyConfig:
    plan_path: str
    model_spec: str
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    # float64 separates real bugs (differences stay large) from fp32 rounding (they vanish)
    dtype: str = "float32"


@dataclass(frozen=True)
class StepDiff:
    step: int
    loss: float
    reference_loss: float

    @property
    def rel(self) -> float:
        return abs(self.loss - self.reference_loss) / max(abs(self.reference_loss), 1e-12)


@dataclass(frozen=True)
class VerifyReport:
    rank: int
    steps: tuple[StepDiff, ...]
    grad_rel: dict[str, float]  # parameter -> relative difference of its gradient (last step)
    param_rel: dict[str, float]  # parameter -> relative difference after the last step
    # elements left out of the parameter comparison: their reference gradient was zero up to
    # rounding at every step, so Adam moved them by noise (e.g. key biases under softmax)
    noise_elements: dict[str, int] = field(default_factory=dict)

    @property
    def max_loss_rel(self) -> float:
        return max((s.rel for s in self.steps), default=0.0)

    @property
    def max_grad_rel(self) -> float:
        return max(self.grad_rel.values(), default=0.0)

    @property
    def max_param_rel(self) -> float:
        return max(self.param_rel.values(), default=0.0)


def bind_inputs(model: torch.nn.Module, graph: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The compiled graph's placeholders, filled from a call of the model's forward."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name, param in inspect.signature(model.forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            values.update(values.pop(name, {}))
    return [values[node.target] for node in graph.graph.nodes if node.op == "placeholder"]


def step_inputs(source_args: tuple, source_kwargs: dict, vocab_size: int, step: int, seed: int):
    """Fresh token batches shaped like the example inputs (same on every rank)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)

    def fresh(x):
        if isinstance(x, torch.Tensor) and not x.is_floating_point():
            return torch.randint(0, vocab_size, x.shape, generator=g, dtype=x.dtype)
        return x

    return tuple(fresh(a) for a in source_args), {k: fresh(v) for k, v in source_kwargs.items()}


def verify_worker(rank: int, world_size: int, config: VerifyConfig) -> VerifyReport:
    """One rank of `meshplan verify` (run under `runtime.launch.spawn` or torchrun)."""
    from meshplan.dsl import load_plan
    from meshplan.runtime.mesh import init_mesh

    from .capture import load_model
    from .compile import build_rank_program, compile_plan

    plan = load_plan(config.plan_path, world_size=world_size)
    torch.manual_seed(config.seed)
    source = load_model(config.model_spec)
    source.model.to(getattr(torch, config.dtype))
    compiled = compile_plan(plan, source, world_size=world_size)
    mesh = init_mesh(compiled.layout)
    reference = copy.deepcopy(source.model)
    program = build_rank_program(compiled, source.model, rank, mesh)
    vocab = int(getattr(getattr(source.model, "config", None), "vocab_size", 0) or 256)

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=config.lr)
    opt = torch.optim.AdamW(program.parameters(), lr=config.lr)
    coords = compiled.layout.coords(rank)
    steps = []
    noise: dict[str, torch.Tensor] = {}
    for step in range(config.steps):
        args, kwargs = step_inputs(source.args, source.kwargs, vocab, step, config.seed)
        ref_opt.zero_grad()
        ref_loss = _loss(reference(*args, **kwargs))
        ref_loss.backward()
        opt.zero_grad()
        outputs = program(*bind_inputs(source.model, compiled.graph, args, kwargs))
        loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        loss.backward()
        steps.append(StepDiff(step, float(loss.detach()), float(ref_loss.detach())))
        _track_noise(noise, reference, compiled, coords)
        if step == config.steps - 1:
            grad_rel = _compare(compiled, program, reference, coords, grads=True)
        ref_opt.step()
        opt.step()
    param_rel = _compare(compiled, program, reference, coords, grads=False, noise=noise)
    counts = {name: int(mask.sum()) for name, mask in noise.items() if mask.any()}
    return VerifyReport(rank, tuple(steps), grad_rel, param_rel, counts)


NOISE_LEVEL = 1e-6  # a gradient element this far below the model's gradient RMS is rounding


def _track_noise(noise: dict[str, torch.Tensor], reference, compiled, coords) -> None:
    """Mark (this rank's slice of) parameter elements whose reference gradient is ~0 at every step."""
    from .compile import local_shard

    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    if not grads:
        return
    total = sum(float(g.double().pow(2).sum()) for g in grads.values())
    rms = (total / sum(g.numel() for g in grads.values())) ** 0.5
    for name, g in grads.items():
        small = local_shard(
            g.abs() <= NOISE_LEVEL * rms, compiled.param_placements.get(name, {}), coords, compiled.layout
        )
        noise[name] = small if name not in noise else noise[name] & small


def _loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out["loss"] if hasattr(out, "__getitem__") and not isinstance(out, tuple) else out[0]


def _compare(compiled, program, reference, coords, *, grads: bool, noise=None) -> dict[str, float]:
    from .compile import local_shard

    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    out = {}
    for name, local in program.named_parameters(remove_duplicate=False):
        full = ref_params[name]
        mine = local.grad if grads else local
        theirs = full.grad if grads else full
        if mine is None or theirs is None:
            out[name] = 0.0 if mine is None and theirs is None else float("inf")
            continue
        theirs = local_shard(
            theirs, compiled.param_placements.get(name, {}), coords, compiled.layout
        ).detach()
        mine = mine.detach()
        if noise and name in noise and noise[name].any():
            keep = ~noise[name]
            mine, theirs = mine[keep], theirs[keep]
        out[name] = relative_difference(mine, theirs) if theirs.numel() else 0.0
    return out


def relative_difference(mine: torch.Tensor, reference: torch.Tensor, *, floor_rms: float = 1e-6) -> float:
    """||mine - reference|| / ||reference||, with tensors whose RMS is below `floor_rms` compared
    against that floor instead: a gradient that is mathematically zero (a key bias under
    softmax) is rounding noise, which Adam turns into equally tiny but unrelated parameters.
    """
    floor = floor_rms * reference.numel() ** 0.5
    scale = max(float(reference.norm()), floor)
    return float((mine - reference).norm()) / scale
