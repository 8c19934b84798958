"""Nemotron-Labs-Diffusion against transformers' own `Ministral3Model` (transformers >= 5;
skipped under 4.x: scripts/test_transformers5.sh runs it), at sizes and lengths the golden
vectors do not cover: a random config with YaRN and the Llama-4 q scale acting (a small
`original_max_position_embeddings`), fp32 logits of both attention modes over 150 positions,
and 40 greedy `ar` (and `linear_spec`) tokens against a greedy loop over transformers' KV
cache (the official `ar_generate`). Run: `PYTHONPATH=<transformers 5 site> pytest
tests/test_nemotron_transformers5.py` or scripts/test_transformers5.sh."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5 (Ministral3Model)", allow_module_level=True)

from transformers import Ministral3Config  # noqa: E402
from transformers.models.ministral3.modeling_ministral3 import Ministral3Model  # noqa: E402

from cover_vllm import LLM, SamplingParams  # noqa: E402
from cover_vllm.models.loader import build_model  # noqa: E402
from cover_vllm.models.spec import ModelSpec  # noqa: E402

ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0,
        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
CONFIG = {"model_type": "nemotron_labs_diffusion", "hidden_size": 96, "num_hidden_layers": 3,
          "intermediate_size": 160, "num_attention_heads": 6, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": 200, "mask_token_id": 100, "eos_token_id": 11,
          "bos_token_id": 1, "pad_token_id": 11, "block_size": 8, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 1024, "tie_word_embeddings": False,
          "rope_parameters": ROPE}


def reference():
    """transformers' Ministral3Model with random weights, and a head."""
    torch.manual_seed(0)
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
            "max_position_embeddings")
    cfg = Ministral3Config(**{k: CONFIG[k] for k in keys}, rope_parameters=ROPE,
                           attn_implementation="eager")
    enc = Ministral3Model(cfg).float().eval()
    for p in enc.parameters():
        p.data.normal_(0, 0.1)
    head = torch.nn.Linear(CONFIG["hidden_size"], CONFIG["vocab_size"], bias=False)
    head.weight.data.normal_(0, 0.1)
    return enc, head


def ours(enc, head, tmp_path):
    from safetensors.torch import save_file
    import json

    state = {f"encoder.{k}": v.contiguous() for k, v in enc.state_dict().items()
             if "rotary" not in k}
    state["diffusion_head.weight"] = head.weight.data.clone()
    tmp_path.mkdir(exist_ok=True)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = build_model(ModelSpec.from_config(CONFIG), torch.float32, "cpu")
    model.load_state_dict({k: v for k, v in state.items()})
    return model.eval().requires_grad_(False)


@torch.no_grad()
def test_logits_both_modes_150_positions(tmp_path):
    enc, head = reference()
    model = ours(enc, head, tmp_path / "m")
    ids = torch.randint(12, 200, (1, 150), generator=torch.Generator().manual_seed(1))
    causal = head(enc(input_ids=ids).last_hidden_state)
    every_key = torch.zeros(1, 1, 150, 150)          # an additive 4-D mask of 0: no mask
    full = head(enc(input_ids=ids, attention_mask=every_key).last_hidden_state)
    torch.testing.assert_close(model(ids, causal=True), causal, atol=1e-4, rtol=0)
    torch.testing.assert_close(model(ids), full, atol=1e-4, rtol=0)


@torch.no_grad()
def test_ar_40_tokens_against_a_kv_cache_loop(tmp_path):
    from transformers import DynamicCache

    enc, head = reference()
    ours(enc, head, tmp_path / "m")
    prompt = [1] + torch.randint(12, 200, (29,), generator=torch.Generator().manual_seed(2)
                                 ).tolist()
    cache, ids, out = DynamicCache(), torch.tensor([prompt]), []
    for _ in range(40):
        h = enc(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
        tok = int(head(h[:, -1]).argmax(-1))
        out.append(tok)
        if tok == 11:
            break
        ids = torch.tensor([[tok]])
    llm = LLM(str(tmp_path / "m"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    got = llm.generate(prompt, SamplingParams(max_tokens=40, decoding="ar"), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == out
    if 100 not in out:        # greedy self-speculation keeps the causal argmax: the same tokens
        spec = llm.generate(prompt, SamplingParams(max_tokens=40, block_length=8,
                                                   decoding="linear_spec"), use_tqdm=False)[0]
        assert spec.outputs[0].token_ids == out
