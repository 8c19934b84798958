"""`wino`: Wide-In, Narrow-Out revocable decoding (Feng-Hong/WINO-DLLM `decoding_wino`, §2.3).

Reference: LLaDA/decoding.py `decoding_wino` @ 9549a1d; ALGORITHMS.md §2.3.

Every forward also runs a *shadow block*: block_length [MASK] query rows (`extra_rows`) at the
current block's own positions. Canvas rows never see them; they see each other and every canvas
position except the one each mirrors, so shadow row j re-predicts block slot j without reading it
(leave-one-out) in the same forward that drafts. Per iteration (probabilities in float64):

* Wide-In: reveal the block's [MASK] slots with p(candidate) > τ1 (`threshold`); if more than
  max_accept = min(max(⌊0.7 · masked⌋, 5), 20) qualify, only the top max_accept; if none, the best.
* Narrow-Out, only when more than one slot was revealed this iteration: every slot revealed in an
  earlier iteration whose shadow probability of its current token is < τ2 (`threshold_back`) is
  remasked; if there are at least `last_accept` of them (the previous iteration's reveal count, 30
  when the block starts), only the lowest last_accept − 1. A slot revealed in this iteration is
  scored in a later one.

One forward per iteration; a block ends when it holds no [MASK]. The shadow rows are skipped in a
forward where the block has no revealed slot (nothing to verify; canvas rows never see them, so
this is exact).

Dream (logit shift 1; an extension, the reference is LLaDA-only): shadow row j sits at the
predictor position π(s) = s − 1 of its slot s and hides column s, so it is again the leave-one-out
prediction of s.

KV cache: shadow K/V are never written (ExtraRows are queries only). With kv_cache="none" every
forward is the reference's. With `prefix`/`dual` the canvas rows are Fast-dLLM's approximation
(prompt/earlier blocks, and with `dual` the masked suffix, read from the block's refresh), and the
shadow rows read the same cache, so their verification is approximate in exactly the same way;
remasks stay inside the current block, which is always recomputed.

Accounting: `verified` counts slots checked by Narrow-Out, `keeps` those left unchanged; remasks
and flip-flops are counted by the engine (RequestMetrics).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cover_vllm.step_plan import ExtraRows
from cover_vllm.strategies.base import (BlockState, Decision, StepBatch, Strategy,
                                        StrategyParams, block_rows)
from cover_vllm.strategies.llada import propose
from cover_vllm.strategies.sampling import on_device, token_prob, topk_mask

INF = float("inf")


@dataclass(frozen=True)
class WinoParams(StrategyParams):
    threshold: float = 0.6          # τ1: reveal [MASK] slots with p(candidate) > τ1
    threshold_back: float = 0.9     # τ2: remask revealed slots whose shadow p(token) < τ2
    accept_ratio: float = 0.7       # max_accept = min(max(⌊ratio · masked⌋, min), max)
    accept_min: int = 5
    accept_max: int = 20
    initial_last_accept: int = 30   # "tokens revealed in the previous iteration" at block start

    def __post_init__(self) -> None:
        for name in ("threshold", "threshold_back", "accept_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"decoding_params.{name} must be in [0, 1], "
                                 f"got {getattr(self, name)}")
        for name in ("accept_min", "accept_max", "initial_last_accept"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"decoding_params.{name} must be an integer >= 1, got {value!r}")
        if self.accept_min > self.accept_max:
            raise ValueError("decoding_params needs accept_min <= accept_max")


def shadow_prob(batch: StepBatch) -> torch.Tensor:
    """[n, W] float64: shadow row j's probability of the current token of block slot j, at that
    slot's view column; +inf where there is no shadow row (outside the block, no extra rows)."""
    out = torch.full(batch.tokens.shape, INF, dtype=torch.float64, device=batch.device)
    if batch.extra_logits is None:
        return out
    e = batch.extra_logits.shape[1]
    first = batch.in_block.long().argmax(-1)                              # [n] block's 1st column
    cols = first[:, None] + torch.arange(e, device=batch.device)          # [n, E] shadow -> column
    tokens = batch.tokens.gather(1, cols.clamp(max=batch.tokens.shape[1] - 1))
    prob = token_prob(batch.extra_logits, tokens.clamp(max=batch.extra_logits.shape[-1] - 1),
                      torch.float64)                                      # [n, E]
    # column j reads shadow row j - first (each column has at most one)
    row = torch.arange(batch.tokens.shape[1], device=batch.device) - first[:, None]   # [n, W]
    has = (row >= 0) & (row < e) & batch.in_block
    row = row.clamp(0, e - 1)
    has &= batch.extra_valid.gather(1, row)
    return torch.where(has, prob.gather(1, row), out)


@dataclass
class WinoState:
    """Per-block state of WINO."""

    last_accept: int        # drafts accepted last step (sizes this step's Wide-In budget)
    shadow: tuple | None = None   # ((start, end, canvas length), ExtraRows): the block's shadow
                                  # rows, built on its first step that has one (read-only)


class Wino(Strategy):
    name = "wino"
    params_cls = WinoParams

    def start_block(self, state: BlockState, num_masked: int) -> None:
        state.extra = WinoState(last_accept=self.params.initial_last_accept)

    def extra_rows(self, state: BlockState, canvas: torch.Tensor,
                   block: tuple[int, int]) -> ExtraRows | None:
        return self.plan_extra_rows([state], [canvas], [block])[0]

    def plan_extra_rows(self, states: list[BlockState], canvases: list[torch.Tensor],
                        blocks: list[tuple[int, int]]) -> list[ExtraRows | None]:
        """Each request's shadow block, or None while nothing of its block is revealed (nothing
        to verify): one test for the batch; the rows themselves are built once per block."""
        tokens, _, lengths = block_rows(canvases, blocks)
        in_block = np.arange(tokens.shape[1]) < lengths[:, None]
        revealed = ((tokens != self.spec.mask_token_id) & in_block).any(-1).tolist()
        return [self._shadow(st, canvas, block) if shown else None
                for st, canvas, block, shown in zip(states, canvases, blocks, revealed)]

    def _shadow(self, state: BlockState, canvas: torch.Tensor,
                block: tuple[int, int]) -> ExtraRows:
        key = (*block, int(canvas.numel()))
        if state.extra.shadow is None or state.extra.shadow[0] != key:
            state.extra.shadow = (key, self._shadow_rows(*key))
        return state.extra.shadow[1]

    def _shadow_rows(self, start: int, end: int, length: int) -> ExtraRows:
        """The shadow block of canvas positions [start, end): one [MASK] row per slot at its
        predictor position, seeing every canvas column but its own slot (§1.4)."""
        mask, e = self.spec.mask_token_id, end - start
        slots = torch.arange(start, end)                                   # [E] mirrored slots
        allowed = torch.ones(e, length + e, dtype=torch.bool)              # [E, L + E]
        allowed[torch.arange(e), slots] = False                            # ~eye on its slot
        positions = (slots - self.spec.logit_shift).clamp(min=0)           # π(s)
        return ExtraRows(torch.full((e,), mask, dtype=torch.long), positions, allowed)

    def decide(self, batch: StepBatch) -> Decision:
        p = self.params
        tokens, logits = propose(batch)
        cand = batch.candidates
        conf = token_prob(logits, tokens, torch.float64, mask=batch.mask_column)   # [n, W]
        conf = conf.masked_fill(~cand, -INF)
        # Wide-In: int(masked * 0.7) on a tensor, as the reference computes it
        max_accept = (cand.sum(-1) * p.accept_ratio).long().clamp(p.accept_min, p.accept_max)
        above = cand & (conf > p.threshold)
        count = above.sum(-1)
        best = topk_mask(conf, torch.ones_like(count)) & (count == 0)[:, None]
        commit = torch.where((count > max_accept)[:, None], topk_mask(conf, max_accept),
                             above | best)
        num_accept = commit.sum(-1)
        # Narrow-Out over slots revealed before this iteration
        back = shadow_prob(batch)
        checked = batch.in_block & ~batch.masked & batch.valid & torch.isfinite(back)
        checked &= (num_accept > 1)[:, None]
        low = checked & (back < p.threshold_back)
        last = on_device([st.extra.last_accept for st in batch.states], low, torch.long)
        num_low = low.sum(-1)
        cap = torch.where(num_low >= last, last - 1, num_low)
        remask = topk_mask((-back).masked_fill(~low, -INF), cap)
        return Decision(commit=commit, tokens=tokens, remask=remask,
                        keeps=(checked & ~remask).sum(-1), verified=checked.sum(-1))

    def absorb(self, batch: StepBatch, decision: Decision) -> None:
        for st, k in zip(batch.states, decision.commit.sum(-1).tolist()):
            st.extra.last_accept = k
