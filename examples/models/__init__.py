"""Tiny decoder-only language models written the way a user writes them.

Each module has a `@dataclass` config whose field names follow Hugging Face's
canonical config names (`hidden_size`, `num_attention_heads`, ...), so compiler
checks can read `model.config` the same way for these models and for `transformers`
models. Each module also has `build(seed=0, **overrides)`, the factory a `.plan`
names (`--model examples/models/llama.py:build`), and `example_inputs(...)`.
"""
