"""Built-in shapes' data (config.json contents): weightless shapes for `load_format="dummy"` and
for `cover-vllm make-checkpoint --shape NAME`. Each family's registry entry (models/registry.py)
names its shapes; `DUMMY_CONFIGS` (name -> config) is that table, kept for older callers.

Full-size shapes follow the published config.json of each model (sources next to each one).
"""

from __future__ import annotations

from typing import Any

# A LLaDA-architecture config of about 50 M parameters (system benchmarks need no download).
# bf16 like the full-size models (dtype="auto" falls back to fp32 on a CPU without bf16).
LLADA_50M: dict[str, Any] = {
    "model_type": "llada", "d_model": 512, "n_layers": 10, "n_heads": 8, "n_kv_heads": 8,
    "mlp_hidden_size": 1536, "vocab_size": 16384, "embedding_size": 16384,
    "mask_token_id": 16383, "eos_token_id": 16382, "pad_token_id": 16382,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_sequence_length": 4096,
    "include_bias": False, "weight_tying": False, "torch_dtype": "bfloat16",
}

# A LLaDA-architecture config of 0.30 B parameters (1.2 GB in fp32): the "few hundred million"
# size of the scale tests (fp32 TP=2 == TP=1 on a written checkpoint, peak-memory checks).
LLADA_300M: dict[str, Any] = {
    **LLADA_50M, "torch_dtype": "float32", "d_model": 1024, "n_layers": 16, "n_heads": 16, "n_kv_heads": 16,
    "mlp_hidden_size": 3584, "vocab_size": 32768, "embedding_size": 32768,
    "mask_token_id": 32767, "eos_token_id": 32766, "pad_token_id": 32766,
}

# GSAI-ML/LLaDA-8B-Instruct's shape (8.02 B parameters; the token ids are its tokenizer's).
# GSAI-ML/LLaDA-1.5 is the same architecture and tokenizer (a VRPO fine-tune of LLaDA-8B-
# Instruct), so it shares this config.
LLADA_8B: dict[str, Any] = {
    "model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32,
    "mlp_hidden_size": 12288, "vocab_size": 126464, "embedding_size": 126464,
    "mask_token_id": 126336, "eos_token_id": 126081, "eot_token_id": 126348,
    "pad_token_id": 126081, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_sequence_length": 4096, "include_bias": False, "include_qkv_bias": False,
    "weight_tying": False, "torch_dtype": "bfloat16",
}

# Dream-org/Dream-v0-Instruct-7B's shape, i.e. Qwen2.5-7B (7.6 B parameters); <|im_end|> 151645
# ends a chat turn, so it is listed as the end-of-turn id next to <|endoftext|> 151643.
# Dream-org/Dream-Coder-v0-Instruct-7B is adapted from Qwen2.5-Coder-7B, the same shape and
# vocabulary, so it shares this config.
DREAM_7B: dict[str, Any] = {
    "model_type": "Dream", "hidden_size": 3584, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
    "vocab_size": 152064, "mask_token_id": 151666, "eos_token_id": 151643,
    "eot_token_id": 151645, "pad_token_id": 151643, "bos_token_id": 151643,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

# inclusionAI/LLaDA-MoE-7B-A1B-{Base,Instruct}: 16 OLMoE-style layers, hidden 2048, 16 heads
# (no GQA), 64 experts of width 1024, top-8 (softmax, not renormalised), q/k RMSNorm, no shared
# expert, every layer MoE, RoPE theta 50000, vocabulary 157184 (the Ling / LLaDA2 tokenizer:
# <|mask|> 156895, <|endoftext|> 156892). 7.36 B parameters = 14.7 GB in bf16, which matches the
# published repository (huggingface.co/inclusionAI/LLaDA-MoE-7B-A1B-Base/tree/main: 3 shards,
# 5 + 5 + 4.72 GB, "14.7 GB") and a third-party measurement of its bf16 expert weights (12288
# MiB = 16 x 64 x 3 x 2048 x 1024 x 2 bytes). Key names follow configuration_lladamoe.py
# (../shared/golden/llada_moe/model/config.json has the key set); dense_intermediate_size is
# unused when every layer is MoE.
LLADA_MOE_7B: dict[str, Any] = {
    "model_type": "lladamoe", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
    "num_experts_per_tok": 8, "expert_intermediate_size": 1024, "dense_intermediate_size": 8192,
    "shared_expert_intermediate_size": None, "moe_layer_freq": [1] * 16, "qk_layernorm": True,
    "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax",
    "norm_topk_prob": False, "partial_rotary_factor": 1.0, "rope_theta": 50000.0,
    "rope_scaling": None, "attention_bias": False, "clip_qkv": None, "vocab_size": 157184,
    "mask_token_id": 156895, "eos_token_id": 156892, "pad_token_id": 156892,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def __getattr__(name: str) -> Any:
    """`DUMMY_CONFIGS`: every built-in shape by name, from the registry (one source of truth)."""
    if name == "DUMMY_CONFIGS":
        from cover_vllm.models.registry import builtin_shapes

        return builtin_shapes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
