"""Models written the ways plain PyTorch code writes them, outside the Hugging Face decoder
families: linears as matmuls with their own parameters, a fused q/k/v projection reshaped as
timm does, a state-space-style input projection chunked in two, and PyTorch's own
`nn.TransformerEncoder` (`nn.MultiheadAttention`). Small language models (vocabulary 256) that
return the loss, so `meshplan verify` and the parity tests train them as they are.

    meshplan verify plan.plan --model tests/compiler/plain_models.py:matmul_gpt
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


class MatmulLinear(nn.Module):
    """A linear layer written as a matmul (`x @ weight.T`), the weight stored (out, in), as many
    hand-written models and some Hugging Face families do; `transposed=True` stores it (in, out)
    and multiplies by it directly."""

    def __init__(self, inp: int, out: int, bias: bool = True, transposed: bool = False):
        super().__init__()
        self.transposed = transposed
        shape = (inp, out) if transposed else (out, inp)
        self.weight = nn.Parameter(torch.randn(shape) / math.sqrt(inp))
        self.bias = nn.Parameter(torch.randn(out) * 0.1) if bias else None

    def forward(self, x):
        y = x @ self.weight if self.transposed else x @ self.weight.T
        return y + self.bias if self.bias is not None else y


class _Attention(nn.Module):
    """Causal self-attention over a fused q/k/v projection, split the way `layout` says:
    "timm" reshapes it to (B, T, 3, H, D) and unbinds; "chunk" chunks it in three; "split"
    splits it in three; "separate" has one projection each."""

    def __init__(self, hidden: int, heads: int, layout: str, linear):
        super().__init__()
        self.heads, self.layout = heads, layout
        if layout == "separate":
            self.q, self.k, self.v = (linear(hidden, hidden) for _ in range(3))
        else:
            self.qkv = linear(hidden, 3 * hidden)
        self.proj = linear(hidden, hidden)

    def forward(self, x):
        B, T, C = x.shape
        H, D = self.heads, C // self.heads
        if self.layout == "timm":
            qkv = self.qkv(x).reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
        else:
            if self.layout == "separate":
                q, k, v = self.q(x), self.k(x), self.v(x)
            elif self.layout == "chunk":
                q, k, v = self.qkv(x).chunk(3, dim=-1)
            else:
                q, k, v = self.qkv(x).split(C, dim=2)
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(B, T, C))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, layout: str, linear):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads, layout, linear)
        self.fc1, self.fc2 = linear(hidden, 4 * hidden), linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    """A GPT: token and position embeddings, `layers` blocks, a final norm and an untied head."""

    def __init__(self, layout: str = "separate", linear=nn.Linear, hidden=32, heads=4, layers=2, seq=64):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=seq)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(_Block(hidden, heads, layout, linear) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = linear(hidden, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def matmul_gpt():
    """Every linear a matmul with its own parameters, weights stored (out, in)."""
    torch.manual_seed(0)
    return TinyLM("separate", MatmulLinear)


def matmul_gpt_transposed():
    """Every linear a matmul by a weight stored (in, out)."""
    torch.manual_seed(0)
    return TinyLM("separate", lambda i, o: MatmulLinear(i, o, transposed=True))


def timm_attention():
    """timm's ViT attention layout: qkv(x).reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)."""
    torch.manual_seed(0)
    return TinyLM("timm")


def chunked_qkv():
    torch.manual_seed(0)
    return TinyLM("chunk")


def timm_matmul():
    """timm's layout with the fused projection written as a matmul."""
    torch.manual_seed(0)
    return TinyLM("timm", MatmulLinear)


class _GatedMixer(nn.Module):
    """A state-space model's block shape (Mamba's): one input projection chunked into the mixed
    stream and its gate, a per-channel mixing along the sequence, the gate, the output projection."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.decay = nn.Parameter(torch.rand(inner))
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        xz = self.in_proj(x).transpose(1, 2)  # (B, 2I, T)
        u, z = xz.chunk(2, dim=1)
        u = torch.cumsum(u * torch.sigmoid(self.decay)[:, None], dim=2)  # each channel along T
        y = (u * F.silu(z)).transpose(1, 2)
        return self.out_proj(y)


class GatedLM(nn.Module):
    def __init__(self, hidden=32, inner=64, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.mixers = nn.ModuleList(_GatedMixer(hidden, inner) for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for norm, mixer in zip(self.norms, self.mixers, strict=True):
            x = x + mixer(norm(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def gated_mixer():
    torch.manual_seed(0)
    return GatedLM()


class EncoderLM(nn.Module):
    """A language model on PyTorch's own `nn.TransformerEncoder`: `nn.MultiheadAttention` with its
    packed `in_proj_weight`, a causal mask, batch-first."""

    def __init__(self, hidden=32, heads=4, layers=2, seq=64, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=seq)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(
            hidden, heads, 4 * hidden, dropout=0.0, batch_first=batch_first, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, labels):
        T = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos[:T]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device, dtype=x.dtype)
        if not self.batch_first:
            x = x.transpose(0, 1)
        x = self.encoder(x, mask=mask, is_causal=True)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def encoder_lm():
    torch.manual_seed(0)
    return EncoderLM()


def encoder_lm_seq_first():
    torch.manual_seed(0)
    return EncoderLM(batch_first=False)


def example_inputs(batch: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


class _PaddedSelfAttention(nn.Module):
    """nn.MultiheadAttention called directly, as users do: its weights returned (need_weights
    defaults to True), a boolean causal mask, a key padding mask."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, padding):
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # True: not attended
        h = self.norm(x)
        out, weights = self.attn(h, h, h, key_padding_mask=padding, attn_mask=causal)
        x = x + out + 0.0 * weights.sum()
        return x + self.mlp(x)


class DirectMHA(nn.Module):
    def __init__(self, hidden=32, heads=4, layers=2, seq=64):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=seq)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(_PaddedSelfAttention(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, labels):
        padding = input_ids == 0  # token 0 pads: not attended
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, padding)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def direct_mha():
    torch.manual_seed(0)
    return DirectMHA()


class _CrossAttention(nn.Module):
    """A decoder block's cross-attention (nn.MultiheadAttention with query != key): its packed
    `in_proj_weight` is sliced into the query's and the key/value's pieces."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)

    def forward(self, x, memory):
        out, _ = self.attn(self.norm(x), memory, memory, need_weights=False)
        return x + out


class CrossLM(nn.Module):
    """nn.TransformerDecoder-style: each layer attends to a memory (the embedded tokens, shifted)."""

    def __init__(self, hidden=32, heads=4, layers=2, seq=64):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=seq)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.memory = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(_CrossAttention(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        memory = self.memory(x.flip(1))
        for layer in self.layers:
            x = layer(x, memory)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def cross_mha():
    torch.manual_seed(0)
    return CrossLM()


def cross_mha_kdim():
    """Cross-attention whose keys and values come from a memory of another width (kdim, vdim):
    separate q/k/v weights beside one packed bias."""
    torch.manual_seed(0)
    model = CrossLM()
    for layer in model.layers:
        layer.attn = nn.MultiheadAttention(32, 4, batch_first=True, kdim=48, vdim=48)
    model.memory = nn.Linear(32, 48)
    return model
