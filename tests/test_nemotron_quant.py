"""Nemotron-Labs-Diffusion's decodings on int8 and W8A8 weights (the engine's quantized
loading): every decoding runs, its logits stay near fp32's, and self-speculation on the
quantized weights still emits the quantized AR tokens (greedy, until the model predicts
[MASK]: see test_nemotron_lora.py)."""

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.models.nemotron_cache import Piece, SlotCache, run_pieces
from golden_cases import GOLDEN

DIR = str(GOLDEN / "nemotron" / "model_long")


def upto_mask(ids: list[int]) -> list[int]:
    return ids[:ids.index(100) + 1] if 100 in ids else ids


def block_logits(llm) -> torch.Tensor:
    model = llm.engine.executor.model
    d = model.dims
    cache = SlotCache(d.num_layers, d.num_kv_heads, d.head_dim, torch.float32, "cpu")
    slot = cache.allocate(40)
    run_pieces(model, cache, [Piece(slot, list(range(1, 25)), True, True, [])])
    return run_pieces(model, cache, [Piece(slot, [7, 100, 100, 100], False, False,
                                           [0, 1, 2, 3])])[0]


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_quantized_decodings(quantization):
    base = LLM(DIR, dtype="float32", kv_cache_memory_bytes=8 << 20)
    llm = LLM(DIR, dtype="float32", kv_cache_memory_bytes=8 << 20, quantization=quantization)
    ref, got = block_logits(base), block_logits(llm)
    assert 0 < (got - ref).abs().max() < 0.05 * ref.abs().max()     # quantized, and close
    gen = torch.Generator().manual_seed(7)
    prompts = [[1] + torch.randint(12, 160, (12,), generator=gen).tolist() for _ in range(3)]
    outs = {d: llm.generate(prompts, SamplingParams(max_tokens=16, block_length=4, decoding=d),
                            use_tqdm=False) for d in ("nemotron", "ar", "linear_spec")}
    for d, batch in outs.items():
        assert all(0 < len(o.outputs[0].token_ids) <= 16 for o in batch), d
    assert [upto_mask(o.outputs[0].token_ids) for o in outs["linear_spec"]] == \
        [upto_mask(o.outputs[0].token_ids) for o in outs["ar"]]
