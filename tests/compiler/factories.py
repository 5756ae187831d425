"""Model factories for compiler tests, loaded by spec like a user's file:
`tests/compiler/factories.py:llama_tp4`. Every factory is deterministic (seeded)."""

import torch
from torch import nn

from meshplan.examples.models import gpt, llama


def llama_tp4():
    """The example Llama with 8 heads and 4 kv heads, so it splits 4 ways."""
    return llama.build(num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)


def llama_tp8():
    """8 heads, 8 kv heads: splits 8 ways."""
    return llama.build(
        num_attention_heads=8, num_key_value_heads=8, intermediate_size=128, num_hidden_layers=2
    )


def gpt_small():
    return gpt.build(num_hidden_layers=2)


class ExplicitHeads(nn.Module):
    """Attention that reshapes with a literal head count, as much older model code does:
    the compiler must rewrite `view(B, T, 4, 16)` to the local head count."""

    def __init__(self, hidden: int = 64, heads: int = 4, vocab: int = 256):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.embed = nn.Embedding(vocab, hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)  # (B, T, H)
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, D)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def explicit_heads():
    torch.manual_seed(0)
    return ExplicitHeads()


def example_inputs(batch: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class NanoGPT(gpt.GPT):
    """The example GPT with nanoGPT's loss: `(logits, loss)`, flattened with `view(-1, V)`,
    `ignore_index=-1` (whose class-weight argument is None in the captured graph)."""

    def forward(self, input_ids, labels):
        T = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(
            logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1
        )
        return logits, loss


def nanogpt():
    torch.manual_seed(0)
    model = NanoGPT(gpt.GPTConfig(num_hidden_layers=2))
    model.lm_head.weight = model.wte.weight
    return model


# ---------------------------------------------------------------- a dropless mixture of experts


class Experts(nn.Module):
    """Dropless experts as one module with 3-D weights, looping over per-expert token counts."""

    def __init__(self, num_experts, hidden, inner):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, inner) * 0.02)
        self.w2 = nn.Parameter(torch.randn(num_experts, inner, hidden) * 0.02)

    def forward(self, x, counts):  # x: (N, H) sorted by expert
        outs = []
        start = 0
        for e, n in enumerate(counts.tolist()):
            chunk = x[start : start + n]
            outs.append(torch.nn.functional.silu(chunk @ self.w1[e]) @ self.w2[e])
            start += n
        return torch.cat(outs)


class DroplessMoE(nn.Module):
    def __init__(self, hidden=32, inner=64, num_experts=4, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inner)
        self.num_experts = num_experts

    def forward(self, x):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs = self.router(flat).softmax(-1)
        weights, idx = probs.topk(self.k, dim=-1)  # (N, k)
        order = idx.flatten().argsort()
        tokens = flat.repeat_interleave(self.k, dim=0)[order]
        counts = (idx.flatten()[:, None] == torch.arange(self.num_experts)).sum(0)  # (E,)
        out = self.experts(tokens, counts)
        back = torch.empty_like(out)
        back[order] = out
        back = (back.view(-1, self.k, h) * weights.unsqueeze(-1)).sum(1)
        return back.view(b, t, h)


class MoEBlock(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.moe = DroplessMoE(hidden)

    def forward(self, x):
        b, t, h = x.shape
        y = self.norm1(x)
        q, k, v = (p(y).view(b, t, 4, h // 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = (
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(b, t, h)
        )
        x = x + self.o(a)
        return x + self.moe(self.norm2(x))


class MoEModel(nn.Module):
    def __init__(self, vocab=256, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([MoEBlock(hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def dropless_moe():
    """Attention + a dropless MoE whose experts loop over data-dependent token counts."""
    torch.manual_seed(0)
    return MoEModel()


# ---------------------------------------------------------------- a torchtitan-style Llama


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class TitanAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.hd)
        k = self.wk(x).view(b, t, -1, self.hd)
        v = self.wv(x).view(b, t, -1, self.hd)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class TitanFeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv):
        super().__init__()
        self.attention = TitanAttention(dim, n_heads, n_kv)
        self.feed_forward = TitanFeedForward(dim, 4 * dim)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanTransformer(nn.Module):
    def __init__(self, vocab=512, dim=64, n_layers=2, n_heads=4, n_kv=2, max_seq=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq), persistent=False)
        self.layers = nn.ModuleList(TitanBlock(dim, n_heads, n_kv) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets=None):
        t = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs = self.freqs_cis[:t]
        for layer in self.layers:
            h = layer(h, freqs)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        loss = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"
            )
            / targets.numel()
        )
        return logits, loss


def titan_llama():
    """A Llama in plain PyTorch as torchtitan writes it: nn.RMSNorm, complex RoPE (a complex64
    `freqs_cis` buffer, view_as_complex/view_as_real), GQA by repeat_interleave, a sum-reduced
    loss divided by the token count, `(logits, loss)` out. Its vocabulary is 512, so the
    factories' example inputs (ids below 256) leave the upper half of a vocab shard unused."""
    torch.manual_seed(0)
    return TitanTransformer()


def llama_gqa():
    """8 query heads over 2 key/value heads: at tp=4 each kv head is shared by two ranks."""
    return llama.build(
        num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2
    )
