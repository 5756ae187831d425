"""Plan texts shared by the tests: the Megatron layout of each model family, and the blocks
around it. A test builds the plan it needs from these instead of copying rule text:

    plan(llama_rules() + llama_sequence(), mesh="dp=2, tp=2", extra=data_parallel(zero=3))
"""


def plan(rules: str, *, mesh: str = "tp=2", extra: str = "") -> str:
    """A plan: `mesh`, the `modules` block of `rules`, then any further blocks."""
    return f"mesh {mesh}\n\nmodules {{{rules}}}\n{extra}"


def data_parallel(
    *, zero: int | str = 0, bucket: str | None = None, axis: str = "dp", compress: str | None = None
) -> str:
    """A `data_parallel` block (`zero` may be a placeholder a test substitutes)."""
    bucket_line = f"    bucket = {bucket}\n" if bucket else ""
    compress_line = f"    compress = {compress}\n" if compress else ""
    return f"\ndata_parallel over {axis} {{\n    zero = {zero}\n{bucket_line}{compress_line}}}\n"


def llama_rules(prefix: str = "", *, vocab: bool = True) -> str:
    """Column/row pairs for attention and MLP and (with `vocab`) vocab-parallel embedding and
    LM head. `prefix` is `model.` for Hugging Face's LlamaForCausalLM family."""
    rules = f"""
    {prefix}layers.*.self_attn.{{q,k,v}}_proj: column over tp
    {prefix}layers.*.self_attn.o_proj:       row over tp
    {prefix}layers.*.mlp.{{gate,up}}_proj:     column over tp
    {prefix}layers.*.mlp.down_proj:          row over tp
"""
    if vocab:
        rules += f"""    {prefix}embed_tokens:                    vocab over tp
    {"lm_head:":<{33 + len(prefix)}}vocab over tp
"""
    return rules


def llama_sequence(prefix: str = "") -> str:
    """Megatron sequence parallelism: the norms on sequence shards."""
    return f"""
    {prefix}layers.*.{{input,post_attention}}_layernorm: sequence over tp
    {prefix}norm:                                      sequence over tp
"""


def llama_tp(n: int = 2, prefix: str = "") -> str:
    return plan(llama_rules(prefix), mesh=f"tp={n}")


GPT2_RULES = """
    transformer.h.*.attn.c_attn: column over tp
    transformer.h.*.attn.c_proj: row over tp
    transformer.h.*.mlp.c_fc:    column over tp
    transformer.h.*.mlp.c_proj:  row over tp
    transformer.wte:             vocab over tp
    lm_head:                     vocab over tp
"""
GPT2_SEQUENCE = """
    transformer.h.*.{ln_1,ln_2}: sequence over tp
    transformer.ln_f:            sequence over tp
"""
GPT2_TP = plan(GPT2_RULES)

BERT_RULES = """
    bert.encoder.layer.*.attention.self.{query,key,value}: column over tp
    bert.encoder.layer.*.attention.output.dense:           row over tp
    bert.encoder.layer.*.intermediate.dense:               column over tp
    bert.encoder.layer.*.output.dense:                     row over tp
    bert.embeddings.word_embeddings:                       vocab over tp
    cls.predictions.decoder:                               vocab over tp
"""
BERT_SEQUENCE = """
    bert.encoder.layer.*.attention.output.LayerNorm: sequence over tp
    bert.encoder.layer.*.output.LayerNorm:           sequence over tp
"""

# Mixtral: attention split, experts (one module with 3-D weights) replicated
MIXTRAL_RULES = """
    model.layers.*.self_attn.{q,k,v}_proj: column over tp
    model.layers.*.self_attn.o_proj:       row over tp
    model.embed_tokens:                    vocab over tp
    lm_head:                               vocab over tp
"""

# the torchtitan-style Llama in factories.py (its output head stays whole)
TITAN_RULES = """
    layers.*.attention.{wq,wk,wv}: column over tp
    layers.*.attention.wo:         row over tp
    layers.*.feed_forward.{w1,w3}: column over tp
    layers.*.feed_forward.w2:      row over tp
    tok_embeddings:                vocab over tp
"""
TITAN_SEQUENCE = """
    layers.*.{attention_norm,ffn_norm}: sequence over tp
    norm:                               sequence over tp
"""

# PyTorch's DTensor test Transformer, under the loss wrapper in factories.py
DTENSOR_RULES = """
    model.layers.*.attention.{wq,wk,wv}: column over tp
    model.layers.*.attention.wo:         row over tp
    model.layers.*.feed_forward.w1:      column over tp
    model.layers.*.feed_forward.w2:      row over tp
    model.tok_embeddings:                vocab over tp
    model.output:                        vocab over tp
"""
DTENSOR_SEQUENCE = """
    model.layers.*.{attention_norm,ffn_norm}: sequence over tp
    model.norm:                               sequence over tp
"""


PHI3_TP = """
mesh tp=2

modules {
    model.layers.*.self_attn.qkv_proj: column over tp
    model.layers.*.self_attn.o_proj:   row over tp
    model.layers.*.mlp.gate_up_proj:   column over tp
    model.layers.*.mlp.down_proj:      row over tp
    model.embed_tokens:                vocab over tp
    lm_head:                           vocab over tp
}
"""

NEOX_TP = """
mesh tp=2

modules {
    gpt_neox.layers.*.attention.query_key_value: column over tp
    gpt_neox.layers.*.attention.dense:           row over tp
    gpt_neox.layers.*.mlp.dense_h_to_4h:         column over tp
    gpt_neox.layers.*.mlp.dense_4h_to_h:         row over tp
    gpt_neox.embed_in:                           vocab over tp
    lm_head:                                     vocab over tp
}
"""
