"""The example Llama with one key/value head for its four query heads (multi-query attention),
handed to attention grouped (`enable_gqa`): fewer key/value heads than a context size of 2."""

from meshplan.examples.models import llama


def build() -> llama.Llama:
    return llama.build(num_key_value_heads=1, repeat_kv=False)
