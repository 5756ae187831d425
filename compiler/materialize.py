"""Weights for a model built on the meta device: each module initialized by the model's own code,
whole on the host, one module at a time, for a rank to keep its pieces of.

    weights = MetaWeights(model, seed=0)
    full = weights.full("model.layers.0.mlp.up_proj.weight")     # this tensor, initialized, whole

A model too big to allocate is described on the meta device (`with torch.device("meta"):`, or
Hugging Face's `from_config` under it). Its parameters have shapes and no values, so a rank asks
for each tensor it keeps a piece of, and this initializes the module holding it:

- a Hugging Face `PreTrainedModel`: its `_init_weights(module)` (a composite model's part: the
  nearest enclosing model's), which also recomputes buffers such as the rotary frequencies;
- any other model: the module's `reset_parameters()` (PyTorch's linears, embeddings, norms);
- a model with only a whole-model `init_weights()` (torchtitan's convention): the whole model is
  materialized on the host once and initialized by it. Correct, but start-up then holds the
  whole model; give its modules `reset_parameters()` to avoid that.

A tensor the model's code leaves uninitialized is an error naming it (a module with parameters
of its own and no initializer), never a run on garbage.

Why one module at a time, on the host, with a seed per module: the values a tensor gets depend
only on the run's seed and its module's path, not on the order modules are visited or on which
ones a rank visits. So every layout trains the same model (a `dp=1` and a `tp=2` run start from
the same loss), and a rank initializes only the modules it holds pieces of. On the host, because
the CPU generator gives the same numbers on every machine (a GPU's differs from a CPU's). The
cost: a rank computes the whole of each module it holds a piece of (at tp=8, eight times its
share of the initialization work) and holds at most one module whole beyond its own state.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .errors import CompileError


class MaterializeError(CompileError):
    """A tensor of a meta-built model that its code does not initialize (the user's to fix: a
    `meshplan run` rank leaves it for the launcher to say once, exit 2)."""


class MetaWeights:
    """The whole, initialized value of each tensor of a meta-built `model`, by its state-dict
    name, computed module by module (see the module docstring). Only the last module's tensors
    are kept: ask for a module's tensors together."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.model, self.seed = model, seed
        self._owner: dict[str, tuple[str, str]] = {}  # name -> (module path, attribute), ties by identity
        first: dict[int, tuple[str, str]] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            for attr, t in itertools.chain(module._parameters.items(), module._buffers.items()):
                if t is not None:
                    self._owner[f"{path}.{attr}" if path else attr] = first.setdefault(id(t), (path, attr))
        self._initialize = _initializer(model)
        self._held: tuple[str, dict[str, Tensor]] | None = None  # the last module's tensors
        self._whole = self._initialize is None  # only a whole-model init_weights()
        self._whole_done = False

    def grouped(self, names: list[str]) -> list[str]:
        """`names` with each module's tensors together (in the order modules are first named):
        the order that initializes each module once."""
        first: dict[str, int] = {}
        for name in names:
            first.setdefault(self._owner[name][0], len(first))
        return sorted(names, key=lambda name: first[self._owner[name][0]])

    def full(self, name: str) -> Tensor:
        path, attr = self._owner[name]
        if self._whole:
            if not self._whole_done:  # on the first tensor asked for: none may be needed
                _whole_model(self.model, self.seed)
                self._whole_done = True
            module = self.model.get_submodule(path)
            found = module._parameters.get(attr, module._buffers.get(attr))
            assert found is not None, name
            return found
        if self._held is None or self._held[0] != path:
            self._held = (path, self._materialize(path))
        return self._held[1][attr]

    def _materialize(self, path: str) -> dict[str, Tensor]:
        """`path`'s own tensors, allocated on the host and initialized by the model's code under
        the module's seed; the module itself is left on meta."""
        module = self.model.get_submodule(path)
        params, buffers = dict(module._parameters), dict(module._buffers)
        try:
            for attr, p in params.items():
                if p is not None:
                    module._parameters[attr] = nn.Parameter(_unset_like(p), requires_grad=p.requires_grad)
            for attr, b in buffers.items():
                if b is not None:
                    module._buffers[attr] = _unset_like(b)
            torch.manual_seed(module_seed(self.seed, path))
            with torch.no_grad():
                assert self._initialize is not None
                self._initialize(path, module)
            made = {
                attr: t.detach()
                for attr, t in itertools.chain(module._parameters.items(), module._buffers.items())
                if t is not None
            }
        finally:
            module._parameters.update(params)
            module._buffers.update(buffers)
        for attr, t in made.items():
            if t.is_floating_point() and bool(torch.isnan(t).any()):
                raise MaterializeError(
                    f"`{path + '.' if path else ''}{attr}`: the model is built on the meta device and "
                    f"its code does not initialize this tensor ({type(module).__name__} has "
                    + (
                        "no `reset_parameters()`"
                        if not hasattr(module, "reset_parameters")
                        else "an initializer that leaves it unset"
                    )
                    + ")",
                    hint="give the module a reset_parameters() that sets it, or build the model on the CPU",
                )
        return made


def materialize_model(model: nn.Module, seed: int) -> nn.Module:
    """`model` made whole on the host, in place, each tensor as `MetaWeights` gives it (what
    every layout's ranks take their pieces of): `verify`'s unpartitioned reference. Ties stay."""
    weights = MetaWeights(model, seed)
    made: dict[int, Tensor] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for attr, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    value = weights.full(f"{path}.{attr}" if path else attr).clone()
                    made[id(t)] = (
                        nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else value
                    )
                table[attr] = made[id(t)]  # type: ignore[assignment]
    return model


def is_meta(model: nn.Module) -> bool:
    """Whether any of `model`'s parameters or buffers is on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def module_seed(seed: int, path: str) -> int:
    """The generator seed of module `path` in a run seeded `seed`."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "little") >> 1


def _unset_like(t: Tensor) -> Tensor:
    """A host tensor shaped as `t`, floating point ones filled with NaN: what initialization
    leaves NaN it did not write."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.fill_(float("nan")) if out.is_floating_point() else out.zero_()


def _initializer(model: nn.Module) -> Callable[[str, nn.Module], None] | None:
    """`(path, module) -> None` initializing one module's own tensors in place; None where the
    model only initializes as a whole (`init_weights()`)."""
    hf = {path: m for path, m in model.named_modules() if _is_pretrained(m)}
    if hf:

        def hugging_face(path: str, module: nn.Module) -> None:
            owner = max((p for p in hf if p == "" or path == p or path.startswith(p + ".")), key=len)
            hf[owner]._init_weights(module)  # type: ignore[operator]
            if hasattr(module, "reset_parameters") and not _is_pretrained(module) and _all_unset(module):
                module.reset_parameters()  # type: ignore[operator]  # a module _init_weights does not know

        return hugging_face
    if callable(getattr(model, "init_weights", None)) and not any(
        hasattr(m, "reset_parameters") for m in model.modules() if m._parameters
    ):
        return None

    def own_code(path: str, module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()  # type: ignore[operator]

    return own_code


def _is_pretrained(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")


def _all_unset(module: nn.Module) -> bool:
    tensors = [t for t in module._parameters.values() if t is not None and t.is_floating_point()]
    return bool(tensors) and all(bool(torch.isnan(t).all()) for t in tensors)


def _whole_model(model: nn.Module, seed: int) -> None:
    """The whole model on the host, initialized by its `init_weights()` under `seed`."""
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()  # type: ignore[operator]
