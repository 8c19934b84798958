"""Token proposals shared by strategies: greedy/temperature candidates and their confidences."""

from __future__ import annotations

import torch


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """logits [n, W, V]; per-row top_k [n] (-1 off) and top_p [n] (1.0 off) -> filtered logits."""
    out = logits
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
        kth = logits.sort(dim=-1, descending=True).values.gather(
            -1, (k - 1)[:, None, None].expand(*logits.shape[:2], 1))
        out = out.masked_fill(out < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = out.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) > top_p[:, None, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def take_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [n, W, V] at rows [n, W] bool -> [N, V] in row-major order, as `logits[rows]`
    (index_select: 1.6x faster on CPU than boolean indexing)."""
    flat = rows.flatten().nonzero().squeeze(1)
    return logits.reshape(-1, logits.shape[-1]).index_select(0, flat)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, first index on ties (as `argmax`): `max(dim)`'s indices, the
    same tokens 2.7x (fp32) to 4.7x (bf16) faster on CPU (measured at [320, 16384])."""
    return logits.max(dim=-1).indices


def gumbel_candidates(logits: torch.Tensor, temperature: torch.Tensor,
                      generators: list[torch.Generator], lengths: list[int],
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """argmax of LLaDA's float64 Gumbel-max perturbation exp(l) / (-log u)^T; greedy rows at T=0.

    logits [n, W, V] -> tokens [n, W]. Noise for request i covers only its own `lengths[i]` view
    rows and comes from its own generator, so batching never changes a request's draws. With
    `rows` ([n, W] bool) the greedy argmax is taken only there (0 elsewhere).
    """
    if rows is None:
        tokens = greedy(logits)
    else:
        tokens = torch.zeros(logits.shape[:2], dtype=torch.long)
        tokens[rows] = greedy(take_rows(logits, rows))
    for i in (temperature > 0).nonzero().flatten().tolist():
        row = logits[i, : lengths[i]].double()
        u = torch.rand(row.shape, dtype=torch.float64, generator=generators[i])
        noisy = row.exp() / (-torch.log(u)) ** float(temperature[i])
        tokens[i, : lengths[i]] = greedy(noisy)
    return tokens


def sample_candidates(logits: torch.Tensor, temperature: torch.Tensor,
                      generators: list[torch.Generator], lengths: list[int]) -> torch.Tensor:
    """Dream-style sampling: softmax(logits / T) multinomial per row; argmax where T = 0."""
    tokens = greedy(logits)
    for i in (temperature > 0).nonzero().flatten().tolist():
        probs = torch.softmax(logits[i, : lengths[i]].float() / float(temperature[i]), dim=-1)
        tokens[i, : lengths[i]] = torch.multinomial(probs, 1, generator=generators[i]).squeeze(-1)
    return tokens


def token_prob(logits: torch.Tensor, tokens: torch.Tensor,
               dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None,
               picked: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(logits)[tokens] computed in `dtype`: [n, W, V], [n, W] -> [n, W].

    With `rows` ([n, W] bool) only those rows are computed (0 elsewhere): a full-vocabulary
    softmax is the costliest part of a decision, and a row's value never depends on the others.
    `picked` is `take_rows(logits, rows)` when the caller already has it.
    """
    if rows is None:
        return torch.softmax(logits.to(dtype), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    if picked is None:
        picked = take_rows(logits, rows)                                    # [N, V]
    out = torch.zeros(tokens.shape, dtype=dtype)
    probs = torch.softmax(picked.to(dtype), dim=-1)
    out[rows] = probs.gather(-1, tokens[rows][:, None]).squeeze(-1)
    return out


def topk_mask(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row, True at the k[i] highest scores (-inf entries are never chosen). [n, W], [n]."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.shape[-1]).expand_as(order))
    return (ranks < k[:, None]) & torch.isfinite(scores)
