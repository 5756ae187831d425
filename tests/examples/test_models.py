"""The example models: deterministic per seed, trainable, and shaped as their docstrings say."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
from torch import nn

from meshplan.examples.models import gpt, llama

MODELS = [pytest.param(llama, id="llama"), pytest.param(gpt, id="gpt")]


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("family", MODELS)
def test_same_seed_same_weights(family: ModuleType) -> None:
    assert _same_weights(family.build(seed=3), family.build(seed=3))
    assert not _same_weights(family.build(seed=3), family.build(seed=4))


@pytest.mark.parametrize("family", MODELS)
def test_build_leaves_global_rng_alone(family: ModuleType) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    family.build()
    family.example_inputs()
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("family", MODELS)
def test_example_inputs_are_shifted_tokens(family: ModuleType) -> None:
    input_ids, labels = family.example_inputs(batch=3, seq=8, seed=1)
    assert input_ids.shape == labels.shape == (3, 8)
    assert input_ids.dtype == labels.dtype == torch.long
    assert torch.equal(input_ids[:, 1:], labels[:, :-1])
    assert torch.equal(family.example_inputs(batch=3, seq=8, seed=1)[0], input_ids)


@pytest.mark.parametrize("family", MODELS)
def test_logits_and_loss(family: ModuleType) -> None:
    model = family.build()
    input_ids, labels = family.example_inputs(batch=2, seq=16)
    logits = model(input_ids)
    assert logits.shape == (2, 16, model.config.vocab_size)
    loss = model(input_ids, labels)
    assert loss.ndim == 0
    assert torch.isfinite(loss)
    # Small initial weights give nearly uniform predictions.
    assert loss.item() == pytest.approx(math.log(model.config.vocab_size), rel=0.05)


@pytest.mark.parametrize("family", MODELS)
def test_backward_reaches_every_parameter(family: ModuleType) -> None:
    model = family.build(num_hidden_layers=2)
    model(*family.example_inputs()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("family", MODELS)
def test_overrides_reach_the_config(family: ModuleType) -> None:
    model = family.build(num_hidden_layers=2, hidden_size=32)
    blocks = model.layers if family is llama else model.h
    assert len(blocks) == 2
    assert model.config.hidden_size == 32


@pytest.mark.parametrize("family", MODELS)
def test_unknown_override_is_rejected(family: ModuleType) -> None:
    with pytest.raises(TypeError, match="num_layerz"):
        family.build(num_layerz=2)


def test_llama_module_names_follow_hugging_face() -> None:
    names = {name for name, _ in llama.build(num_hidden_layers=1).named_modules()}
    assert names >= {
        "embed_tokens",
        "layers.0.input_layernorm",
        "layers.0.self_attn.q_proj",
        "layers.0.self_attn.k_proj",
        "layers.0.self_attn.v_proj",
        "layers.0.self_attn.o_proj",
        "layers.0.post_attention_layernorm",
        "layers.0.mlp.gate_proj",
        "layers.0.mlp.up_proj",
        "layers.0.mlp.down_proj",
        "norm",
        "lm_head",
    }


def test_llama_grouped_query_attention_shapes() -> None:
    model = llama.build()
    config = model.config
    attn = model.layers[0].self_attn
    assert attn.q_proj.out_features == config.num_attention_heads * config.head_dim
    assert attn.k_proj.out_features == config.num_key_value_heads * config.head_dim
    assert all(module.bias is None for module in model.modules() if isinstance(module, nn.Linear))


def test_llama_grouped_heads_given_to_attention_compute_the_same() -> None:
    """`repeat_kv=False` hands attention the key/value heads grouped (`enable_gqa`): same loss."""
    input_ids, labels = llama.example_inputs(batch=2, seq=8)
    with torch.no_grad():
        want = llama.build(num_key_value_heads=1)(input_ids, labels)
        got = llama.build(num_key_value_heads=1, repeat_kv=False)(input_ids, labels)
    torch.testing.assert_close(got, want)


def test_llama_is_causal() -> None:
    model = llama.build(num_hidden_layers=2)
    input_ids, _ = llama.example_inputs(batch=1, seq=8)
    changed = input_ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids)[:, :-1], model(changed)[:, :-1])


def test_gpt_ties_lm_head_to_wte() -> None:
    model = gpt.build()
    assert model.lm_head.weight is model.wte.weight
    names = {name for name, _ in model.named_modules()}
    assert {"wte", "wpe", "h.0.ln_1", "h.0.attn.q_proj", "h.0.attn.out_proj", "h.0.mlp.fc", "ln_f"} <= names
