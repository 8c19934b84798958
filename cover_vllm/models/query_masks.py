"""Query x key masks of the dense forward (`model(input_ids, attention_mask=M)`) of the
block-diffusion families (LLaDA2.x, SDAR), as their official code takes them.

The official LLaDA2 and SDAR forwards take a query x key mask, 1 / True = may attend: LLaDA2 a
4-D [B or 1, 1, L, L] (its `generate` passes the log of it, 0 / -inf; here the 0/1 form is
taken), SDAR a 3-D [B or 1, L, L] read as boolean. The engine never uses these: its paged
attention gets the model's attention kind from the metadata (cover_vllm.attention).
"""

from __future__ import annotations

import torch

from cover_vllm.models.base import DiffusionLM, dense_forward


def block_causal_allowed(seq_len: int, block_size: int,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """[L, L] bool: query i may attend key j iff block(j) <= block(i), blocks of `block_size`
    aligned to position 0 (the mask both official generators build, ../shared/golden/README.md
    "LLaDA2 block mask")."""
    block = torch.arange(seq_len, device=device) // block_size
    return block[:, None] >= block[None, :]


def query_key_mask(attention_mask: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """A user mask -> bool [B or 1, 1, L or 1, L] (True = may attend).

    2-D [B, L]: a key mask (padded keys hidden from every query), returned as [B, 1, 1, L];
    3-D [B or 1, L, L] and 4-D [B or 1, 1, L, L]: query x key masks. Values: bool, integers, or
    floats that are all 0 / 1; an additive float mask (0 / -inf) is refused, because its 0 means
    the opposite of this one's."""
    m = attention_mask
    if m.is_floating_point() and not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask has values other than 0 and 1 (an additive 0 / -inf "
                         "mask?); pass 1 / True = may attend, 0 / False = hidden, e.g. "
                         "mask.isfinite() for an additive one")
    if m.dim() == 2:
        want, m = (batch, seq_len), m[:, None, None, :]
    elif m.dim() == 3:
        want, m = (m.shape[0], seq_len, seq_len), m[:, None]
    elif m.dim() == 4:
        want = (m.shape[0], 1, seq_len, seq_len)
    else:
        raise ValueError(f"attention_mask has {m.dim()} dims; expected [B, L] (key mask), "
                         "[B or 1, L, L] or [B or 1, 1, L, L] (query x key)")
    shape = tuple(attention_mask.shape)
    if shape != want or (m.dim() == 4 and m.shape[0] not in (1, batch)):
        raise ValueError(f"attention_mask shape {shape} does not fit input_ids "
                         f"[{batch}, {seq_len}]; expected [B, L], [B or 1, L, L] or "
                         "[B or 1, 1, L, L]")
    return m.bool()


def masked_dense_forward(model: DiffusionLM, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                         default: torch.Tensor | None) -> torch.Tensor:
    """Logits [B, L, V] of a dense forward under the official mask semantics.

    `default` is the model's own visibility ([L, L] bool, None = every key), used when no mask
    is given and combined with a 2-D key mask (so an all-ones key mask == no mask); a 3-D / 4-D
    mask replaces it. Positions: `position_ids` ([B or 1, L]) else 0..L-1. A query row that
    may attend to no key gives NaN, as in SDPA."""
    b, n = input_ids.shape
    if position_ids is None:
        positions = torch.arange(n, device=input_ids.device).expand(b, n)
    elif position_ids.shape not in ((1, n), (b, n)):
        raise ValueError(f"position_ids shape {tuple(position_ids.shape)}; expected [1, {n}] "
                         f"or [{b}, {n}]")
    else:
        positions = position_ids.expand(b, n)
    allowed = default
    if attention_mask is not None:
        mask = query_key_mask(attention_mask, b, n)
        if attention_mask.dim() == 2 and default is not None:
            mask = mask & default                         # [B, 1, L, L]
        allowed = mask
    if allowed is not None and bool(allowed.all()):
        allowed = None                                    # every key: plain full attention
    return dense_forward(model, input_ids, positions, allowed)
