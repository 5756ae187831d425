"""`--model FILE.py:build` loads like `python FILE.py`: the file's folder is on the import path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshplan.compiler.errors import ModelLoadError
from meshplan.compiler.load import load_function, load_model

# Module names unique to this test: a module imported from a folder stays in sys.modules.
SIBLING = """
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=32, hidden=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids)).sum()
"""

TRAIN = """
import torch

from meshplan_test_sibling_{n} import TinyLM


def build():
    return TinyLM()


def build_lazily():
    from meshplan_test_lazy_{n} import TinyLM as Lazy

    return Lazy()


def example_inputs():
    return (torch.zeros(2, 4, dtype=torch.long),)
"""


def _model_folder(tmp_path: Path, n: int) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / f"meshplan_test_sibling_{n}.py").write_text(SIBLING)
    (folder / f"meshplan_test_lazy_{n}.py").write_text(SIBLING)
    (folder / "train.py").write_text(TRAIN.format(n=n))
    return folder


def test_a_model_file_imports_the_module_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path, 1)
    monkeypatch.chdir(tmp_path)  # relative path, from another folder: the file's folder counts, not the cwd
    path_before = list(sys.path)
    source = load_model("project/train.py:build")
    assert type(source.model).__name__ == "TinyLM"
    assert sys.modules["meshplan_test_sibling_1"].__file__ == str(folder / "meshplan_test_sibling_1.py")
    assert sys.path == path_before  # the folder is on the path while the model loads, not after


def test_a_factory_may_import_beside_it_when_called(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, 2)
    source = load_model(f"{folder}/train.py:build_lazily")
    assert type(source.model).__name__ == "TinyLM"
    assert str(folder) not in sys.path


def test_a_missing_sibling_still_names_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("from meshplan_test_nowhere import GPT\n")
    with pytest.raises(
        ModelLoadError,
        match=r"ModuleNotFoundError: No module named 'meshplan_test_nowhere' \(at .*train.py:1\)",
    ):
        load_model(f"{tmp_path}/train.py:build")
    assert str(tmp_path) not in sys.path


def test_another_file_that_imports_the_model_file_gets_the_same_module(tmp_path: Path) -> None:
    """A `--between-steps` function in its own file that imports the model file by name sees the
    model's own classes: a second copy of the module would fail every `isinstance` silently."""
    name = "meshplan_test_model_by_name"
    factory = "\n\ndef build():\n    return TinyLM()\n\n\ndef example_inputs():\n    return (torch.zeros(2, 4, dtype=torch.long),)\n"
    (tmp_path / f"{name}.py").write_text(SIBLING + factory)
    (tmp_path / "update.py").write_text(
        f"import {name}\n\n\ndef is_mine(model):\n    return isinstance(model, {name}.TinyLM)\n"
    )
    try:
        source = load_model(f"{tmp_path / name}.py:build")
        is_mine = load_function(f"{tmp_path / 'update.py'}:is_mine", "--between-steps")
        assert is_mine(source.model)
    finally:
        sys.modules.pop(name, None)
