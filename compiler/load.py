"""Load the user's model from a `--model` spec: the model, and inputs to capture it with.

    source = load_model("examples/models/llama.py:build")
    captured = capture(source.model, source.args, source.kwargs)   # `capture.py`

`load_model` runs only the file (or imports only the module) that the spec names and
calls its factory with no arguments; a plan never runs code. The inputs are the file's
`example_inputs()`, else random token ids for a model whose config has a vocabulary size.
An exception in the user's code is a `ModelLoadError` located at its line there, so no
traceback is needed; `load_function` loads another function of theirs the same way
(`--between-steps`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .errors import ModelLoadError
from .materialize import is_meta

_SPEC_HINT = "write the model as path/to/file.py:factory or package.module:factory, e.g. examples/models/llama.py:build"


@dataclass(frozen=True)
class ModelSource:
    """A model built from a `--model` spec, with inputs to capture it with.

    `args` and `kwargs` are what `capture` passes to the model's forward; for a
    training graph they include the labels, so the captured output is the loss.
    """

    spec: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    # where the inputs come from, for messages: `model.py:40` (its `example_inputs()`), or ""
    inputs_from: str = ""


def load_model(spec: str, *, shapes_only: bool = False) -> ModelSource:
    """Build the model a `--model` spec names and make example inputs for it.

    `spec` is `path/to/file.py:factory` or `package.module:factory`. The factory is
    called with no arguments and must return an `nn.Module`. Inputs come from the
    module's `example_inputs()` if it defines one, else are random token ids when the
    model has a `config.vocab_size` (Hugging Face models and the examples have one).

    `shapes_only`: the caller needs no weights (checking, compiling): the factory runs under
    the meta device, so nothing the size of the model is allocated. A factory that cannot
    build on meta, or keeps tensors outside its parameters and buffers (which a program would
    keep as constants, without values on meta), is built as usual instead.
    """
    target, factory_name = _split_spec(spec)
    is_file = _names_a_file(target)
    # As Python does for a script, the file's folder comes first on the import path, so a
    # model file that imports the module beside it (`from model import GPT`) loads as it
    # runs with `python FILE.py`; kept there while the factory and example_inputs run too.
    with _folder_first_on_path(str(Path(target).resolve().parent) if is_file else None):
        module = _run_file(target) if is_file else _import_module(target)
        # Where the user's code lives, to point error messages at its lines.
        origin = getattr(module, "__file__", None) or target
        factory = _find_factory(module, factory_name, target)
        model = _on_meta(factory) if shapes_only else None
        if model is None:
            model = _call_factory(factory, spec, origin)
        args, kwargs = _make_inputs(module, model, spec, origin)
    return ModelSource(spec=spec, model=model, args=args, kwargs=kwargs, inputs_from=_inputs_from(module))


def load_function(spec: str, option: str) -> Callable[..., Any]:
    """The function a spec like `--model`'s names (`path/to/file.py:name` or `module:name`),
    e.g. `--between-steps model.py:update_bias`. A file the model was loaded from is not run
    again: the function sees the model's own classes (its `isinstance` checks hold)."""
    target, name = _split_spec(spec)
    is_file = _names_a_file(target)
    with _folder_first_on_path(str(Path(target).resolve().parent) if is_file else None):
        loaded = sys.modules.get(_file_module_name(Path(target))) if is_file else None
        module = loaded or (_run_file(target) if is_file else _import_module(target))
    function = getattr(module, name, None)
    if not callable(function):
        raise ModelLoadError(
            f"{option} {spec}: {target!r} defines no function {name!r}",
            hint=_factory_hint(module, name, target).replace("returns the nn.Module", f"{option} can call"),
        )
    return function


@contextlib.contextmanager
def _folder_first_on_path(folder: str | None) -> Iterator[None]:
    """`folder` at the front of sys.path for the duration, unless it is there already.

    Modules imported from it stay in sys.modules afterwards, as they do after any import.
    """
    if folder is None or folder in sys.path:
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        if folder in sys.path:
            sys.path.remove(folder)


def _split_spec(spec: str) -> tuple[str, str]:
    # rpartition keeps a Windows drive letter ("C:\\m.py:build") in the target.
    target, colon, factory_name = spec.strip().rpartition(":")
    if not colon or not target or not factory_name:
        raise ModelLoadError(f"model spec {spec!r} does not name a factory", hint=_SPEC_HINT)
    if not factory_name.isidentifier():
        raise ModelLoadError(
            f"model spec {spec!r}: factory name {factory_name!r} is not a Python identifier",
            hint=_SPEC_HINT,
        )
    return target, factory_name


def _names_a_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _run_file(target: str) -> ModuleType:
    """Execute one .py file as a private module; `load_model` puts its folder on sys.path first."""
    path = Path(target)
    if not path.is_file():
        where = "is a directory" if path.is_dir() else "does not exist"
        raise ModelLoadError(
            f"model file {target!r} {where}",
            hint=f"the path is relative to the current directory ({Path.cwd()}); {_SPEC_HINT}",
        )
    resolved = path.resolve()
    name = _file_module_name(path)
    file_spec = importlib.util.spec_from_file_location(name, resolved)
    if file_spec is None or file_spec.loader is None:
        raise ModelLoadError(f"cannot load {target!r} as Python", hint=_SPEC_HINT)
    module, loader = importlib.util.module_from_spec(file_spec), file_spec.loader
    # Registered while it runs: dataclasses and pickling look the module up by name.
    sys.modules[name] = module
    try:
        _call_user(
            lambda: loader.exec_module(module),
            f"running {target!r}",
            str(resolved),
            hint=f"run `python {target}` to see the full traceback",
        )
    except ModelLoadError:
        del sys.modules[name]
        raise
    _importable_by_its_name(module, resolved)
    return module


def _importable_by_its_name(module: ModuleType, path: Path) -> None:
    """Let `import NAME` of the model file (`moe.py`: `import moe`) from the user's other files
    (a `--between-steps` or `--data` file beside it) return this module, not a second copy of
    it whose classes fail every `isinstance` check on the model. Only where that import would
    find this very file (its folder is first on sys.path while it loads) and nothing holds the
    name yet."""
    stem = path.stem
    if not stem.isidentifier() or stem in sys.modules:
        return
    try:
        found = importlib.util.find_spec(stem)
    except (ImportError, ValueError):
        return
    if found is not None and found.origin is not None and Path(found.origin).resolve() == path:
        sys.modules[stem] = module


def _file_module_name(path: Path) -> str:
    """The private module name a model file runs as (one per resolved path)."""
    return "_meshplan_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]


def _import_module(target: str) -> ModuleType:
    if not all(part.isidentifier() for part in target.split(".")):
        raise ModelLoadError(f"{target!r} is neither a .py file nor a module name", hint=_SPEC_HINT)
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (target == exc.name or target.startswith(exc.name + ".")):
            raise ModelLoadError(
                f"no module named {target!r}",
                hint=f"check the name and the Python environment, or give a file path; {_SPEC_HINT}",
            ) from exc
        raise _import_failed(target, exc) from exc
    except (Exception, SystemExit) as exc:
        raise _import_failed(target, exc) from exc


def _import_failed(target: str, exc: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"importing {target!r} raised {_describe(exc)}",
        hint=f"run `python -c 'import {target}'` to see the full traceback",
    )


def _find_factory(module: ModuleType, factory_name: str, target: str) -> Callable[[], Any]:
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise ModelLoadError(
            f"{target!r} has no {factory_name!r}", hint=_factory_hint(module, factory_name, target)
        )
    if not callable(factory):
        raise ModelLoadError(
            f"{target}:{factory_name} is not callable: it has type {type(factory).__name__}",
            hint=_factory_hint(module, factory_name, target),
        )
    return factory


def _factory_hint(module: ModuleType, factory_name: str, target: str) -> str:
    """Name the functions the file defines, closest to what was asked first."""
    defined = [
        name
        for name, value in vars(module).items()
        if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")
    ]
    if not defined:
        return f"{target!r} defines no public function; add one that returns the nn.Module"
    close = difflib.get_close_matches(factory_name, defined, n=1)
    prefix = f"did you mean {close[0]!r}? " if close else ""
    return prefix + "functions defined there: " + ", ".join(defined)


def _call_user(fn: Callable[[], Any], what: str, origin: str, hint: str) -> Any:
    """`fn()`, the user's code in `origin`: whatever it raises (an exit too) is a ModelLoadError
    saying that `what` raised it, and where in that file."""
    try:
        return fn()
    except (Exception, SystemExit) as exc:
        raise ModelLoadError(f"{what} raised {describe_error(exc, origin)}", hint=hint) from exc


def on_meta_inputs(source: ModelSource) -> ModelSource:
    """`source` with its example inputs on the meta device where its model is: a capture then
    meets one device (a loss of meta logits against host labels would not trace)."""
    if not is_meta(source.model):
        return source

    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    return dataclasses.replace(
        source,
        args=tuple(meta(a) for a in source.args),
        kwargs={k: meta(v) for k, v in source.kwargs.items()},
    )


def _on_meta(factory: Callable[[], Any]) -> nn.Module | None:
    """The factory's model built on the meta device, or None where that does not give one whose
    every tensor is a parameter or a buffer (the factory's own errors are said by the usual build)."""
    try:
        with torch.device("meta"):
            model = factory()
    except Exception:
        return None
    if not isinstance(model, nn.Module):
        return None
    for module in model.modules():
        if any(
            isinstance(v, torch.Tensor)
            for k, v in vars(module).items()
            if k not in ("_parameters", "_buffers")
        ):
            return None
    return model


def _call_factory(factory: Callable[[], Any], spec: str, origin: str) -> nn.Module:
    model = _call_user(
        factory,
        f"factory {spec!r}",
        origin,
        hint="the factory is called with no arguments and must return a torch.nn.Module",
    )
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module",
            hint="return the model itself, not a (model, config) pair or a class",
        )
    return model


def _make_inputs(
    module: ModuleType, model: nn.Module, spec: str, origin: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    make = getattr(module, "example_inputs", None)
    if callable(make):
        inputs = _call_user(
            make, f"example_inputs() of {spec!r}", origin, hint="example_inputs is called with no arguments"
        )
        return _as_call_inputs(inputs, spec)
    inputs = token_inputs(model)
    if inputs is None:
        raise ModelLoadError(
            f"no example inputs for {spec!r}: the module defines no example_inputs() "
            "and the model has no config.vocab_size",
            hint="define `example_inputs() -> tuple` next to the factory; it returns the forward's arguments",
        )
    return inputs


def _inputs_from(module: ModuleType) -> str:
    """`model.py:40`: where the module defines `example_inputs()`, or "" where it does not."""
    make = getattr(module, "example_inputs", None)
    code = getattr(make, "__code__", None)
    if code is None:
        return ""
    return f"{_display(code.co_filename)}:{code.co_firstlineno}"


def _as_call_inputs(inputs: object, spec: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A tuple or list is positional arguments, a dict keyword arguments, a tensor the one argument."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    if isinstance(inputs, dict) and all(isinstance(key, str) for key in inputs):
        return (), dict(inputs)
    raise ModelLoadError(
        f"example_inputs() of {spec!r} returned {type(inputs).__name__}",
        hint="return a tuple of positional arguments or a dict of keyword arguments",
    )


def token_inputs(
    model: nn.Module, *, batch: int = 2, seq: int = 16, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Random token ids for a language model with `config.vocab_size`, else None.

    Follows Hugging Face conventions where the forward has them: `labels` equal to
    `input_ids` (the model shifts them itself), and `use_cache=False` because a
    training graph has no KV cache (and torch.export cannot return `DynamicCache`).
    """
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        return None
    max_positions = getattr(config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and max_positions > 0:
        seq = min(seq, max_positions)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)  # (B, T)
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params:
        return (input_ids,), {}
    kwargs: dict[str, Any] = {"input_ids": input_ids}
    if "labels" in params:
        kwargs["labels"] = input_ids.clone()
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return (), kwargs


def is_token_input(x: object) -> bool:
    """A (B, T) integer tensor: token ids, labels, an attention mask (what `--seq` reshapes)."""
    return isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() and not x.is_complex()


def batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The batch of a call: dim 0 of its token inputs, else of its first tensor that has dims
    (None: no tensor input has one). Every tensor input whose dim 0 is that size is batched."""
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim() >= 1]
    tokens = [x for x in tensors if is_token_input(x)]
    first = tokens or tensors
    return int(first[0].shape[0]) if first else None


def is_batched(x: object, rows: int | None) -> bool:
    return isinstance(x, torch.Tensor) and rows is not None and x.dim() >= 1 and x.shape[0] == rows


def value_range(x: torch.Tensor) -> tuple[int, int]:
    """[low, high) of the values an integer input takes: from 0 to one past the example's largest
    (a label the loss ignores, -100, is not a value to draw), at least two values."""
    top = int(x.max()) if x.numel() and x.device.type != "meta" else 1
    return 0, max(top + 1, 2)


def draw_like(
    x: torch.Tensor, rows: int, generator: torch.Generator, *, high: int | None = None
) -> torch.Tensor:
    """Fresh values of the kind `x` holds, with `rows` on dim 0: floats (and complex) normal,
    integers in `value_range(x)` (or [0, `high`): token ids in the vocabulary), bool masks kept
    as given (the example's rows repeated). Drawn on the host by `generator`."""
    shape = (rows, *x.shape[1:])
    if x.dtype == torch.bool:
        return x[torch.arange(rows) % x.shape[0]].clone()
    if x.is_floating_point() or x.is_complex():
        return torch.randn(shape, generator=generator, dtype=x.dtype)
    low, top = value_range(x) if high is None else (0, high)
    return torch.randint(low, top, shape, generator=generator, dtype=x.dtype)


def describe_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """`pixels (2, 3, 16, 16) float32, labels (2,) int64`: the call's tensor inputs, by name."""
    return ", ".join(
        f"{name} {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
        for name, x in named_inputs(model, args, kwargs).items()
        if isinstance(x, torch.Tensor)
    )


def named_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by the names of the forward's parameters (`args[2]` past them)."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = {f"args[{i}]": a for i, a in enumerate(args)} | kwargs
    out: dict[str, Any] = {}
    for name, value in bound.items():
        kind = inspect.signature(model.forward).parameters.get(name)
        if kind is not None and kind.kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        elif kind is not None and kind.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


# The config fields that bound a model's sequence length, as model families name them:
# GPT-2's n_positions, Hugging Face's max_position_embeddings, the DTensor test Transformer's
# max_seq_len, nanoGPT's block_size.
_POSITION_FIELDS = ("n_positions", "max_position_embeddings", "max_seq_len", "block_size")


def _config(model: nn.Module) -> object | None:
    """The model's hyperparameters: `config` (Hugging Face, the examples), else `model_args`."""
    config = getattr(model, "config", None)
    return config if config is not None else getattr(model, "model_args", None)


def vocab_size(model: nn.Module) -> int | None:
    """How many token ids the model embeds (`config.vocab_size`), or None when it does not say."""
    value = getattr(_config(model), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None


def max_positions(model: nn.Module) -> tuple[str, int] | None:
    """The longest sequence the model's config allows, with the field that says so
    (`("max_position_embeddings", 128)`), or None when it does not say."""
    config = _config(model)
    for name in _POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def describe_error(exc: BaseException, filename: str) -> str:
    """`KeyError: 'x' (at update.py:3)`: an exception the user's code in `filename` raised,
    located at its innermost line there, so no traceback is needed."""
    return _describe(exc) + _location(exc, filename)


def _describe(exc: BaseException) -> str:
    # A SyntaxError's str() repeats the location that `_location` adds.
    text = exc.msg if isinstance(exc, SyntaxError) and exc.msg else str(exc)
    lines = text.strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _location(exc: BaseException, filename: str) -> str:
    """' (at file.py:12)' for the innermost frame in the user's file, so no traceback is needed."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" (at {_display(exc.filename)}:{exc.lineno})"
    wanted = Path(filename).resolve() if filename.endswith(".py") else None
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if wanted is not None and Path(frame.filename).resolve() == wanted
    ]
    return f" (at {_display(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


def _display(filename: str) -> str:
    """A path relative to the current directory when it is below it, as the user typed it."""
    path, cwd = Path(filename).resolve(), Path.cwd().resolve()
    return str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)
