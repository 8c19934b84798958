"""LLaDA and Dream forwards in the official code's op order, and Fast-dLLM-order decoding loops
on LLaDA (issue #48): the slow reference the engine's bf16 logits and tokens are compared with bitwise.

Written from ../shared/golden/README.md ("LLaDA model") and the official modeling file's order,
one op per official op, in the model's dtype:
* RMSNorm: x.float() * rsqrt(mean(x.float()^2) + eps), rounded to the dtype, times the weight;
* q, k, v: three separate GEMMs on the normed input; [B, H, T, d] heads;
* RoPE: angles = outer(positions, inv_freq) in fp32, cat(angles, angles), sin and cos; with
  `rope_full_precision` q and k rotate in fp32 (t*cos + rotate_half(t)*sin) and round once,
  otherwise cos and sin round to the dtype and every op rounds;
* attention: `F.scaled_dot_product_attention` over the keys in position order (kv heads repeated);
* MLP: silu(ff_proj(h)) * up_proj(h), ff_out; residuals; ln_f; ff_out (the head).

The loops follow Fast-dLLM's `generate` (no cache), `generate_with_prefix_cache` and
`generate_with_dual_cache` at temperature 0 (`Rule`): per block, one forward of the whole
canvas, then forwards of the block (dual: keys of the whole canvas from the block's first forward,
the block's own fresh) or of the block and everything after it (prefix: keys before the block from
the first forward); candidates argmax, confidence the softmax probability over the whole
vocabulary, [MASK] included (float64; float32 for LLaDA's `generate`); with a threshold the most
confident masked position always and every other one whose confidence reaches it, without one
the top k of LLaDA's linear schedule. Exactly equal confidences go to the lower position (the
official `torch.topk` orders them its own way: docs/benchmarks.md, #48).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The official tensors of an (unpacked) cover_vllm LLaDA module, by official name."""
    return {name: t.detach() for name, t in model.state_dict().items()}


class OfficialLLaDA:
    """LLaDA in the official op order. `forward(ids, positions, keys)` returns the logits of
    `ids` [1, T] at `positions` [T] and each layer's (k, v) [1, Hkv, T, d]; `keys` gives, per layer,
    the (k, v) of every key position in position order with the rows of `positions` left to
    `forward` to fill (None: the keys are the tokens themselves)."""

    def __init__(self, model: torch.nn.Module, cfg: dict):
        self.w = _weights(model)
        self.n_layers, self.heads = cfg["n_layers"], cfg["n_heads"]
        self.kv_heads = cfg.get("n_kv_heads") or self.heads
        self.head_dim = cfg["d_model"] // self.heads
        self.eps = cfg.get("rms_norm_eps", 1e-5)
        self.theta = cfg.get("rope_theta", 10000.0)
        self.full_precision = bool(cfg.get("rope_full_precision", True))

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        og = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.w[name] * x.to(og)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        freqs = torch.einsum("i , j -> i j", positions.float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.sin()[None, None], emb.cos()[None, None]              # [1, 1, T, d]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        b, nh, t, hs = x.size()
        x1, x2 = x.view(b, nh, t, 2, hs // 2).unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        q_, k_ = (q.float(), k.float()) if self.full_precision else (q, k)
        sin, cos = self._angles(positions)
        sin, cos = sin.type_as(q_), cos.type_as(q_)
        q_ = ((q_ * cos) + (self._rotate_half(q_) * sin)).to(q_.dtype)
        k_ = ((k_ * cos) + (self._rotate_half(k_) * sin)).to(k_.dtype)
        return q_.type_as(q), k_.type_as(k)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                keys: list | None = None, key_rows: torch.Tensor | None = None):
        """`key_rows` [T]: where this forward's k/v go among `keys`' rows (all keys when None)."""
        w, b, t = self.w, 1, ids.shape[1]
        x = F.embedding(ids, w["model.transformer.wte.weight"])
        fresh = []
        for i in range(self.n_layers):
            p = f"model.transformer.blocks.{i}."
            h = self.norm(x, p + "attn_norm.weight")
            q, k, v = (F.linear(h, w[p + n + ".weight"]) for n in ("q_proj", "k_proj", "v_proj"))
            q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, positions)
            fresh.append((k, v))
            if keys is not None:
                k_all, v_all = (c.clone() for c in keys[i])
                k_all[:, :, key_rows], v_all[:, :, key_rows] = k, v
                k, v = k_all, v_all
            if self.kv_heads != self.heads:
                k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                                 is_causal=False)
            att = att.transpose(1, 2).contiguous().view(b, t, -1)
            x = x + F.linear(att, w[p + "attn_out.weight"])
            h = self.norm(x, p + "ff_norm.weight")
            h = F.silu(F.linear(h, w[p + "ff_proj.weight"])) * F.linear(h, w[p + "up_proj.weight"])
            x = x + F.linear(h, w[p + "ff_out.weight"])
        x = self.norm(x, "model.transformer.ln_f.weight")
        return F.linear(x, w["model.transformer.ff_out.weight"]), fresh


class OfficialDream:
    """Dream (Qwen2) in the official op order: the LLaDA norm; q/k/v with biases; cos and sin
    from `inv_freq @ positions` in fp32 rounded to the dtype, RoPE in the dtype; kv heads repeated
    (`repeat_kv`); SDPA without a mask; SwiGLU; `logits(ids [1, T], positions [T])` [1, T, V]."""

    def __init__(self, model: torch.nn.Module, cfg: dict):
        self.w = _weights(model)
        self.n_layers, self.heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg["hidden_size"] // self.heads
        self.eps, self.theta = cfg.get("rms_norm_eps", 1e-6), cfg.get("rope_theta", 10000.0)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        og = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w[name] * x.to(og)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = (inv_freq[None, :, None] @ positions[None, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * 1.0).to(dtype)[:, None], (emb.sin() * 1.0).to(dtype)[:, None]

    def logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w, b, t, d = self.w, 1, ids.shape[1], self.head_dim
        x = F.embedding(ids, w["model.embed_tokens.weight"])
        cos, sin = self._cos_sin(positions, x.dtype)
        rep = self.heads // self.kv_heads
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            h = self.norm(x, p + "input_layernorm.weight")
            a = p + "self_attn."
            q, k, v = (F.linear(h, w[a + n + ".weight"], w[a + n + ".bias"])
                       for n in ("q_proj", "k_proj", "v_proj"))
            q = q.view(b, t, self.heads, d).transpose(1, 2)
            k = k.view(b, t, self.kv_heads, d).transpose(1, 2)
            v = v.view(b, t, self.kv_heads, d).transpose(1, 2)
            q = (q * cos) + (OfficialLLaDA._rotate_half(q) * sin)
            k = (k * cos) + (OfficialLLaDA._rotate_half(k) * sin)
            k = k[:, :, None].expand(b, self.kv_heads, rep, t, d).reshape(b, self.heads, t, d)
            v = v[:, :, None].expand(b, self.kv_heads, rep, t, d).reshape(b, self.heads, t, d)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                                 is_causal=False)
            x = x + F.linear(att.transpose(1, 2).reshape(b, t, -1), w[a + "o_proj.weight"])
            h = self.norm(x, p + "post_attention_layernorm.weight")
            m = p + "mlp."
            h = F.silu(F.linear(h, w[m + "gate_proj.weight"])) * F.linear(h, w[m + "up_proj.weight"])
            x = x + F.linear(h, w[m + "down_proj.weight"])
        return F.linear(self.norm(x, "model.norm.weight"), w["lm_head.weight"])


@dataclass
class Trace:
    """What a loop did: the output ids and, per forward, its positions [T] and logits [T, V]."""
    ids: torch.Tensor
    steps: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _transfer(logits: torch.Tensor, block_ids: torch.Tensor, mask_id: int,
              rule: "Rule", count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast-dLLM's `get_transfer_index` on one block: (positions to reveal [n], their tokens [n]).
    The softmax runs over the whole vocabulary, [MASK] included; with a threshold the most
    confident masked position always and every other one not below it, else the top `count`."""
    x0 = logits.argmax(-1)
    p = F.softmax(logits.to(rule.dtype), dim=-1)
    conf = torch.gather(p, -1, x0[:, None])[:, 0]
    masked = block_ids == mask_id
    conf = torch.where(masked, conf, torch.tensor(-float("inf"), dtype=conf.dtype))
    order = torch.argsort(conf, descending=True, stable=True)[: int(masked.sum())]
    if rule.threshold is None:
        keep = order[:count].tolist()
    else:
        keep = [int(order[0])] + [int(j) for j in order[1:] if conf[j] >= rule.threshold]
    sel = torch.tensor(keep, dtype=torch.long)
    return sel, x0[sel]


@dataclass(frozen=True)
class Rule:
    """The decision: a threshold (Fast-dLLM), or None for the fixed schedule of `steps` in all
    (LLaDA's linear schedule per block: floor(m/s) a step, the first m mod s steps one more);
    the softmax in `dtype` (float64: Fast-dLLM; float32: LLaDA's `generate`)."""
    threshold: float | None = 0.9
    steps: int | None = None
    dtype: torch.dtype = torch.float64

    def counts(self, gen_length: int, block_length: int) -> list[int]:
        """Tokens to reveal at each step of a block (fixed schedule; unused with a threshold)."""
        if self.threshold is not None:
            return []
        per_block = self.steps // (gen_length // block_length)
        base, rem = divmod(block_length, per_block)
        return [base + (1 if i < rem else 0) for i in range(per_block)]


def _block_logits(ref: OfficialLLaDA, x: torch.Tensor, block: tuple[int, int], cache,
                  kv_cache: str, trace: Trace):
    """One forward of Fast-dLLM's loops: the block's logits [B, V] and the cache (module doc)."""
    start, end = block
    n = x.shape[1]
    if cache is None or kv_cache == "none":
        pos = torch.arange(n)
        logits, cache = ref.forward(x, pos)
        rows = logits[0, start:end]
    else:
        pos = torch.arange(start, end if kv_cache == "dual" else n)
        logits, _ = ref.forward(x[:, start:pos[-1] + 1], pos, cache, pos)
        rows = logits[0, : end - start]
    trace.steps.append((pos, logits[0]))
    return rows, cache


def generate(ref: OfficialLLaDA, prompt: list[int], gen_length: int, block_length: int,
             mask_id: int, threshold: float | None | Rule = 0.9, kv_cache: str = "none") -> Trace:
    """Fast-dLLM-order decoding of one prompt (module docstring), batch 1; `threshold` a number
    (the threshold rule in float64) or a `Rule`."""
    rule = threshold if isinstance(threshold, Rule) else Rule(threshold)
    n = len(prompt) + gen_length
    x = torch.tensor([prompt + [mask_id] * gen_length])
    trace = Trace(x)
    counts = rule.counts(gen_length, block_length)
    for start in range(len(prompt), n, block_length):
        end, cache, step = start + block_length, None, 0
        while bool((x[0, start:end] == mask_id).any()):
            block_logits, cache = _block_logits(ref, x, (start, end), cache, kv_cache, trace)
            count = counts[step] if counts else 0
            sel, tok = _transfer(block_logits, x[0, start:end], mask_id, rule, count)
            x[0, start + sel] = tok
            step += 1
    return trace
