"""Fast-dLLM's cache-mode decoding loops (prefix and dual KV cache), batch 1: the bench's
reference for the engine's `kv_cache="prefix"` / `"dual"` rows.

Written from the algorithm of Fast-dLLM (Wu et al., 2025, "Fast-dLLM: Training-free Acceleration
of Diffusion LLM via Enabling KV Cache and Parallel Decoding", §3.2, Fig. 2): its
`generate_with_prefix_cache` and `generate_with_dual_cache`, at temperature 0 with LLaDA's fixed
low-confidence schedule (reference_decode.py: `steps / num_blocks` steps per block, the float32
softmax confidence, highest-confidence masked slots of the block committed). Per block:

* the block's first step runs the whole canvas and keeps every position's K/V (the refresh);
* `prefix`: each later step runs the block and everything after it, attending over the cached
  K/V of the positions before the block and its own fresh K/V;
* `dual`: each later step runs the block alone, attending over the cached K/V of the prefix and
  of the suffix (as of the refresh) and its own fresh K/V, which replace the block's entries.

The model forward is the engine's own (`forward_tokens` with an AttentionFn over one dense,
unpaged cache per layer), so the engine and this loop run the same GEMMs: what differs is the
engine's batching, paging, scheduling and decisions. Logits are computed for every row a step
runs, as the official functions do. This is the slow oracle, not the engine's fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cover_vllm.layers.base import kv_halves
from cover_vllm.reference_decode import check_schedule, commit_low_confidence, num_transfer_tokens

CACHE_MODES = ("prefix", "dual")


@dataclass(frozen=True)
class DecodeSchedule:
    """LLaDA's semi-autoregressive schedule of one request."""

    gen_length: int
    block_length: int
    steps: int
    mask_id: int


class DenseKVCache:
    """Every layer's K/V of the whole canvas [L, Hkv, d], and the window the next forward runs.
    An AttentionFn: writes the window's fresh K/V at its positions, then attends the window's
    queries over all L positions (cached outside the window, fresh inside)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers     # [L, Hkv, d] each
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.start = 0                                                 # window's first position

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor | None = None) -> torch.Tensor:
        if v is None:                                   # K and V side by side [W, 2 Hkv, d]
            k, v = kv_halves(k)
        if self.start == 0 and (self.keys[layer] is None
                                or k.shape[0] == self.keys[layer].shape[0]):
            self.keys[layer], self.values[layer] = k.clone(), v.clone()    # the refresh
        else:
            end = self.start + k.shape[0]
            self.keys[layer][self.start:end] = k
            self.values[layer][self.start:end] = v
        keys, values = self.keys[layer], self.values[layer]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None],
                                           enable_gqa=q.shape[1] != k.shape[1])     # [1, H, W, d]
        return o[0].transpose(0, 1).reshape(q.shape[0], -1)                      # [W, H * d]


def _window_logits(model: torch.nn.Module, canvas: torch.Tensor, cache: DenseKVCache,
                   start: int, end: int) -> torch.Tensor:
    """Run canvas positions start..end-1 through the model over `cache`; logits [end-start, V]."""
    cache.start = start
    positions = torch.arange(start, end, device=canvas.device)
    hidden = model.forward_tokens(model.embed(canvas[start:end]), positions, cache)
    return model.compute_logits(hidden)


@torch.no_grad()
def reference_cache_generate(model: torch.nn.Module, prompt_ids: list[int],
                             schedule: DecodeSchedule, mode: str) -> tuple[list[int], int]:
    """Decode after `prompt_ids` with Fast-dLLM's `mode` ("prefix" or "dual") cache loop;
    returns the generated ids and the number of forwards (NFE)."""
    if mode not in CACHE_MODES:
        raise ValueError(f"mode={mode!r}; choose one of {list(CACHE_MODES)}")
    s = schedule
    num_blocks = check_schedule(s.gen_length, s.block_length, s.steps)
    device = next(model.parameters()).device
    prompt_len = len(prompt_ids)
    length = prompt_len + s.gen_length
    canvas = torch.full((length,), s.mask_id, dtype=torch.long, device=device)
    canvas[:prompt_len] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    cache, nfe = DenseKVCache(model.dims.num_layers), 0
    for block in range(num_blocks):
        start = prompt_len + block * s.block_length
        end = start + s.block_length
        counts = [c for c in num_transfer_tokens(int((canvas[start:end] == s.mask_id).sum()),
                                                 s.steps // num_blocks) if c]
        for i, count in enumerate(counts):
            first = 0 if i == 0 else start              # the block's first step: the refresh
            last = end if mode == "dual" and i > 0 else length
            logits = _window_logits(model, canvas, cache, first, last)
            nfe += 1
            rows = slice(start - first, end - first)                # the block's rows
            commit_low_confidence(logits[rows], canvas[start:end], s.mask_id, count)
    return canvas[prompt_len:].tolist(), nfe
