"""One Gemma 4 layer's attention shape (sliding-window or full, heads, head size, RoPE): what
models/gemma4_config.py reads from config.json and layers/gemma4.py builds a layer from. Plain
data, no torch."""

from __future__ import annotations

from dataclasses import dataclass

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class LayerShape:
    """One layer's attention: sliding-window or full, query / kv heads, head size, RoPE."""

    sliding: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotated_pairs: int      # rotate-half frequency slots that turn (the rest pass through)
    k_eq_v: bool            # no v_proj: values are the normed raw key projection

    @property
    def kind(self) -> str:
        return SLIDING if self.sliding else FULL
