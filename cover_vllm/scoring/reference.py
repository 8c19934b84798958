"""The slow reference: the official estimator's loop (one `model(batch)` of batch_size copies per
mini-batch, no engine, no cache), spelled out from ../shared/golden/README.md "The estimator" and
"The greedy check". Tests check the engine against it on every family; `cover-vllm bench
loglikelihood` times it as the research loop's cost.

`logits_fn(batch [B, L] long) -> [B, L, V]` is the model's raw logits; `logit_shift` 1 reads
position p's logits from row max(p - 1, 0) (Dream); a block-causal model's `logits_fn` applies
its block mask itself (`block_causal_logits`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from cover_vllm.scoring.estimator import mask_counts
from cover_vllm.scoring.params import LoglikelihoodParams

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def _shifted(logits: torch.Tensor, shift: int) -> torch.Tensor:
    if not shift:
        return logits
    return torch.cat((logits[:, :shift], logits[:, :-shift]), dim=1)


def _guided_logits(logits_fn: LogitsFn, batch: torch.Tensor, prompt_len: int, mask_id: int,
                   cfg: float, shift: int) -> torch.Tensor:
    if cfg <= 0:
        return _shifted(logits_fn(batch), shift)
    uncond = batch.clone()
    uncond[:, :prompt_len] = mask_id
    both = _shifted(logits_fn(torch.cat((batch, uncond))), shift)
    cond, un = both.chunk(2, dim=0)
    return un + (cfg + 1) * (cond - un)


def reference_loglikelihood(logits_fn: LogitsFn, context: list[int], continuation: list[int],
                            params: LoglikelihoodParams, mask_id: int,
                            logit_shift: int = 0) -> float:
    """The official `get_loglikelihood`, drawing from torch.Generator(params.seed)."""
    gen = torch.Generator().manual_seed(params.seed or 0)
    b, length, p = params.batch_size, len(continuation), len(context)
    seq = torch.tensor(context + continuation)[None].repeat(b, 1)
    losses = []
    for _ in range(params.mc_num // b):
        k = torch.randint(1, length + 1, (), generator=gen)
        x = mask_counts(k, length, b)
        is_mask = torch.stack([torch.randperm(length, generator=gen) < c for c in x.tolist()])
        is_mask = torch.cat((torch.zeros(b, p, dtype=torch.bool), is_mask), dim=1)
        noisy = torch.where(is_mask, mask_id, seq)
        logits = _guided_logits(logits_fn, noisy, p, mask_id, params.cfg_scale, logit_shift)
        ratio = (x / length)[:, None].expand(b, p + length)
        loss = F.cross_entropy(logits[is_mask], seq[is_mask], reduction="none") / ratio[is_mask]
        losses.append(float(loss.sum() / b))
    return -sum(losses) / len(losses)


def reference_is_greedy(logits_fn: LogitsFn, context: list[int], continuation: list[int],
                        params: LoglikelihoodParams, mask_id: int, logit_shift: int = 0) -> bool:
    """The official `suffix_greedy_prediction`: T forwards, one most-confident token each."""
    p, length = len(context), len(continuation)
    seq = torch.tensor(context + [mask_id] * length)[None]
    for _ in range(length):
        masked = seq[0] == mask_id
        logits = _guided_logits(logits_fn, seq, p, mask_id, params.cfg_scale,
                                logit_shift)[0, masked]
        token = logits.argmax(dim=-1)
        conf = torch.softmax(logits.float(), dim=-1).gather(1, token[:, None])[:, 0]
        keep = torch.argmax(conf)
        pos = masked.nonzero().flatten()[keep]
        seq[0, pos] = token[keep]
    return bool((seq[0, p:] == torch.tensor(continuation)).all())


def block_causal_logits(model, block: int) -> LogitsFn:
    """`logits_fn` of a block-causal model: the whole sequence in one dense forward, a row at
    position q seeing keys < min((q // B + 1) * B, L) (blocks aligned to position 0)."""
    from cover_vllm.models.base import dense_forward

    def run(batch: torch.Tensor) -> torch.Tensor:
        n = batch.shape[1]
        pos = torch.arange(n)
        allowed = pos[None, :] < ((pos // block + 1) * block)[:, None]
        positions = pos.expand(batch.shape[0], n)
        return dense_forward(model, batch, positions, allowed[None, None])

    return run
