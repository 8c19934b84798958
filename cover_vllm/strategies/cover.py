"""COVER: revocable parallel decoding with leave-one-out verification in the drafting forward.

ALGORITHMS.md §1 (arXiv 2602.06161; formulas beyond the abstract are reconstructions [RECON]).
Before each forward `select_seeds` picks committed block tokens whose cached K/V hold their
visible version (age >= 1), ranked by a stability score (uncertainty, attention in-mass from
still-masked rows, key drift; §1.6) with an adaptive budget (§1.7). The engine masks the seeds in
the input and serves their cached K/V to every other row; each seed's predictor row gets the
closed-form correction, so one forward yields both the drafts and each seed's leave-one-out
prediction. `decide` then drafts masked positions (threshold rule, §1.3 step 5) and gives every
seed Keep / Replace / ReMask (§1.8) under the progress guard ReMask <= drafted - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cover_vllm.strategies.base import BlockState, Decision, StepBatch, Strategy, StrategyParams
from cover_vllm.strategies.llada import propose
from cover_vllm.strategies.sampling import topk_mask


@dataclass(frozen=True)
class CoverParams(StrategyParams):
    draft_threshold: float = 0.97         # τ_draft: commit masked positions at least this sure
    max_draft: int | None = None          # B: cap on drafts per step (None: no cap)
    replace_threshold: float | None = None   # τ_rep (None: τ_draft)
    keep_min: float = 0.0                 # τ_keep_min: argmax agrees but less sure -> ReMask
    w_uncertainty: float = 0.5            # stability score weights (additive)
    w_influence: float = 0.25
    w_drift: float = 0.25
    drift_beta: float = 0.5               # EMA factor of the key drift
    rho_init: float = 0.5                 # seeds per step = ceil(rho * drafted last step)
    rho_min: float = 0.125
    rho_max: float = 2.0
    rho_eta: float = 0.25
    hit_high: float = 0.3                 # revision rate above which rho grows
    hit_low: float = 0.05                 # ... below which it shrinks
    k_min: int = 1
    k_max: int = 16
    max_verifications: int | None = 3     # a token verified this often is not picked again
    final_verify: bool = True             # block ends only when the drafts below were verified
    final_verify_below: float | None = None   # ... drafts less sure than this (None: τ_draft,
                                              # i.e. the forced ones; 1.0: every draft)
    max_verify_steps: int = 4             # ... or after this many steps without masks left

    def __post_init__(self) -> None:
        for name in ("draft_threshold", "keep_min", "drift_beta", "hit_high", "hit_low"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"decoding_params.{name} must be in [0, 1]")
        if self.final_verify_below is not None and not 0.0 <= self.final_verify_below <= 1.0:
            raise ValueError("decoding_params.final_verify_below must be in [0, 1] or null")
        if self.replace_threshold is not None and not 0.0 <= self.replace_threshold <= 1.0:
            raise ValueError("decoding_params.replace_threshold must be in [0, 1] or null")
        if not 0 < self.rho_min <= self.rho_init <= self.rho_max:
            raise ValueError("decoding_params needs 0 < rho_min <= rho_init <= rho_max")
        if self.k_min < 0 or self.k_max < self.k_min:
            raise ValueError("decoding_params needs 0 <= k_min <= k_max")
        if self.max_verify_steps < 0:
            raise ValueError("decoding_params.max_verify_steps must be >= 0")
        if self.max_draft is not None and self.max_draft < 1:
            raise ValueError("decoding_params.max_draft must be >= 1 or null")
        if min(self.w_uncertainty, self.w_influence, self.w_drift) < 0:
            raise ValueError("decoding_params score weights must be >= 0")


# rows of a request's per-position memory [5, block length] (float64; counters hold integers)
AGE, CHECKS, CONF, DRIFT, ATTN_IN = range(5)


def _minmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min-max normalise each row of x [F, L] over the columns in mask [L] (0 where a row's
    range is empty)."""
    lo = x.masked_fill(~mask, math.inf).amin(-1, keepdim=True)
    span = x.masked_fill(~mask, -math.inf).amax(-1, keepdim=True) - lo
    return torch.where(span > 0, (x - lo) / span, 0.0)


class Cover(Strategy):
    name = "cover"
    params_cls = CoverParams

    @property
    def _verify_below(self) -> float:
        """Drafts committed less sure than this must pass a check before their block ends."""
        p = self.params
        return p.draft_threshold if p.final_verify_below is None else p.final_verify_below

    @property
    def wants_stats(self) -> bool:
        """Drift and attention in-mass are measured only when the score uses them."""
        return self.params.w_influence > 0 or self.params.w_drift > 0

    def start_block(self, state: BlockState, num_masked: int) -> None:
        state.extra.update(mem=None, rho=self.params.rho_init, drafted=0, verify_steps=0)

    def block_done(self, state: BlockState, num_masked: int) -> bool:
        """Done when no [MASK] is left and every token committed less sure than
        `final_verify_below` was verified since (bounded by max_verify_steps mask-free steps):
        drafts from the last draft step need one forward with them visible before their cached
        K/V can serve a leave-one-out check."""
        if num_masked > 0:
            return False
        extra, mem = state.extra, state.extra.get("mem")
        if not self.params.final_verify or self.params.k_max == 0 or mem is None:
            return True
        extra["verify_steps"] += 1
        pending = ((mem[CHECKS] == 0) & (mem[CONF] < self._verify_below)).any()
        return not bool(pending) or extra["verify_steps"] > self.params.max_verify_steps

    @staticmethod
    def _memory(state: BlockState, length: int) -> torch.Tensor:
        """Per-position memory [5, length] of the current block (rows AGE..ATTN_IN), created on
        first use."""
        if state.extra.get("mem") is None:
            state.extra["mem"] = torch.zeros(5, length, dtype=torch.float64)
        return state.extra["mem"]

    # ---- before the forward ----------------------------------------------------------------
    def select_seeds(self, state: BlockState, block_tokens: torch.Tensor,
                     block_start: int) -> list[int]:
        p = self.params
        mem, extra = self._memory(state, block_tokens.numel()), state.extra
        cand = (block_tokens != self.spec.mask_token_id) & (mem[AGE] >= 1)
        if p.max_verifications is not None:
            cand &= mem[CHECKS] < p.max_verifications
        num = int(cand.sum())
        if num == 0 or p.k_max == 0:
            return []
        unchecked = None
        if bool((block_tokens == self.spec.mask_token_id).any()):
            k = min(max(math.ceil(extra["rho"] * extra["drafted"]), p.k_min), p.k_max, num)
        else:                           # verification-only step: every never-checked token
            unchecked = cand & (mem[CHECKS] == 0) & (mem[CONF] < self._verify_below)
            k = min(max(int(unchecked.sum()), p.k_min), p.k_max, num)
        if k == num:                    # every candidate: no ranking needed
            return (block_start + cand.nonzero()[:, 0]).tolist()
        u, d_in, drift = _minmax(torch.stack((1.0 - mem[CONF], mem[ATTN_IN], mem[DRIFT])), cand)
        score = p.w_uncertainty * u + p.w_influence * d_in + p.w_drift * drift
        if unchecked is not None:
            score = score + unchecked.double() * 10.0
        score = score.masked_fill(~cand, float("-inf"))
        return (block_start + score.topk(k).indices.sort().values).tolist()

    # ---- after the forward -----------------------------------------------------------------
    def decide(self, batch: StepBatch) -> Decision:
        p = self.params
        draft_tokens, logits = propose(batch)
        probs = torch.softmax(logits.to(torch.float64), dim=-1)
        conf, best = probs.max(dim=-1)                                   # [n, W]
        cand_conf = probs.gather(-1, draft_tokens[..., None])[..., 0]    # = threshold's float64
        cand_conf = cand_conf.masked_fill(~batch.candidates, float("-inf"))
        draft = topk_mask(cand_conf, torch.ones(conf.shape[0], dtype=torch.long))
        draft |= torch.isfinite(cand_conf) & (cand_conf >= p.draft_threshold)
        if p.max_draft is not None:
            draft &= topk_mask(cand_conf, torch.full((conf.shape[0],), p.max_draft))

        seeds = batch.seeds if batch.seeds is not None else torch.zeros_like(draft)
        p_own = probs.gather(-1, batch.tokens.clamp(max=probs.shape[-1] - 1)[..., None])[..., 0]
        agree = best == batch.tokens
        tau_rep = p.draft_threshold if p.replace_threshold is None else p.replace_threshold
        keep = seeds & agree & (p_own >= p.keep_min)
        replace = seeds & ~agree & (conf >= tau_rep)
        remask = seeds & ~keep & ~replace
        if bool(remask.any()):
            # progress guard (§1.3 step 6): at most max(0, drafted - 1) remasks, the least
            # likely own tokens first; the rest are kept. A verification-only step (no [MASK]
            # left) drafts nothing, so it may keep or replace but never remask.
            allowed = (draft.sum(-1) - 1).clamp(min=0)
            guarded = topk_mask((-p_own).masked_fill(~remask, float("-inf")), allowed)
            keep |= remask & ~guarded
            remask = guarded
        tokens = torch.where(replace, best, draft_tokens) if bool(replace.any()) else draft_tokens
        self._update_memory(batch, draft, keep, replace, remask, conf, p_own)
        return Decision(commit=draft, tokens=tokens, remask=remask, replace=replace,
                        keeps=keep.sum(-1), verified=seeds.sum(-1))

    def _update_memory(self, batch: StepBatch, draft, keep, replace, remask, conf, p_own):
        """Advance every request's per-position memory (block positions) at once."""
        p = self.params
        blk = batch.in_block
        mems = [self._memory(st, int(n)) for st, n in zip(batch.states, blk.sum(-1))]
        m = torch.zeros(blk.shape[0], 5, blk.shape[1], dtype=torch.float64)   # [n, 5, W]
        for i, mem in enumerate(mems):
            m[i][:, blk[i]] = mem
        age, checks, last_conf, drift = m[:, AGE], m[:, CHECKS], m[:, CONF], m[:, DRIFT]
        seeds = batch.seeds if batch.seeds is not None else torch.zeros_like(draft)
        visible = ~batch.masked & batch.valid & ~seeds
        if batch.drift is not None:
            seen = visible & (age >= 1)                 # the cached key was a visible version
            ema = p.drift_beta * drift + (1 - p.drift_beta) * batch.drift.double()
            m[:, DRIFT] = torch.where(seen, ema, drift)
        if batch.attn_in is not None:
            m[:, ATTN_IN] = batch.attn_in
        fresh = draft | replace | remask
        m[:, AGE] = torch.where(fresh, 0.0, age + visible.double())
        m[:, DRIFT].masked_fill_(fresh, 0.0)
        m[:, CHECKS] = torch.where(fresh, 0.0, checks + seeds.double())
        m[:, CONF] = torch.where(keep, p_own, torch.where(draft | replace, conf, last_conf))
        num_seeds = seeds.sum(-1).tolist()
        hits = (replace | remask).sum(-1).tolist()
        drafted = draft.sum(-1).tolist()
        for i, (mem, st) in enumerate(zip(mems, batch.states)):
            mem.copy_(m[i][:, blk[i]])
            extra = st.extra
            if num_seeds[i]:
                hit = hits[i] / num_seeds[i]
                if hit > p.hit_high:
                    extra["rho"] = min(extra["rho"] * (1 + p.rho_eta), p.rho_max)
                elif hit < p.hit_low:
                    extra["rho"] = max(extra["rho"] * (1 - p.rho_eta), p.rho_min)
            extra["drafted"] = drafted[i]
