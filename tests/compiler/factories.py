"""Model factories for compiler tests, loaded by spec like a user's file:
`tests/compiler/factories.py:llama_tp4`. Every factory is deterministic (seeded)."""

import math

import torch
from torch import nn

from meshplan.examples.models import gpt, llama, llama_complex


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


class ArgmaxRouted(nn.Module):
    """A router whose weight reaches the loss only through `argmax`: it never gets a gradient,
    so AdamW on one device leaves it alone (`.grad` None), weight decay included."""

    def __init__(self, hidden: int = 32, vocab: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.router = nn.Linear(hidden, 2, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.head = nn.Linear(2 * hidden, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        choice = self.router(x).argmax(-1, keepdim=True).to(x.dtype)  # (B, T, 1), no gradient
        h = torch.relu(self.up(x)) * (1 + choice)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def argmax_routed():
    torch.manual_seed(0)
    return ArgmaxRouted()


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
    model = NanoGPT(gpt.GPTConfig(num_hidden_layers=2, vocab_size=512))  # ids beyond example_inputs'
    model.lm_head.weight = model.wte.weight
    return model


class GPTWithLoss(gpt.GPT):
    """The example GPT with another way of writing the loss (what trainers use besides the mean)."""

    def __init__(self, config, loss: str):
        super().__init__(config)
        self.loss = loss

    def forward(self, input_ids, labels):
        T = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)).flatten(0, 1)  # (B*T, V)
        labels = labels.flatten()
        F = torch.nn.functional
        if self.loss == "sum":  # summed, then divided by the token count
            return F.cross_entropy(logits, labels, reduction="sum") / labels.numel()
        if self.loss == "smoothed":
            return F.cross_entropy(logits, labels, label_smoothing=0.1)
        if self.loss == "log_softmax":  # no vocab-parallel rule: the logits are gathered
            return -F.log_softmax(logits, dim=-1).gather(1, labels[:, None]).mean()
        per_token = F.cross_entropy(logits, labels, reduction="none")  # (B*T,)
        weights = torch.linspace(0.5, 1.5, per_token.numel())
        return (per_token * weights).mean()


def _gpt_with_loss(loss: str):
    torch.manual_seed(0)
    return GPTWithLoss(gpt.GPTConfig(num_hidden_layers=2), loss)


def gpt_odd_vocab():
    """The example GPT (tied embedding and head) over 511 tokens: no tensor-parallel size divides it."""
    return gpt.build(vocab_size=511, num_hidden_layers=2)


def gpt_odd_vocab_smoothed():
    torch.manual_seed(0)
    return GPTWithLoss(gpt.GPTConfig(num_hidden_layers=2, vocab_size=511), "smoothed")


def gpt_odd_vocab_log_softmax():
    torch.manual_seed(0)
    return GPTWithLoss(gpt.GPTConfig(num_hidden_layers=2, vocab_size=511), "log_softmax")


def gpt_sum_loss():
    return _gpt_with_loss("sum")


def gpt_smoothed_loss():
    return _gpt_with_loss("smoothed")


def gpt_token_losses():
    return _gpt_with_loss("none")


class LanguageModelLoss(nn.Module):
    """A logits-only model (PyTorch's DTensor test Transformer) with a causal-LM loss around it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        logits = self.model(input_ids)  # (B, T, V) in float32
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def dtensor_transformer():
    """The Transformer of torch.testing._internal.distributed._tensor.common_dtensor, as PyTorch's
    own tensor-parallel tests build it: tied embedding and output, learned positions, LayerNorm."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    return LanguageModelLoss(Transformer(ModelArgs(vocab_size=256, max_seq_len=32, dim=32, dropout_p=0.0)))


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


def titan_llama():
    """The example Llama written as torchtitan writes it (examples/models/llama_complex.py):
    nn.RMSNorm, complex RoPE, GQA by repeat_interleave, a sum-reduced loss, `(logits, loss)`."""
    return llama_complex.build()


def titan_llama_lerp():
    """The torchtitan-style Llama with an op after RoPE whose last input is whole: at tp=4 the
    shared kv heads meet a replicated tensor (`lerp(k, zeros, 0)`, k unchanged)."""
    import types

    model = llama_complex.build()
    for layer in model.layers:
        attention = layer.attention
        rotate = llama_complex.apply_rotary_emb

        def forward(self, x, freqs_cis, _rotate=rotate):
            b, t, _ = x.shape
            q = self.wq(x).view(b, t, -1, self.head_dim)
            k = self.wk(x).view(b, t, -1, self.head_dim)
            v = self.wv(x).view(b, t, -1, self.head_dim)
            q, k = _rotate(q, k, freqs_cis)
            k = torch.lerp(k, torch.zeros(k.shape[-1], dtype=k.dtype), 0.0)  # last input: whole
            k = k.repeat_interleave(self.num_kv_groups, dim=2)
            v = v.repeat_interleave(self.num_kv_groups, dim=2)
            y = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))

        attention.forward = types.MethodType(forward, attention)
    return model


def llama_deep():
    """32 layers: a graph of thousands of nodes."""
    return llama.build(num_hidden_layers=32, intermediate_size=64)


def llama_gqa():
    """8 query heads over 2 key/value heads: at tp=4 each kv head is shared by two ranks."""
    return llama.build(
        num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2
    )


class TokenMix(nn.Module):
    """A toy whose activations must move between dims while sharded: an MLP whose row split
    reduce-scatters onto tokens (sequence parallelism), a norm on the token shards, a softmax
    over the tokens (which cannot stay sharded there), a softmax over the features (which
    cannot be sharded there either)."""

    def __init__(self, vocab: int = 256, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        x = self.down(torch.nn.functional.gelu(self.up(self.embed(input_ids))))  # (B, T, H)
        x = self.norm(x)
        x = torch.softmax(x, dim=1)  # over tokens
        x = torch.softmax(x * 4.0, dim=2)  # over features
        logits = self.head(x)  # (B, T, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def token_mix():
    torch.manual_seed(0)
    return TokenMix()


class MatmulAttention(nn.Module):
    """nanoGPT's attention, written out: scores by matmul, a causal mask buffer, softmax, matmul."""

    def __init__(self, attention: nn.Module, max_positions: int = 128):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = attention.q_proj, attention.k_proj, attention.v_proj
        self.out_proj, self.head_dim = attention.out_proj, attention.head_dim
        mask = torch.tril(torch.ones(max_positions, max_positions))
        self.register_buffer("bias", mask.view(1, 1, max_positions, max_positions), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        att = self.scaled(q @ k.transpose(-2, -1))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)  # (B, T, H)
        return self.out_proj(y)

    def scaled(self, scores: torch.Tensor) -> torch.Tensor:
        return scores * (1.0 / math.sqrt(self.head_dim))


def gpt_matmul_attention(attention: type[MatmulAttention] = MatmulAttention):
    """The example GPT with attention written out in matmuls, as many plain PyTorch models have it."""
    torch.manual_seed(0)
    model = gpt.build(num_hidden_layers=2)
    for block in model.h:
        block.attn = attention(block.attn)
    return model


class LearnedTemperatureAttention(MatmulAttention):
    """`MatmulAttention` whose scores are scaled by a learned tensor, not a number: not the
    attention `scaled_dot_product_attention` computes."""

    def __init__(self, attention: nn.Module):
        super().__init__(attention)
        self.temperature = nn.Parameter(torch.ones(()))

    def scaled(self, scores: torch.Tensor) -> torch.Tensor:
        return scores * self.temperature


def gpt_learned_temperature_attention():
    return gpt_matmul_attention(LearnedTemperatureAttention)
