"""Applies `EmbedEdit`s (scheduler/output.py) to a forward's input embeddings (ASRD, §2.6).

An edit adds a weighted mix of token embeddings at some positions and/or an orthogonal
perturbation of a given relative size:

    e_p <- e_p + sum_k w[p, k] * embed(id[p, k])  +  eps[p] * |e_p| * u_p,   u_p ⟂ e_p, |u_p| = 1

u_p comes from a generator seeded by the edit alone, so an edit never depends on the batch. The
arithmetic runs in float32 and is cast back to the embedding dtype.
"""

from __future__ import annotations

import torch

from cover_vllm.scheduler.output import EmbedEdit


def orthogonal_unit(e: torch.Tensor, seed: int) -> torch.Tensor:
    """[N, D] -> [N, D] random unit vectors, each orthogonal to its row of e (float32)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(e.shape, generator=g, dtype=torch.float32).to(e.device)
    e32 = e.float()
    r = r - (r * e32).sum(-1, keepdim=True) / (e32 * e32).sum(-1, keepdim=True).clamp(
        min=1e-12) * e32
    return r / r.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def apply_embed_edits(embed, embeds: torch.Tensor,
                      edits: list[tuple[torch.Tensor, EmbedEdit]]) -> torch.Tensor:
    """embeds [T, D]; edits: (flat index [N] of each edited position, its edit); `embed` maps
    token ids to embeddings (the model's). Returns an edited copy."""
    out = embeds.clone()
    for flat, edit in edits:
        e = embeds[flat].float()                                            # [N, D]
        if edit.mix_ids.numel():
            mix = embed(edit.mix_ids.reshape(-1).to(embeds.device)).float()  # [N * K, D]
            mix = mix.view(*edit.mix_ids.shape, -1)                          # [N, K, D]
            weights = edit.mix_weights.to(device=embeds.device, dtype=torch.float32)
            e = e + (weights[..., None] * mix).sum(1)
        if bool((edit.perturb != 0).any()):                  # decided on the host copy
            eps = edit.perturb.to(device=embeds.device, dtype=torch.float32)
            base = embeds[flat].float()
            e = e + eps[:, None] * base.norm(dim=-1, keepdim=True) * orthogonal_unit(base,
                                                                                    edit.seed)
        out[flat] = e.to(embeds.dtype)
    return out
