"""`nn.MultiheadAttention` captured head-first, so tensor and context rules can split it.

PyTorch's own forward (`F.multi_head_attention_forward`) lays attention out sequence-first and
folds the heads into the batch, `q.view(T, B * H, D)`: a split of the heads would be a strided
piece of that merged dim. While capturing, meshplan calls instead the same computation written
as a Hugging Face attention is, heads a dim of their own:

    qkv = F.linear(x, in_proj_weight, in_proj_bias).view(B, T, 3, H, D)     # self-attention
    q, k, v = qkv.unbind(2)                                                  # (B, T, H, D) each
    out = F.scaled_dot_product_attention(q.transpose(1, 2), ..., mask, dropout, is_causal)
    out = self.out_proj(out.transpose(1, 2).reshape(B, T, E))

The parameters are the module's own (their names and layout unchanged), the masks are
canonicalized as PyTorch does (a boolean mask's True is a position not attended), and with
`need_weights` the weights are computed as PyTorch does (softmax of the scaled scores, averaged
over heads unless `average_attn_weights=False`). So `column over tp` on the module splits its
packed `in_proj_weight` as q, k and v blocks by heads, and `row over tp` on its `out_proj`
splits that by rows; `meshplan verify` compares the program against PyTorch's own forward.

Cross-attention (query is not key) takes its pieces of the packed weight and bias
(`in_proj_weight.view(3, E, E)[i]`), or the separate q/k/v weights of a module whose keys and
values have another width: `weights.py` follows both. Kept as PyTorch writes them (the walk
refuses a split of them with its own message): unbatched inputs, `add_bias_kv`, `add_zero_attn`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@contextlib.contextmanager
def heads_first(model: nn.Module) -> Iterator[None]:
    """While capturing: every `nn.MultiheadAttention` of `model` runs `_forward`."""
    patched = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    for module in patched:
        setattr(module, "forward", _forward(module))  # an instance attribute: shadows the class's  # noqa: B010
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _forward(module: nn.MultiheadAttention):
    original = type(module).forward.__get__(module)

    def forward(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if query.dim() != 3 or module.bias_k is not None or module.add_zero_attn:
            return original(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        q, k, v = _project(module, query, key, value)  # (B, H, T, D)
        mask, causal = _mask(module, q, k, key_padding_mask, attn_mask, is_causal, need_weights)
        dropout = module.dropout if module.training else 0.0
        weights = None
        if need_weights:
            scores = (q * math.sqrt(1.0 / q.shape[-1])) @ k.transpose(-2, -1)
            probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            weights = probs.mean(dim=1) if average_attn_weights else probs
            out = F.dropout(probs, dropout) @ v if dropout else probs @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal=causal)
        B, H, T, D = out.shape
        out = module.out_proj(out.transpose(1, 2).reshape(B, T, H * D))
        return (out if module.batch_first else out.transpose(0, 1)), weights

    return forward


def _project(module: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor) -> list[Tensor]:
    """q, k and v, (B, H, T, D) each, by the module's projections."""
    itself = query is key and key is value
    if not module.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    H, E = module.num_heads, module.embed_dim
    B, T, D = query.shape[0], query.shape[1], E // H
    bias = module.in_proj_bias
    if module._qkv_same_embed_dim and itself:  # self-attention: one product
        qkv = F.linear(query, module.in_proj_weight, bias).view(B, T, 3, H, D)
        return [t.transpose(1, 2) for t in qkv.unbind(2)]
    if module._qkv_same_embed_dim:
        weights = list(module.in_proj_weight.view(3, E, E).unbind(0))
    else:
        weights = [module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
    biases = list(bias.view(3, E).unbind(0)) if bias is not None else [None] * 3
    return [
        F.linear(x, w, b).view(B, x.shape[1], H, D).transpose(1, 2)
        for x, w, b in zip((query, key, value), weights, biases, strict=True)
    ]


def _mask(
    module: nn.MultiheadAttention,
    q: Tensor,
    k: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    need_weights: bool,
) -> tuple[Tensor | None, bool]:
    """The additive mask for (B, H, T, S) scores, and whether attention is causal, as
    `F.multi_head_attention_forward` decides them."""
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=q.dtype,
    )
    if is_causal and key_padding_mask is None and not need_weights:
        return None, True  # PyTorch trusts the hint and drops the mask
    attn_mask = F._canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=q.dtype,
        check_other=False,
    )
    if attn_mask is not None:
        attn_mask = attn_mask.view(1, 1, T, S) if attn_mask.dim() == 2 else attn_mask.view(B, H, T, S)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(B, 1, 1, S)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    return attn_mask, False
