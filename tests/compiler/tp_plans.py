"""Tensor-parallel plan texts shared by the compiler tests (Megatron layouts per model family)."""


def llama_tp(n: int = 2, prefix: str = "") -> str:
    """Column/row pairs for attention and MLP, vocab-parallel embedding and LM head.
    `prefix` is `model.` for Hugging Face's LlamaForCausalLM family."""
    return f"""
mesh tp={n}

modules {{
    {prefix}layers.*.self_attn.{{q,k,v}}_proj: column over tp
    {prefix}layers.*.self_attn.o_proj:       row over tp
    {prefix}layers.*.mlp.{{gate,up}}_proj:     column over tp
    {prefix}layers.*.mlp.down_proj:          row over tp
    {prefix}embed_tokens:                    vocab over tp
    lm_head:                            vocab over tp
}}
"""


GPT2_TP = """
mesh tp=2

modules {
    transformer.h.*.attn.c_attn: column over tp
    transformer.h.*.attn.c_proj: row over tp
    transformer.h.*.mlp.c_fc:    column over tp
    transformer.h.*.mlp.c_proj:  row over tp
    transformer.wte:             vocab over tp
    lm_head:                     vocab over tp
}
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
