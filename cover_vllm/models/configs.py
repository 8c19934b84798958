"""Built-in shapes' data (config.json contents): weightless shapes for `load_format="dummy"` and
for `cover-vllm make-checkpoint --shape NAME`. Each family's registry entry (models/registry.py)
names its shapes (`builtin_shapes`, and `DUMMY_CONFIGS`, the table by name kept for older
callers, are the registry's).

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


# inclusionAI/LLaDA2.0-mini and LLaDA2.1-mini: one architecture, one tokenizer (16.26 B
# parameters = 32.5 GB in bf16; 1.4 B active). Sources:
# * huggingface.co/inclusionAI/LLaDA2.1-mini/blob/main/config.json (read here up to
#   "transformers_version"): hidden 2048, intermediate 5120, 20 layers, 16 heads, 4 kv heads,
#   head_dim 128, partial_rotary_factor 0.5, rope_theta 600000, rms_norm_eps 1e-6, 256
#   experts, top-8, n_group 8, topk_group 4, 1 shared expert, moe_intermediate_size 512,
#   first_k_dense_replace 1, routed_scaling_factor 2.5, score_function sigmoid, expert bias on,
#   max_position_embeddings 32768, pad 156892, untied head, rope_scaling null, bf16.
# * use_qk_norm true, use_qkv_bias false, use_bias false: ../shared/golden/README.md (its
#   config "follows the released LLaDA2.0-mini config"; the config class defaults use_bias to
#   true, the release sets false).
# * mask 156895, EOS 156892: the defaults of the official `generate` (modeling_llada2_moe.py:
#   mask_id=156895, eos_id=156892), the Ling tokenizer's <|mask|> / <|endoftext|> (as LLaDA-MoE).
# * vocab_size 157184: not in the part of either config.json that could be read here; the
#   model cards' vocabulary size (157,184) and the Ling tokenizer of LLaDA-MoE (above).
# * LLaDA2.0-mini's own config.json could not be read here: its architecture numbers are
#   taken to be 2.1-mini's (same model card figures: 16 B total, 1.4 B active, 20 layers,
#   16 heads, context 32,768); its max_position_embeddings is the model card's context length.
LLADA2_MINI: dict[str, Any] = {
    "model_type": "llada2_moe", "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 600000,
    "rms_norm_eps": 1e-6, "num_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "num_shared_experts": 1, "moe_intermediate_size": 512,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "router_dtype": "fp32",
    "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, "norm_head": False,
    "hidden_act": "silu", "rope_scaling": None, "use_sliding_window": False,
    "max_position_embeddings": 32768, "vocab_size": 157184, "mask_token_id": 156895,
    "eos_token_id": 156892, "pad_token_id": 156892, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# JetLM/SDAR-{1.7B,4B,8B}-Chat: Qwen3-1.7B/4B/8B-Base continued with the SDAR recipe
# (github.com/JetAstra/SDAR README), Qwen3 tokenizer (vocab 151936; <|endoftext|> 151643 is
# config.json's bos/eos, <|im_end|> 151645 ends a chat turn, <|MASK|> 151669 is the mask: SDAR's
# added_tokens.json and its README's `mask_token_id=151669`). Block 4: the README decodes with
# block_length 4 and the released config's `block_size` is 4 (../shared/golden/README.md).
# SDAR-4B-Chat, from huggingface.co/JetLM/SDAR-4B-Chat/blob/main/config.json: hidden 2560,
# intermediate 9728, 36 layers, 32 heads, 8 kv heads, head_dim 128 (!= 2560 / 32), rms_norm_eps
# 1e-6, rope_theta 1e6, max_position_embeddings 32768, untied head, no attention bias, bf16
# (4.41 B parameters = 8.8 GB in bf16).
SDAR_4B: dict[str, Any] = {
    "model_type": "sdar", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
    "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False,
    "max_position_embeddings": 32768, "vocab_size": 151936, "block_size": 4,
    "mask_token_id": 151669, "bos_token_id": 151643, "eos_token_id": 151643,
    "eot_token_id": 151645, "pad_token_id": 151643, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# SDAR-8B-Chat: the sizes of Qwen3-8B's config.json (hidden 4096, intermediate 12288, 36
# layers, 32 heads, 8 kv heads, head_dim 128, untied), its base; its own config.json could not
# be read here. Check: 8.19 B parameters = 16.4 GB in bf16, the size of the published
# repository (huggingface.co/JetLM/SDAR-8B-Chat/tree/main: 4.9 + 4.92 + 4.98 + 1.58 GB).
# max_position_embeddings is SDAR-4B-Chat's (not read for the 8B).
SDAR_8B: dict[str, Any] = {
    **SDAR_4B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
}

# SDAR-1.7B-Chat: the sizes of Qwen3-1.7B's config (hidden 2048, intermediate 6144, 28 layers,
# 16 heads, 8 kv heads, head_dim 128), its base; its own config.json could not be read here.
# tie_word_embeddings true is Qwen3-1.7B's and what ../shared/golden/README.md implies ("false
# as in the 4B/8B configs"); NOT confirmed from the SDAR-1.7B-Chat config (its 4.06 GB
# model.safetensors fits an untied head too, but Qwen3 checkpoints store lm_head either way).
# max_position_embeddings is SDAR-4B-Chat's (not read for the 1.7B).
SDAR_1_7B: dict[str, Any] = {
    **SDAR_4B, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": True,
}


# google/diffusiongemma-26B-A4B-it (June 2026), in the released config.json form (transformers
# 5.8.0.dev0: `global_head_dim` / `num_global_key_value_heads`, no `per_layer_config`). Sources:
# * ../shared/golden/README.md "DiffusionGemma" (structure kept from the 26B-A4B config): hidden
#   2816, 30 layers = 5 x [5 sliding + 1 full], 16 heads, 8 kv heads x head_dim 256 on sliding
#   layers, 2 kv heads x 512 on full layers (k_eq_v), dense MLP 2112 and 128 experts top-8 x 704
#   in every layer, window 1024, vocab 262144, canvas 256, final softcap 30; RoPE sliding default
#   theta 1e4, full proportional 0.25 theta 1e6; use_bidirectional_attention "vision"; ids pad 0,
#   EOS 1 and 106, bos 2; rms_norm_eps 1e-6, gelu_pytorch_tanh, tied embeddings, bf16.
# * The published config.json of google/diffusiongemma-26B-A4B-it as mirrored in public
#   repositories' test fixtures (found through the search tools; the same numbers) and the
#   text_config of google/gemma-4-26B-A4B-it, its backbone: max_position_embeddings 262144.
# Text weights: 25.3 B parameters (50.6 GB in bf16); the vision tower (~0.55 B, not loaded
# here) is left out of `vision_config`, which this engine never reads.
DIFFUSION_GEMMA_26B_A4B: dict[str, Any] = {
    "model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"],
    "canvas_length": 256, "dtype": "bfloat16", "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
    "text_config": {
        "model_type": "diffusion_gemma_text", "hidden_size": 2816, "intermediate_size": 2112,
        "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
        "sliding_window": 1024, "num_experts": 128, "top_k_experts": 8,
        "moe_intermediate_size": 704, "vocab_size": 262144, "max_position_embeddings": 262144,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                               "partial_rotary_factor": 0.25}},
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": True,
        "use_bidirectional_attention": "vision", "bos_token_id": 2, "eos_token_id": [1, 106],
        "pad_token_id": 0,
    },
}


# Not a released model: DIFFUSION_GEMMA_26B_A4B's structure (sliding and full layers with their
# own head sizes, k_eq_v, proportional RoPE, dense MLP beside a top-k MoE, soft-capping, the
# canvas) at a size the benchmarks run in seconds on a few cores (`bench throughput`,
# load_format="dummy"): hidden 512, 6 layers = 5 sliding + 1 full, 8 heads, 4 kv heads x 64 on
# sliding layers, 2 x 128 on the full one, dense MLP 1024, 16 experts top-4 x 256, window 128,
# vocab 32768, canvas 64. bf16 like the released one.
DIFFUSION_GEMMA_MINI: dict[str, Any] = {
    **DIFFUSION_GEMMA_26B_A4B, "canvas_length": 64,
    "text_config": {
        **DIFFUSION_GEMMA_26B_A4B["text_config"], "hidden_size": 512, "intermediate_size": 1024,
        "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 2,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 128,
        "num_experts": 16, "top_k_experts": 4, "moe_intermediate_size": 256,
        "vocab_size": 32768, "max_position_embeddings": 8192,
    },
}


# nvidia/Nemotron-Labs-Diffusion-{3B,8B,14B} (May 2026): Ministral-3 backbones (32 heads, 8 kv
# heads, head_dim 128, RMSNorm eps 1e-5, no biases), YaRN factor 16 over 16384 original positions
# with the Llama-4 q scale (beta 0.1), vocabulary 131072, [MASK] 100, bos 1, eos 11, block 32,
# untied `diffusion_head` (issue #50's table of the released configs).
NEMOTRON_DIFFUSION_8B: dict[str, Any] = {
    "model_type": "nemotron_labs_diffusion", "architectures": ["NemotronLabsDiffusionModel"],
    "hidden_size": 4096, "num_hidden_layers": 34, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 131072, "mask_token_id": 100, "bos_token_id": 1, "eos_token_id": 11,
    "pad_token_id": 11, "block_size": 32, "dlm_paradigm": "bidirectional",
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                        "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "llama_4_scaling_beta": 0.1},
}
NEMOTRON_DIFFUSION_3B: dict[str, Any] = {
    **NEMOTRON_DIFFUSION_8B, "hidden_size": 3072, "num_hidden_layers": 26,
    "intermediate_size": 9216,
}
NEMOTRON_DIFFUSION_14B: dict[str, Any] = {
    **NEMOTRON_DIFFUSION_8B, "hidden_size": 5120, "num_hidden_layers": 40,
    "intermediate_size": 16384,
    "rope_parameters": {**NEMOTRON_DIFFUSION_8B["rope_parameters"], "rope_theta": 1e9},
}
