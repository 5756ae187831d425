"""The example Llama with one key/value head for its four query heads (multi-query attention):
fewer key/value heads than a context size of 2. Layers 0 and 2 repeat the head to the query
heads before attention (`repeat_interleave`), layers 1 and 3 hand it to attention grouped
(`enable_gqa`): both ways a model can reach attention with GQA."""

from meshplan.examples.models import llama


def build() -> llama.Llama:
    model = llama.build(num_key_value_heads=1, repeat_kv=False)
    for layer in model.layers[::2]:
        layer.self_attn.repeat_kv = True
    return model
