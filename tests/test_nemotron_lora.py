"""Nemotron-Labs-Diffusion's draft adapter (PEFT LoRA in `linear_spec_lora/`): it loads, changes
the draft (diffusion-mode) rows only, equals merging scale·B·A into o_proj for those rows, and
never changes a greedy token (self-speculation accepts only the causal verify's argmax) before
the model predicts [MASK] itself."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from cover_vllm import LLM, SamplingParams
from cover_vllm.models.nemotron_cache import Piece, SlotCache, run_pieces
from golden_cases import GOLDEN

SRC = GOLDEN / "nemotron" / "model_long"
R, ALPHA = 8, 32


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """The golden checkpoint plus a random o_proj adapter in PEFT's layout."""
    path = tmp_path_factory.mktemp("nemotron_lora") / "model"
    shutil.copytree(SRC, path)
    (path / "linear_spec_lora").mkdir()
    (path / "linear_spec_lora" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["o_proj"],
         "base_model_name_or_path": "nvidia/Nemotron-Labs-Diffusion-8B"}))
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for i in range(2):
        key = f"base_model.model.encoder.layers.{i}.self_attn.o_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(R, 64, generator=gen) * 0.1
        tensors[f"{key}.lora_B.weight"] = torch.randn(64, R, generator=gen) * 0.1
    save_file(tensors, str(path / "linear_spec_lora" / "adapter_model.safetensors"))
    return path, tensors


def upto_mask(out) -> list[int]:
    """Tokens through the first [MASK] (100): a random model may predict [MASK] itself, and
    the official loop then drafts over that seed, so the draft can matter from there on."""
    ids = out.outputs[0].token_ids
    return ids[:ids.index(100) + 1] if 100 in ids else ids


def _llm(path):
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20)


def test_adapter_changes_draft_rows_only(lora_dir):
    path, tensors = lora_dir
    llm, plain = _llm(path), _llm(SRC)
    llm.generate([1, 2, 3], SamplingParams(max_tokens=4, decoding="ar"), use_tqdm=False)
    model = llm.engine.causal.runner.model
    assert model.draft_adapter is not None
    base = plain.engine.executor.model
    ids = list(range(20, 40))
    d = model.dims

    def forward(m, adapter):
        cache = SlotCache(d.num_layers, d.num_kv_heads, d.head_dim, torch.float32, "cpu")
        a, b = cache.allocate(64), cache.allocate(64)
        run_pieces(m, cache, [Piece(a, ids[:12], True, True, []),
                              Piece(b, ids[:12], True, True, [])])
        return run_pieces(m, cache, [Piece(a, ids[12:], False, False, list(range(8)), adapter),
                                     Piece(b, ids[12:], True, False, list(range(8)))])

    on, off, ref = forward(model, True), forward(model, False), forward(base, False)
    torch.testing.assert_close(off[0], ref[0], atol=0, rtol=0)      # adapter off: the base
    torch.testing.assert_close(on[1], ref[1], atol=0, rtol=0)       # other rows: untouched
    assert (on[0] - ref[0]).abs().max() > 1e-3                      # draft rows: changed
    merged = _llm(SRC).engine.executor.model                        # W + (alpha / r) B A
    for i in range(2):
        key = f"base_model.model.encoder.layers.{i}.self_attn.o_proj"
        delta = ALPHA / R * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
        merged.encoder.layers[i].self_attn.o_proj.weight.data += delta

    def alone(m, adapter):      # no prefill: every row of the forward is a draft row
        cache = SlotCache(d.num_layers, d.num_kv_heads, d.head_dim, torch.float32, "cpu")
        return run_pieces(m, cache, [Piece(cache.allocate(32), ids, False, False,
                                           list(range(20)), adapter)])[0]

    torch.testing.assert_close(alone(model, True), alone(merged, False), atol=1e-4, rtol=0)


def test_adapter_keeps_greedy_tokens(lora_dir):
    """Greedy self-speculation emits the verify's argmax: the adapter moves acceptance, never a
    token; `nemotron` and `ar` never run it."""
    path, _ = lora_dir
    with_lora, plain = _llm(path), _llm(SRC)
    gen = torch.Generator().manual_seed(5)
    prompts = [[1] + torch.randint(12, 160, (10,), generator=gen).tolist() for _ in range(4)]
    for decoding in ("linear_spec", "nemotron", "ar"):
        sp = SamplingParams(max_tokens=24, block_length=8, decoding=decoding)
        a = with_lora.generate(prompts, sp, use_tqdm=False)
        b = plain.generate(prompts, sp, use_tqdm=False)
        assert [upto_mask(o) for o in a] == [upto_mask(o) for o in b]
        if decoding != "linear_spec":
            assert [o.metrics.nfe for o in a] == [o.metrics.nfe for o in b]
