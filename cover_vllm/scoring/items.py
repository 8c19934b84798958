"""ScoreItem and ScoreResult: one scoring request's share of a forward (what the scheduler hands
the runner beside the generation work items) and what the runner sends back for it.

A neutral module (only torch): the scoring queue builds the items, SchedulerOutput carries them,
the runner lays their sequences after the generation windows and reduces their logits on the
model's device to a few numbers per request (never full-vocabulary rows to the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScoreSeq:
    """One sequence of a scoring forward: a window of query positions over paged keys."""

    window_start: int            # first query position
    input_ids: torch.Tensor      # [W] tokens at positions window_start .. window_start + W - 1
    key_slots: torch.Tensor      # [K] cache slot of positions 0 .. K-1 (the keys it may see)


@dataclass
class CrossEntropyTargets:
    """Rows whose cross-entropy the runner sums, each into one continuation token's total:
    total[token_index[m]] += CE(logits of (seq[m], row[m]), target[m]) / ratio[m]. With cfg the
    logits are u + (s + 1) * (c - u), u from (uncond_seq[m], row[m])."""

    seq: torch.Tensor            # [M] long: sequence (index into ScoreItem.seqs) of the row
    row: torch.Tensor            # [M] long: window row (the masked position's predictor row)
    target: torch.Tensor         # [M] long: the token scored there
    ratio: torch.Tensor          # [M] float32: the copy's mask ratio x / T (official p_mask)
    token_index: torch.Tensor    # [M] long: continuation index j of the position
    uncond_seq: torch.Tensor | None = None   # [M] long: the copy's unconditional sequence


@dataclass
class GreedyTargets:
    """One greedy-check step: the still-masked rows of one canvas; the runner returns the row
    whose argmax has the largest fp32 softmax probability, and that token."""

    seq: int                     # sequence of the canvas
    rows: torch.Tensor           # [G] long: window rows of the masked positions' predictors
    uncond_seq: int | None = None


@dataclass
class ScoreItem:
    """One scoring request's sequences in one forward and what to reduce from them."""

    request_id: str
    seqs: list[ScoreSeq]
    causal_block: int | None     # block-causal attention with blocks of this size (None: full)
    num_tokens: int              # T: the continuation's length (size of the returned totals)
    cross_entropy: CrossEntropyTargets | None = None
    greedy: GreedyTargets | None = None
    cfg_scale: float = 0.0
    top_logprobs: int = 0        # T = 1 only: also return the k most likely tokens of row 0

    @property
    def num_query_tokens(self) -> int:
        return sum(int(s.input_ids.numel()) for s in self.seqs)


@dataclass
class ScoreResult:
    """What one ScoreItem's forward gives back (on the host)."""

    token_loss: torch.Tensor     # [T] float64: sum of CE / ratio per continuation token
    greedy: tuple[int, int] | None = None    # (index into GreedyTargets.rows, argmax token)
    top: tuple[list[int], list[float]] | None = None   # top_logprobs: token ids, log-probs
