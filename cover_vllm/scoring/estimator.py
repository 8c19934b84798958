"""The Monte-Carlo likelihood estimator of masked diffusion LMs: which continuation positions each
copy masks (drawn in the official order from the request's own generator) and how the copies'
cross-entropies combine into the estimate.

ML-GSAI/LLaDA `eval_llada.py` (`_forward_process`, `get_loglikelihood`), spelled out in
../shared/golden/README.md "The estimator": for a continuation y of T tokens after a context c
and n = mc_num / b mini-batches of b copies, each mini-batch draws k ~ U{1..T} and gives copy i
the mask count x_i = ((round(k + i*T/b) - 1) mod T) + 1 (torch.round: half to even; linspace in
float32), then masks a uniformly random subset of x_i continuation positions (the context never):

    logprob = -(1/mc_num) * sum_r (T / x_r) * sum_{j masked in r} -log p(y_j | copy r)

(the masked-diffusion ELBO with a stratified discrete t = x/T; LLaDA paper, Eq. 6 with t
stratified). The draws use only the CPU generator, so a request's value never depends on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Draws:
    """Every copy of one request, in the official order (mini-batch by mini-batch)."""

    masks: torch.Tensor      # [mc_num, T] bool: continuation position j masked in copy r
    ratios: torch.Tensor     # [mc_num] float32: x_r / T, the official `p_mask` of copy r

    @property
    def num_copies(self) -> int:
        return int(self.masks.shape[0])


def mask_counts(k: torch.Tensor, length: int, batch_size: int) -> torch.Tensor:
    """[b] long: the stratified mask counts of one mini-batch whose first count is k (a 0-d
    long tensor: the end point is computed in float32 tensor arithmetic, as the official code
    does, so even a batch size that is not a power of two rounds the same)."""
    end = k + (batch_size - 1) * (length / batch_size)
    x = torch.round(torch.linspace(float(k), end, steps=batch_size)).long()
    return ((x - 1) % length) + 1


def draw_masks(length: int, mc_num: int, batch_size: int,
               generator: torch.Generator) -> Draws:
    """All mc_num copies' masks, drawing per mini-batch one `randint(1, T+1, ())` and then one
    `randperm(T)` per copy, in copy order, from `generator` (the official calls, on the CPU
    generator the official code uses under `torch.manual_seed`)."""
    masks, counts = [], []
    for _ in range(mc_num // batch_size):
        k = torch.randint(1, length + 1, (), generator=generator)
        x = mask_counts(k, length, batch_size)
        for count in x.tolist():
            perm = torch.randperm(length, generator=generator)
            masks.append(perm < count)
        counts.append(x)
    counts = torch.cat(counts)
    return Draws(torch.stack(masks), counts / length)

