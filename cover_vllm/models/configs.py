"""Weightless built-in configs (config.json contents) for benchmarks with load_format="dummy"."""

from __future__ import annotations

from typing import Any

# A LLaDA-architecture config of about 50 M parameters (system benchmarks need no download).
LLADA_50M: dict[str, Any] = {
    "model_type": "llada", "d_model": 512, "n_layers": 10, "n_heads": 8, "n_kv_heads": 8,
    "mlp_hidden_size": 1536, "vocab_size": 16384, "embedding_size": 16384,
    "mask_token_id": 16383, "eos_token_id": 16382, "pad_token_id": 16382,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_sequence_length": 4096,
    "include_bias": False, "weight_tying": False, "torch_dtype": "float32",
}

# GSAI-ML/LLaDA-8B-Instruct's shape (8.02 B parameters; the token ids are its tokenizer's).
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
DREAM_7B: dict[str, Any] = {
    "model_type": "Dream", "hidden_size": 3584, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
    "vocab_size": 152064, "mask_token_id": 151666, "eos_token_id": 151643,
    "eot_token_id": 151645, "pad_token_id": 151643, "bos_token_id": 151643,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "llada-50m": LLADA_50M, "llada-8b": LLADA_8B, "dream-7b": DREAM_7B,
}
