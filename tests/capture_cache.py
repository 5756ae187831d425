"""The test process's `torch.export` calls, remembered: a model exported again, with the same
structure, at the same shapes, gets the first export's graph with its own weights.

Capture is the most expensive step a test pays in-process (about a second for the tiny Llama,
nearly three with symbolic shapes; a third of the suite's CPU on 2 cores), and hundreds of tests
compile the same few models at the same shapes. `torch.export(..., strict=False)` lifts
parameters and buffers into graph inputs, so the graph depends on what the model *is* (its
classes, their settings, the shapes and dtypes of its tensors, the call's shapes and dtypes, the
symbolic dims asked for), not on its weights. `remembered()` installs a cache keyed on exactly
that; a hit returns a new `ExportedProgram` around a copy of the first export's graph whose
state (parameters, buffers, tensor attributes) are the new model's own tensors, so nothing a
test does to one program reaches another's.

What the key holds, for every submodule: its class (the class object, so a class made inside a
test never matches another), train/eval mode, hooks, and every attribute that is not a module,
parameter or buffer: numbers, strings, dtypes and configs by value, tensors by value, anything
else by identity (an object the key cannot read by value matches only itself). Parameters by
name, shape, dtype, device and `requires_grad` (ties included: names are taken with duplicates);
buffers and the call's tensors by value. Global state that changes tracing is in it too: the
default dtype, grad mode, the active torch-function modes (meshplan's own cast to the compute
dtype is one). A model whose module-level functions a test patches (its methods are in the key
through its class only) must not be exported under the cache: no test does today.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_MODULE_STATE = {
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",  # in the key through the buffers' names (state_dict below)
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
}

_cache: dict[Any, torch.export.ExportedProgram] = {}
_kept: dict[int, Any] = {}
hits = misses = 0


def _tensor_value(t: torch.Tensor) -> tuple:
    if t.device.type == "meta" or type(t) not in (torch.Tensor, nn.Parameter, nn.Buffer):
        return _identity(t)  # fake, meta or a subclass
    data = t.detach().contiguous().cpu()
    digest = hashlib.blake2b(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return ("tensor", tuple(t.shape), t.dtype, t.requires_grad, digest)


def _value(x: Any) -> Any:
    """`x` as a hashable key part: by value where it can be read, else by identity."""
    if isinstance(x, _PLAIN):
        return (type(x), x)
    if isinstance(x, torch.Tensor):
        return _tensor_value(x)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_value(v) for v in x))
    if isinstance(x, dict):
        return (type(x), tuple((_value(k), _value(v)) for k, v in x.items()))
    if hasattr(x, "to_json_string") and callable(x.to_json_string):  # a Hugging Face config
        with contextlib.suppress(Exception):
            return (type(x), x.to_json_string(use_diff=False))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), tuple((f.name, _value(getattr(x, f.name))) for f in dataclasses.fields(x)))
    if isinstance(x, type):
        return ("class", x)
    return _identity(x)


def _identity(x: Any) -> tuple:
    """`x` by identity: kept alive while the cache is, so that its id is never another object's."""
    _kept[id(x)] = x
    return ("id", id(x))


def _module_key(model: nn.Module) -> tuple:
    parts: list[Any] = []
    for path, module in model.named_modules(remove_duplicate=False):
        attrs = tuple(
            (name, _value(value)) for name, value in sorted(vars(module).items()) if name not in _MODULE_STATE
        )
        parts.append((path, type(module), attrs))
    for name, p in model.named_parameters(remove_duplicate=False):
        parts.append(("param", name, tuple(p.shape), p.dtype, p.device, p.requires_grad, type(p)))
    for name, b in model.named_buffers(remove_duplicate=False):
        parts.append(("buffer", name, _tensor_value(b)))
    parts.append(("persistent", tuple(model.state_dict(keep_vars=True))))
    return tuple(parts)


def _ambient_key() -> tuple:
    modes = torch.overrides._get_current_function_mode_stack()
    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.is_autocast_enabled(),
        tuple((type(m), _value(dict(vars(m)))) for m in modes),
        bool(nn.modules.module._global_forward_hooks),
        bool(nn.modules.module._global_forward_pre_hooks),
    )


def _key(model: nn.Module, args: tuple, kwargs: dict | None, other: dict) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs or {}))
    return (
        _module_key(model),
        str(spec),
        tuple(_value(x) for x in leaves),
        repr(sorted(other.items(), key=lambda kv: kv[0])),
        _ambient_key(),
    )


def _rebound(program: torch.export.ExportedProgram, model: nn.Module) -> torch.export.ExportedProgram:
    """`program` on a copy of its graph, its state the tensors of `model` of the same names."""
    own: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    own |= dict(model.named_buffers(remove_duplicate=False))

    def attr(name: str) -> Any:
        if name in own:
            return own[name]
        obj: Any = model
        for part in name.split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None

    state = {name: own[name] for name in program.state_dict}
    constants = {
        name: attr(name) if attr(name) is not None else value for name, value in program.constants.items()
    }
    with warnings.catch_warnings():  # copying the graph's pytree specs warns of torch's own use
        warnings.simplefilter("ignore", FutureWarning)
        graph_module = torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph))
        graph_module.meta.update(program.graph_module.meta)
        return program._update(graph_module, program.graph_signature, state_dict=state, constants=constants)


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """`torch.export.export` through the cache while inside (`MESHPLAN_TEST_CAPTURE_CACHE=0`: not)."""
    if os.environ.get("MESHPLAN_TEST_CAPTURE_CACHE") == "0" or getattr(
        torch.export.export, "remembers", False
    ):
        yield  # off, or on already
        return
    export = torch.export.export

    def cached_export(model, args=(), kwargs=None, **options):
        global hits, misses
        if not isinstance(model, nn.Module):
            return export(model, args, kwargs=kwargs, **options)
        key = _key(model, tuple(args), kwargs, options)
        if key in _cache:
            hits += 1
            return _rebound(_cache[key], model)
        misses += 1
        program = export(model, args, kwargs=kwargs, **options)
        with contextlib.suppress(Exception):  # a program torch cannot rebuild is exported each time
            _cache[key] = _rebound(program, model)  # a copy of its own, which no test holds
        return program

    cached_export.remembers = True  # type: ignore[attr-defined]
    torch.export.export = cached_export
    try:
        yield
    finally:
        torch.export.export = export
