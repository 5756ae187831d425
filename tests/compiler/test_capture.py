"""capture: the graph matches the eager model, and every node knows the module it came from."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import meshplan.examples
from meshplan.compiler.capture import Captured, capture, dotted_module_path
from meshplan.compiler.errors import CaptureError, ModelLoadError
from meshplan.compiler.load import load_model
from meshplan.compiler.meta import module_tag
from meshplan.examples.models import gpt, llama

MODELS_DIR = Path(meshplan.examples.__file__).parent / "models"


@pytest.fixture(scope="module", params=[llama, gpt], ids=["llama", "gpt"])
def example(request: pytest.FixtureRequest) -> tuple[ModuleType, Captured]:
    family = request.param
    model = family.build(num_hidden_layers=2)
    return family, capture(model, family.example_inputs())


def _linear_paths(captured: Captured) -> list[str]:
    return [path for path, cls in captured.modules.items() if issubclass(cls, nn.Linear)]


def test_every_linear_has_its_nodes(example: tuple[ModuleType, Captured]) -> None:
    _, captured = example
    linears = _linear_paths(captured)
    assert len(linears) > 2
    for path in linears:
        targets = {node.target for node in captured.nodes_under(path)}
        assert torch.ops.aten.linear.default in targets, path


def test_llama_layer_paths() -> None:
    captured = capture(llama.build(num_hidden_layers=3), llama.example_inputs(seq=8))
    paths = set(captured.node_modules.values())
    for index in range(3):
        for leaf in (
            "self_attn.q_proj",
            "self_attn.o_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
        ):
            assert f"layers.{index}.{leaf}" in paths
    # The loss is computed by the root module.
    loss_nodes = [n for n in captured.graph_module.graph.nodes if "cross_entropy" in str(n.target)]
    assert [captured.node_modules[n.name] for n in loss_nodes] == [""]


def test_paths_are_named_module_paths(example: tuple[ModuleType, Captured]) -> None:
    _, captured = example
    assert set(captured.node_modules.values()) <= set(captured.modules)
    for node in captured.graph_module.graph.nodes:
        if node.op == "call_function":
            assert module_tag(node) == captured.node_modules[node.name]


def test_parameters_match_the_model(example: tuple[ModuleType, Captured]) -> None:
    _, captured = example
    model = captured.model
    assert set(captured.parameters) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert captured.parameters[name].shape == tuple(param.shape)
    for name in captured.program.graph_signature.inputs_to_parameters.values():
        assert captured.parameter(name).shape == tuple(model.get_parameter(name).shape)


def test_tied_weight_has_an_alias() -> None:
    captured = capture(gpt.build(num_hidden_layers=1), gpt.example_inputs(seq=8))
    assert captured.parameters["wte.weight"].aliases == ("lm_head.weight",)
    assert captured.parameter("lm_head.weight").name == "wte.weight"
    with pytest.raises(KeyError):
        captured.parameter("no.such.weight")


def test_exported_matches_eager_forward_and_backward(example: tuple[ModuleType, Captured]) -> None:
    _, captured = example
    exported = captured.program.module()
    loss = exported(*captured.args)
    expected = captured.model(*captured.args)
    torch.testing.assert_close(loss, expected)

    loss.backward()
    expected.backward()
    grads = {name: param.grad for name, param in exported.named_parameters()}
    for name, param in captured.model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)
    captured.model.zero_grad()


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("layers.0.mlp", "layers.0.mlp"),
        ("", ""),
        ("L['self']", ""),
        ("L['self'].layers[0].mlp", "layers.0.mlp"),
        ("L['self']._modules['layers']._modules['0']", "layers.0"),
        ("getattr(getattr(L['self'].layers, '0'), 'mlp').up_proj", "layers.0.mlp.up_proj"),
    ],
)
def test_dotted_module_path(raw: str, expected: str) -> None:
    assert dotted_module_path(raw) == expected


def test_capture_error_names_the_model() -> None:
    class ReturnsObject(nn.Module):
        def forward(self, x: torch.Tensor) -> object:
            return object()

    with pytest.raises(CaptureError, match="could not capture ReturnsObject") as info:
        capture(ReturnsObject(), (torch.ones(2),))
    assert info.value.hint


# --- load_model ------------------------------------------------------------------------


def test_load_by_path_and_by_module_name() -> None:
    by_path = load_model(f"{MODELS_DIR / 'llama.py'}:build")
    by_name = load_model("meshplan.examples.models.llama:build")
    torch.testing.assert_close(by_path.model.state_dict(), by_name.model.state_dict())
    assert len(by_path.args) == 2
    assert by_path.kwargs == {}


def _write(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


FILE = """
    import torch

    def build():
        return torch.nn.Linear(2, 2)

    def broken():
        raise RuntimeError("no weights here")

    def not_a_module():
        return 3

    value = 5
"""


@pytest.mark.parametrize(
    "factory, message",
    [
        ("buidl", r"has no 'buidl'\nhint: did you mean 'build'\?"),
        ("broken", r"raised RuntimeError: no weights here \(at .*model\.py:8\)"),
        ("not_a_module", r"returned int, not a torch\.nn\.Module"),
        ("value", r"is not callable"),
        ("build", r"no example inputs"),
    ],
)
def test_bad_factory(tmp_path: Path, factory: str, message: str) -> None:
    path = _write(tmp_path, FILE)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(f"{path}:{factory}")
    assert info.value.hint


@pytest.mark.parametrize(
    "spec, message",
    [
        ("examples/models/llama.py", "does not name a factory"),
        ("examples/models/llama.py:", "does not name a factory"),
        ("examples/models/llama.py:build()", "not a Python identifier"),
        ("no/such/file.py:build", "'no/such/file.py' does not exist"),
        ("no_such_package.model:build", "no module named 'no_such_package.model'"),
        ("not-a-module:build", "neither a .py file nor a module name"),
    ],
)
def test_bad_spec(spec: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(spec)
    error = info.value
    assert isinstance(error, ValueError)
    assert str(error) == f"{error.message}\nhint: {error.hint}"
    assert "\n" not in error.message


def test_file_that_fails_to_run(tmp_path: Path) -> None:
    path = _write(tmp_path, "x = 1\nraise ValueError('bad config')\n")
    with pytest.raises(ModelLoadError, match=r"raised ValueError: bad config \(at .*model\.py:2\)"):
        load_model(f"{path}:build")
    path = _write(tmp_path, "def build(:\n", name="syntax.py")
    with pytest.raises(ModelLoadError, match=r"raised SyntaxError: .* \(at .*syntax\.py:1\)"):
        load_model(f"{path}:build")


def test_example_inputs_from_the_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        import torch

        def build():
            return torch.nn.Linear(2, 3)

        def example_inputs():
            return {"input": torch.ones(4, 2)}
        """,
    )
    source = load_model(f"{path}:build")
    assert source.args == ()
    assert set(source.kwargs) == {"input"}
    captured = capture(source.model, source.args, source.kwargs)
    assert set(captured.node_modules.values()) == {""}


# --- Hugging Face ------------------------------------------------------------------------

HF_FACTORIES = """
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

def llama():
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)

def gpt2():
    # No dropout, so that the train-mode graph and the eager model agree exactly.
    config = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)
"""


@pytest.mark.parametrize(
    "factory, expected_paths",
    [
        ("llama", ["model.layers.{i}.mlp.down_proj", "model.layers.{i}.self_attn.q_proj", "lm_head"]),
        # GPT-2's projections are transformers' Conv1D (weight stored (in, out)), not nn.Linear.
        ("gpt2", ["transformer.h.{i}.mlp.c_proj", "transformer.h.{i}.attn.c_attn", "lm_head"]),
    ],
)
def test_hugging_face_model(tmp_path: Path, factory: str, expected_paths: list[str]) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    source = load_model(f"{_write(tmp_path, HF_FACTORIES)}:{factory}")
    assert source.kwargs.keys() == {"input_ids", "labels", "use_cache"}
    captured = capture(source.model, source.args, source.kwargs)

    paths = set(captured.node_modules.values())
    for layer in range(2):
        for template in expected_paths:
            assert template.format(i=layer) in paths

    output = captured.program.module()(**source.kwargs)
    expected = source.model(**source.kwargs)
    torch.testing.assert_close(output["loss"], expected.loss)
    torch.testing.assert_close(output["logits"], expected.logits)
