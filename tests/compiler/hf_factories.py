"""Hugging Face models built from small configs with random weights (no download).

No `example_inputs` here: meshplan makes token inputs for models with a config
(`input_ids`, `labels`, `use_cache=False`), as it does for a user's HF model."""

import torch


def hf_llama(max_position_embeddings: int = 128, heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def hf_llama_long():
    """`hf_llama` for sequences up to 4,096 tokens."""
    return hf_llama(max_position_embeddings=4096)


def hf_llama_eager():
    """`hf_llama` with Hugging Face's own attention code (`attn_implementation="eager"`): scores by
    matmul, the causal mask added, softmax, and the GQA repeat of the kv heads by expand + reshape."""
    model = hf_llama()
    model.config._attn_implementation = "eager"
    return model


def hf_llama_eager_8_heads():
    """`hf_llama_eager` with 8 query and 4 key/value heads: enough to split over tp x cp = 4."""
    model = hf_llama(heads=8, kv_heads=4)
    model.config._attn_implementation = "eager"
    return model


def hf_gpt2(vocab_size: int = 256):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=vocab_size,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def hf_gpt2_full_vocab():
    """GPT-2's own vocabulary, 50257 tokens: odd, so every tensor-parallel size pads it."""
    return hf_gpt2(vocab_size=50257)


def _small(config_name: str, model_name: str, **extra):
    import transformers

    config = getattr(transformers, config_name)(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        **extra,
    )
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def hf_qwen2():
    """q/k/v projections with biases."""
    return _small("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2)


def hf_phi3():
    """Fused qkv_proj cut by slices of unequal size (GQA), fused gate_up_proj, a padding row."""
    return _small("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, pad_token_id=0)


def hf_neox():
    """Fused query_key_value laid out head by head: split by heads without blocks."""
    return _small("GPTNeoXConfig", "GPTNeoXForCausalLM")


def hf_mixtral():
    """Experts as one module with 3-D weights (transformers 5), routed top-2 of 4."""
    return _small("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4)


def hf_mixtral_aux():
    """Mixtral training with its router's load-balancing loss (`output_router_logits`, a large
    coefficient so that it shows), experts in the eager loop, which runs in float64."""
    return _small(
        "MixtralConfig",
        "MixtralForCausalLM",
        num_key_value_heads=2,
        num_local_experts=4,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        experts_implementation="eager",
    )


def _moe(config_name: str, model_name: str, **extra):
    """A small MoE of the family: 4 experts, top-2, experts in their eager loop (float64)."""
    defaults = {"num_key_value_heads": 2, "num_experts_per_tok": 2, "experts_implementation": "eager"}
    return _small(config_name, model_name, **{**defaults, **extra})


def hf_qwen3_moe():
    """Qwen3-MoE: q/k norms, experts stacked (E, 2I, H), its load-balancing loss in the loss."""
    return _moe(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        num_experts=4,
        moe_intermediate_size=32,
        output_router_logits=True,
    )


def hf_qwen2_moe():
    """Qwen2-MoE: a shared expert beside the routed ones, scaled by a sigmoid gate of its own."""
    return _moe(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        output_router_logits=True,
    )


def hf_olmoe():
    return _moe("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, eos_token_id=1, pad_token_id=0)


def hf_deepseek_v3():
    """DeepSeek-V3: multi-head latent attention, a shared expert, sigmoid routing with a
    per-expert bias (its `e_score_correction_bias` buffer) over groups of experts."""
    return _moe(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        num_key_value_heads=4,
        n_routed_experts=4,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=0,
        n_group=2,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )


def hf_gpt_oss():
    """GPT-OSS: experts with biases and a clamped SwiGLU, attention sinks."""
    return _moe(
        "GptOssConfig",
        "GptOssForCausalLM",
        num_local_experts=4,
        head_dim=16,
        layer_types=["full_attention", "full_attention"],
    )


def hf_bert_mlm():
    """Post-norm encoder, MLM head whose decoder bias is tied to `cls.predictions.bias`."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return BertForMaskedLM(config)


def hf_llama_meta():
    """`hf_llama` built on the meta device: shapes, no values (meshplan initializes each rank's
    pieces with the model's own `_init_weights`)."""
    with torch.device("meta"):
        return hf_llama()


def hf_t5(tie_word_embeddings: bool = False):
    """T5, an encoder-decoder: the decoder's inputs are the labels shifted right inside forward
    (written in place into zeros), a relative position bias made in each stack's first layer and
    read by the others, the encoder's output read by every decoder layer's cross attention.
    Transformers 5 ties the LM head to `shared` whatever the config says; `tie_word_embeddings`
    False (T5 v1.1) only leaves out the decoder output's d_model ** -0.5 scaling."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=256,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config)


def hf_t5_scaled():
    """`hf_t5` as the original T5: the decoder's output scaled by d_model ** -0.5 before the head."""
    return hf_t5(tie_word_embeddings=True)


def hf_falcon():
    """Falcon's new decoder architecture: one fused query_key_value laid out group by group (each
    key/value head after its query heads, picked out by list indexing and broadcast), attention
    and MLP in parallel (the attention output added into the MLP's in place), linears written
    as matmuls, the embedding tied to the head."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
    )
    torch.manual_seed(0)
    return FalconForCausalLM(config)


def hf_bloom():
    """BLOOM: ALiBi, a bias per head built as (batch x heads, 1, T) and added by `baddbmm` to
    scores whose batch and heads are flattened together."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    return BloomForCausalLM(config)


def hf_olmo2():
    """OLMo 2: q and k normalized over the whole projection (every head at once), not per head."""
    return _small("Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2, eos_token_id=2, pad_token_id=1)


def hf_llama4():
    """Llama 4's text model: every token through every expert, scaled by its router score first
    (the experts module called on (E x N, H) rows, an equal share each), a shared expert."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return Llama4ForCausalLM(config)
