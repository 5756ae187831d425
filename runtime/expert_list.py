"""Experts kept as a list of modules, held stacked so that they can be split over an expert axis.

Much MoE code keeps its experts as `nn.ModuleList` of E modules of one class (three linears
each) and loops over them in the parent block:

    for e, expert in enumerate(self.experts):
        token, slot = torch.where(index == e)
        out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])

`ExpertList` takes such a list's place. It holds each parameter of the expert once, stacked
over the experts on dim 0, under the expert's own name (`experts.gate_proj.weight` (E, I, H)
for the list's `experts.{e}.gate_proj.weight` (I, H)), so the experts are split over an axis
as a Hugging Face experts module is (`Shard(0)`: rank r holds experts [r E/n, (r+1) E/n)).
The parent's loop runs unchanged: indexing or iterating gives each expert as a callable, which
runs the expert's own module code (one copy of it on the meta device, `torch.func.
functional_call`) with its slices of the stacked parameters; so its values and gradients are
the list's. Called itself, as `experts(tokens, top_k_index, top_k_weights)`, it computes what
the parent's loop does with weight 1 per pair: the interface `runtime.experts.ExpertParallel`
runs a rank's local experts through.

    experts = ExpertList.of(block.experts)                # None if it cannot hold them
    block.experts = experts
    y = experts[3](rows)                                   # expert 3, as the list computed it
    state = as_list_state(model.state_dict(), stacked_lists(model))  # the list's names (export)
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn


class ExpertList(nn.Module):
    """E experts of one class, each parameter stacked over them on dim 0 (module docstring)."""

    def __init__(self, template: nn.Module, stacked: dict[str, Tensor], requires_grad: dict[str, bool]):
        super().__init__()
        self.num_experts = next(iter(stacked.values())).shape[0]
        self.names = tuple(stacked)  # the expert's parameter names, in its order
        for name, value in stacked.items():
            owner = self
            *parents, leaf = name.split(".")
            for part in parents:  # holders mirror the expert's submodules, for the names only
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]  # type: ignore[assignment]
            owner.register_parameter(leaf, nn.Parameter(value, requires_grad[name]))
        # the expert's code, its parameters on the meta device: kept out of `_modules` so that it
        # adds nothing to the model's state
        self.__dict__["_template"] = template

    @property
    def template(self) -> nn.Module:
        """The expert's module, its parameters on the meta device (the values are the stacks')."""
        return self.__dict__["_template"]

    @classmethod
    def of(cls, experts: nn.ModuleList) -> ExpertList:
        """The list's experts stacked (copies of their values); `problem` says when it cannot."""
        assert problem(experts) is None, problem(experts)
        first = experts[0]
        names = [name for name, _ in first.named_parameters()]
        stacked = {n: torch.stack([e.get_parameter(n).detach() for e in experts]) for n in names}
        template = copy.deepcopy(first).to("meta")
        return cls(template, stacked, {n: first.get_parameter(n).requires_grad for n in names})

    def extra_repr(self) -> str:
        return f"{self.num_experts} x {type(self.template).__name__}"

    def expert(self, e: int, *args: Any, **kwargs: Any) -> Any:
        """Expert `e`'s forward. While meshplan captures the model, a hook in the instance's
        `call_expert` (set by the compiler) stands for it."""
        hook = self.__dict__.get("call_expert")
        if hook is not None:
            return hook(e, *args, **kwargs)
        params = {name: self.stacked(name)[e] for name in self.names}
        return torch.func.functional_call(self.template, params, args, kwargs)

    def stacked(self, name: str) -> Tensor:
        """The stacked parameter `name` (E, ...), or what `functional_call` put in its place."""
        owner: Any = self
        for part in name.split("."):
            owner = getattr(owner, part)
        return owner

    def __getitem__(self, e: int | Tensor) -> _Expert:
        e = int(e)
        if not -self.num_experts <= e < self.num_experts:
            raise IndexError(f"expert {e} of {self.num_experts}")
        return _Expert(self, e % self.num_experts)

    def __iter__(self) -> Iterator[_Expert]:  # type: ignore[override]
        return (_Expert(self, e) for e in range(self.num_experts))

    def __len__(self) -> int:
        return self.num_experts

    def forward(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        # x: (N, H); top_k_index, top_k_weights: (N, k): out[t] = sum_j w[t, j] expert_{i[t, j]}(x[t])
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            out = out.index_add(0, token, self.expert(e, x[token]) * top_k_weights[token, slot, None])
        return out


class _Expert:
    """One expert of an `ExpertList`, called as the list's module was."""

    def __init__(self, owner: ExpertList, e: int):
        self.owner, self.e = owner, e

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.expert(self.e, *args, **kwargs)

    forward = __call__

    def __repr__(self) -> str:
        return f"expert {self.e} of {self.owner.extra_repr()}"


def problem(experts: nn.Module) -> str | None:
    """Why `experts` cannot be held stacked, or None: a non-empty `nn.ModuleList` (the parent
    calls its experts) of modules of one class, with the same parameters (names, shapes, dtypes),
    and no buffers."""
    if not isinstance(experts, nn.ModuleList) or len(experts) == 0:
        return "it is not a non-empty list of modules"
    if type(experts) is not nn.ModuleList:
        return (
            f"it is a `{type(experts).__name__}`, a list with code of its own; meshplan stacks "
            "an `nn.ModuleList` whose experts the parent block calls"
        )
    first = experts[0]
    params = [(n, p.shape, p.dtype) for n, p in first.named_parameters()]
    if not params:
        return "its experts have no parameters"
    for e, expert in enumerate(experts):
        if type(expert) is not type(first):
            return f"its experts are of different classes (`{e}` is a {type(expert).__name__}, `0` a {type(first).__name__})"
        if [(n, p.shape, p.dtype) for n, p in expert.named_parameters()] != params:
            return f"its experts hold different parameters (`{e}`'s differ from `0`'s)"
        if next(expert.buffers(), None) is not None:
            return f"its experts hold buffers (`{e}`), which cannot be stacked with their parameters"
    return None


def stack_lists(model: nn.Module, paths: tuple[str, ...] | list[str]) -> None:
    """Replace each list of experts at `paths` by its `ExpertList` (one already stacked is left)."""
    for path in paths:
        module = model.get_submodule(path)
        if isinstance(module, ExpertList):
            continue
        parent, _, name = path.rpartition(".")
        assert isinstance(module, nn.ModuleList)
        setattr(model.get_submodule(parent), name, ExpertList.of(module))


def stacked_lists(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each `ExpertList` of `model` by path -> its expert's parameter names."""
    return {path: m.names for path, m in model.named_modules() if isinstance(m, ExpertList)}


def as_list_state(state: dict[str, Tensor], lists: dict[str, tuple[str, ...]]) -> dict[str, Tensor]:
    """`state` (the stacked model's names) with the stacked parameters of each list in `lists`
    (`stacked_lists`) under the list's names again, one tensor per expert: what the user's
    model loads."""
    out = dict(state)
    for path, names in lists.items():
        for name in names:
            key = f"{path}.{name}"
            if key in out:
                stacked = out.pop(key)
                out.update({f"{path}.{e}.{name}": stacked[e] for e in range(stacked.shape[0])})
    return out
