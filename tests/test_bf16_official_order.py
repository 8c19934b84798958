"""bf16 parity with the official op order (issue #48): the engine's bf16 logits equal, bit for bit,
a forward written in the official code's op order (tests/official_order.py), at every forward of
a Fast-dLLM-order threshold generation at batch 1 with kv_cache none / prefix / dual, and so its
tokens and NFE are equal. `fast_norm=True` (one-op RMSNorm) is shown to round differently."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from cover_vllm import LLM, SamplingParams
from cover_vllm.layers.common import RMSNorm
from cover_vllm.layers.rotary import RotaryEmbedding
from cover_vllm.models.loader import load_model
from golden_cases import GOLDEN
from official_order import OfficialDream, OfficialLLaDA, generate

LLADA = GOLDEN / "llada" / "model"
PROMPT = [5, 17, 33, 101, 7, 250, 12, 9, 44, 61]
GEN, BLOCK = 64, 32


def _official_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_is_the_official_formula(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(100, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(100))
    x = (3 * torch.randn(257, 100)).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), _official_norm(x, norm.weight, 1e-5))
        norm.fast = True          # one rounding: differs in bf16/fp16, equal in fp32
        assert torch.equal(norm(x), _official_norm(x, norm.weight, 1e-5)) == (dtype == torch.float32)


def test_rope_in_the_model_dtype_is_the_official_order():
    """Qwen2/Llama `apply_rotary_pos_emb`: cos and sin rounded to x's dtype, each op rounding."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(16, 1e6, full_precision=False)
    positions = torch.arange(40)
    x = torch.randn(40, 6, 16).bfloat16()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., :8], x[..., 8:]
    want = (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    assert torch.equal(rope.at(positions).rotate_(x.clone()), want)


@pytest.fixture(scope="module")
def reference():
    cfg = json.loads((LLADA / "config.json").read_text())
    return OfficialLLaDA(load_model(str(LLADA), "bfloat16"), cfg), cfg["mask_token_id"]


def _engine_trace(mode: str, fast_norm: bool = False):
    """(output token ids, [(positions [T], logits [T, V]) per forward]) of the engine."""
    llm = LLM(str(LLADA), dtype="bfloat16", kv_cache=mode, num_threads=1, fast_norm=fast_norm)
    model = llm.engine.executor.runner.model
    forward_tokens, steps = model.forward_tokens, []

    def recording(embeds, positions, attn):
        hidden = forward_tokens(embeds, positions, attn)
        steps.append((positions.clone(), model.compute_logits(hidden)))
        return hidden

    model.forward_tokens = recording
    params = SamplingParams(max_tokens=GEN, block_length=BLOCK, ignore_eos=True,
                            decoding="threshold")
    out = llm.generate([PROMPT], params, use_tqdm=False)
    return out[0].outputs[0].token_ids, steps


@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
def test_bf16_logits_and_tokens_equal_the_official_order(reference, mode):
    ref, mask_id = reference
    want = generate(ref, PROMPT, GEN, BLOCK, mask_id, 0.9, mode)
    tokens, steps = _engine_trace(mode)
    assert tokens == want.ids[0, len(PROMPT):].tolist()
    assert len(steps) == len(want.steps)                                        # NFE
    for (pos, logits), (want_pos, want_logits) in zip(steps, want.steps):
        assert torch.equal(pos, want_pos)
        assert logits.dtype == torch.bfloat16 and torch.equal(logits, want_logits)


def test_fast_norm_rounds_differently(reference):
    ref, mask_id = reference
    _, steps = _engine_trace("none", fast_norm=True)
    pos, logits = steps[0]
    want, _ = ref.forward(torch.tensor([PROMPT + [mask_id] * GEN]), pos)
    assert not torch.equal(logits, want[0])
    assert (logits.float() - want[0].float()).abs().max().item() <= 1.0     # one-ulp rounding


def test_dream_bf16_logits_equal_the_official_order():
    """Every forward of a no-cache Dream generation (Fast-dLLM's Dream threshold rule), batch 1:
    the engine's bf16 logits against the official Qwen2 order on the same ids and positions."""
    model_dir = GOLDEN / "dream" / "model"
    cfg = json.loads((model_dir / "config.json").read_text())
    ref = OfficialDream(load_model(str(model_dir), "bfloat16"), cfg)
    llm = LLM(str(model_dir), dtype="bfloat16", kv_cache="none", num_threads=1)
    model = llm.engine.executor.runner.model
    embed, forward_tokens, steps = model.embed, model.forward_tokens, []

    def recording(embeds, positions, attn):
        hidden = forward_tokens(embeds, positions, attn)
        steps.append((ids[-1], positions.clone(), model.compute_logits(hidden)))
        return hidden

    ids = []
    model.embed = lambda input_ids: (ids.append(input_ids.clone()), embed(input_ids))[1]
    model.forward_tokens = recording
    params = SamplingParams(max_tokens=GEN, block_length=BLOCK, ignore_eos=True,
                            decoding="threshold")
    llm.generate([PROMPT], params, use_tqdm=False)
    assert len(steps) > 2
    for step_ids, pos, logits in steps:
        assert torch.equal(logits, ref.logits(step_ids[None], pos)[0])


def test_sdar_norms_multiply_the_weight_in_fp32():
    """SDAR's official RMSNorm is flash-attn's `rms_norm_fn`: x * rstd * weight in fp32, rounded
    once; the per-head q/k norm of the fused q|k|v output takes the same order."""
    from cover_vllm.layers.base import ModelDims
    from cover_vllm.layers.common import SelfAttention

    torch.manual_seed(0)
    dims = ModelDims(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                     vocab_size=10)
    attn = SelfAttention(dims, qk_norm_eps=1e-6).to(torch.bfloat16)
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight_in_fp32 = True
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(16))
    x = torch.randn(9, 64).bfloat16()
    seen = {}

    def attention(layer, q, kv):
        seen["q"], seen["k"] = q.clone(), kv[:, :2].clone()
        return q.reshape(q.shape[0], -1)

    class NoTurn:
        rotary_dim = 16

        def rotate_(self, t):
            return t

    with torch.no_grad():
        attn(x, 0, NoTurn(), attention)
        q = F.linear(x, attn.q_proj.weight).view(9, 4, 16).float()
        k = F.linear(x, attn.k_proj.weight).view(9, 2, 16).float()
    for got, t, w in ((seen["q"], q, attn.q_norm.weight), (seen["k"], k, attn.k_norm.weight)):
        want = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()
        assert torch.equal(got, want)
