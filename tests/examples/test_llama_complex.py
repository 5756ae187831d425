"""The torchtitan-style example Llama: complex RoPE, nn.RMSNorm, `(logits, loss)` out."""

from __future__ import annotations

import math

import torch
from torch import nn

from meshplan.examples.models import llama_complex


def test_module_names_and_dims_are_torchtitan_s():
    model = llama_complex.build()
    names = {name for name, _ in model.named_modules()}
    assert {"tok_embeddings", "norm", "output", "layers.1.attention_norm", "layers.1.ffn_norm"} <= names
    assert {f"layers.0.attention.{w}" for w in ("wq", "wk", "wv", "wo")} <= names
    assert {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")} <= names
    assert isinstance(model.norm, nn.RMSNorm)
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (512, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert model.layers[0].attention.wk.out_features == 2 * 16  # 2 kv heads of 16


def test_rope_table_is_complex64_and_not_in_the_state_dict():
    model = llama_complex.build()
    assert model.freqs_cis.dtype == torch.complex64
    assert model.freqs_cis.shape == (model.config.max_position_embeddings, model.config.head_dim // 2)
    assert torch.allclose(model.freqs_cis.abs(), torch.ones(()))
    assert "freqs_cis" not in model.state_dict()


def test_same_seed_same_weights_and_rng_left_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, b = llama_complex.build(seed=3), llama_complex.build(seed=3)
    llama_complex.example_inputs()
    assert torch.equal(torch.rand(3), expected)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(llama_complex.build(seed=4).output.weight, a.output.weight)


def test_logits_and_a_token_mean_loss():
    model = llama_complex.build()
    tokens, targets = llama_complex.example_inputs(batch=2, seq=16)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    logits = model(tokens)
    assert logits.shape == (2, 16, 512)
    out_logits, loss = model(tokens, targets)
    assert torch.equal(out_logits, logits)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert torch.allclose(loss, expected)
    assert abs(loss.item() - math.log(512)) < 0.05 * math.log(512)  # small initial weights: near uniform


def test_rope_scores_depend_on_relative_position_only():
    """q.k after rotation depends on the distance between the positions, not on where they are."""
    model = llama_complex.build()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 16, generator=generator).expand(1, 8, 1, 16)  # (B, T, nh, D)
    k = torch.randn(1, 1, 1, 16, generator=generator).expand(1, 8, 1, 16)
    rq, rk = llama_complex.apply_rotary_emb(q, k, model.freqs_cis[:8])
    score = lambda m, n: float((rq[0, m, 0] * rk[0, n, 0]).sum())  # noqa: E731
    assert abs(score(3, 1) - score(7, 5)) < 1e-5
    assert abs(score(3, 1) - score(3, 2)) > 1e-3
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1))
