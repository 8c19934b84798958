"""COVER: revocable parallel decoding with leave-one-out verification in the drafting forward.

ALGORITHMS.md §1 (arXiv 2602.06161; formulas beyond the abstract are reconstructions [RECON]).
Before each forward `select_seeds` picks committed block tokens whose cached K/V hold their
visible version (age >= 1), ranked by a stability score (uncertainty, attention in-mass from
still-masked rows, key drift; §1.6) with an adaptive budget (§1.7). The engine masks the seeds in
the input and serves their cached K/V to every other row; each seed's predictor row sees the
seed's fresh (masked) K/V instead (the attention backend's override views), so one forward
yields both the drafts and each seed's leave-one-out prediction. `decide` then drafts masked
positions (threshold rule, §1.3 step 5) and gives every seed Keep / Replace / ReMask (§1.8):
Replace when the check prefers another token by majority, at most `max_revise` revisions per
step, ReMask under the progress guard ReMask <= drafted - 1. A block ends when no token judged
below `final_verify_below` has gone stale (its context changed after it was judged).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cover_vllm.strategies.base import (BlockState, Decision, StepBatch, Strategy,
                                        StrategyParams, block_rows)
from cover_vllm.strategies.llada import plain_greedy, propose
from cover_vllm.strategies.sampling import (Rows, greedy, greedy_max, top1_or_at_least,
                                            topk_mask)
from cover_vllm.strategies.state_rows import RowMemory, StateRows


@dataclass(frozen=True)
class CoverParams(StrategyParams):
    draft_threshold: float = 0.97         # τ_draft: commit masked positions at least this sure
    max_draft: int | None = None          # B: cap on drafts per step (None: no cap)
    replace_threshold: float | None = 0.5    # τ_rep: a seed whose leave-one-out argmax is
                                             # another token at least this likely is replaced
                                             # in place (None: τ_draft)
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
    max_revise: int | None = 1            # Replace + ReMask per step (None: no cap)
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
        if self.max_revise is not None and self.max_revise < 1:
            raise ValueError("decoding_params.max_revise must be >= 1 or null")
        if min(self.w_uncertainty, self.w_influence, self.w_drift) < 0:
            raise ValueError("decoding_params score weights must be >= 0")


MEMORY_FIELDS = ("age", "checks", "conf", "drift", "attn_in", "stale")


class CoverMemory(RowMemory):
    """Per-position memory of a request's current block: a row of its Cover's `StateRows`
    (strategies/state_rows.py), so a batch reads and updates every request's memory at once.
    Fields, each [block_len] float64 (counters and flags hold integers):

    * age: forwards the token has been visible in (>= 1: its cached K/V hold the visible
      version, so it can serve a leave-one-out check);
    * checks: leave-one-out checks it took part in;
    * conf: probability it was last judged with (drafted, replaced or kept);
    * drift: EMA of its key's relative change at write-back;
    * attn_in: attention mass still-masked rows put on it (last forward);
    * stale: 1 when another position changed since it was last judged, so a check now would
      see a context that judgement did not."""

    @classmethod
    def of(cls, values: np.ndarray) -> "CoverMemory":
        """A detached memory holding `values` [6, block_len] (MEMORY_FIELDS order)."""
        return cls.detached(MEMORY_FIELDS, values)

    @classmethod
    def zeros(cls, length: int) -> "CoverMemory":
        return cls.of(np.zeros((len(MEMORY_FIELDS), length)))


@dataclass
class CoverState:
    """COVER's per-request state in the current block (its BlockState.extra)."""

    rho: float                           # seeds per step = ceil(rho * drafted last step)
    drafted: int = 0                     # positions drafted in the last step
    verify_steps: int = 0                # steps that ended with no [MASK] left in the block
    memory: CoverMemory | None = None    # taken on the first step (`Cover._memory`)


def _minmax(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Min-max normalise x [F, n, L] along L over the columns in mask [n, L], each (f, row) on
    its own (0 where its range is empty)."""
    lo = np.where(mask, x, np.inf).min(-1, keepdims=True)
    span = np.where(mask, x, -np.inf).max(-1, keepdims=True) - lo
    return np.where(span > 0, (x - lo) / np.where(span > 0, span, 1.0), 0.0)


@dataclass
class _Seeds:
    """The seeds of one step as flat host arrays [S] (request-major, positions ascending) with
    their leave-one-out verdicts, read from a host decision (`Cover.absorb`)."""

    req: np.ndarray               # request row
    pos: np.ndarray               # view position
    conf: np.ndarray              # probability of the leave-one-out argmax
    own: np.ndarray               # the committed token's leave-one-out probability
    keep: np.ndarray              # verdicts, bool [S]; a deferred seed keeps its token and
    deferred: np.ndarray          # counts as unchecked
    replace: np.ndarray
    remask: np.ndarray

    @classmethod
    def of(cls, seeds: np.ndarray, d: Decision) -> "_Seeds":
        req, pos = seeds.nonzero()
        at = lambda t: t.numpy()[req, pos]  # noqa: E731
        return cls(req, pos, at(d.state["conf"]), at(d.state["own"]), at(d.state["keep"]),
                   at(d.state["deferred"]), at(d.replace), at(d.remask))


def and_not(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a & ~b` of bool tensors in one op instead of two: False < True, so a > b exactly
    where a is True and b is False (issue #50: a step's device ops)."""
    return a > b


def _least_likely(mask: torch.Tensor, minus_own: torch.Tensor,
                  k: torch.Tensor | int) -> torch.Tensor:
    """[n, W] bool: within `mask`, the k[request] positions with the lowest own-token
    probability (ties: lower position first); `minus_own` = -own, negated once per decision.
    A k below 1 picks nothing (no rank is below it). -own is never +inf (own is a probability)."""
    return topk_mask(torch.where(mask, minus_own, float("-inf")), k, never_inf=True)


class Cover(Strategy):
    name = "cover"
    masked_rows_only = True
    verifies_seeds = True
    params_cls = CoverParams

    def __init__(self, params: CoverParams, spec):
        super().__init__(params, spec)
        # every request's CoverMemory: rows of one table (the persistent batch's COVER slice)
        self.memory_rows = StateRows(MEMORY_FIELDS)

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
        state.extra = CoverState(rho=self.params.rho_init)

    def block_done(self, state: BlockState, num_masked: int) -> bool:
        """Done when no [MASK] is left and no token judged less sure than `final_verify_below`
        is stale (`_unverified`), or after max_verify_steps mask-free steps. Drafts from the
        last draft step need one forward with them visible before their cached K/V can serve
        a leave-one-out check."""
        if num_masked > 0:
            return False
        cover, p = state.extra, self.params
        if not p.final_verify or p.k_max == 0 or cover.memory is None:
            return True
        mem = cover.memory
        pending = bool(self._unverified(mem.conf, mem.stale).any())
        return not pending or cover.verify_steps > p.max_verify_steps

    def _unverified(self, conf: np.ndarray, stale: np.ndarray) -> np.ndarray:
        """[..., L] bool: committed tokens that must pass a check before their block ends: last
        judged (drafted, replaced or checked) less sure than `final_verify_below`, from a
        context that has changed since (CoverMemory's `conf` and `stale`). A token drafted
        alone after which nothing changed was predicted from exactly its leave-one-out view;
        checking it would repeat the draft."""
        return (conf < self._verify_below) & (stale > 0)

    def _memory(self, state: BlockState, length: int) -> CoverMemory:
        """The current block's per-position memory: a row of this instance's table, taken on
        first use (a detached copy, a snapshot's, is moved in)."""
        mem = state.extra.memory
        if mem is None:
            mem = state.extra.memory = CoverMemory(self.memory_rows, length)
        else:
            self.memory_rows.adopt(mem)
        return mem

    # ---- before the forward ----------------------------------------------------------------
    def select_seeds(self, state: BlockState, block_tokens: torch.Tensor,
                     block_start: int) -> list[int]:
        picked = self.plan_seeds([state], [block_tokens], [(0, block_tokens.numel())])[0]
        return [block_start + s for s in picked]

    def plan_seeds(self, states: list[BlockState], canvases: list[torch.Tensor],
                   blocks: list[tuple[int, int]]) -> list[list[int]]:
        """Every request's seeds at once, from its memory's rows (a fixed number of numpy ops
        whatever the batch): per request, candidates are visible block tokens (age >= 1) checked
        fewer than `max_verifications` times; `k` = ceil(rho * drafted last step) in [k_min,
        k_max], or, with no [MASK] left, every token the block still waits for (`_unverified`),
        ranked first. The top-k stability scores (§1.6: min-max normalised over the request's
        candidates) win, ties to the lower position."""
        p = self.params
        if p.k_max == 0:
            return [[] for _ in states]
        tokens, start, length = block_rows(canvases, blocks)                # [n, B], [n]
        cols = np.arange(tokens.shape[1])
        in_block = cols < length[:, None]                                    # [n, B]
        mems = [self._memory(st, n) for st, n in zip(states, length.tolist())]
        rows = self.memory_rows.data[[m.row for m in mems]][:, :, :cols.size]
        age, checks, conf, drift, attn_in, stale = rows.transpose(1, 0, 2)   # each [n, B]
        masked = (tokens == self.spec.mask_token_id) & in_block
        visible = in_block & ~masked & (age >= 1)
        cand = visible
        if p.max_verifications is not None:
            cand = cand & (checks < p.max_verifications)
        # a verification-only step (no [MASK] left): every token the block still waits for, first
        verify_only = ~masked.any(-1)
        pending = visible & self._unverified(conf, stale) & verify_only[:, None]
        cand = cand | pending
        extra = [st.extra for st in states]
        rho_drafted = np.array([(c.rho, c.drafted) for c in extra]).reshape(-1, 2)
        want = np.where(verify_only, pending.sum(-1), np.ceil(rho_drafted.prod(-1)))
        k = np.minimum(np.minimum(np.maximum(want, p.k_min), p.k_max), cand.sum(-1))
        u, d_in, d = _minmax(np.stack((1.0 - conf, attn_in, drift)), cand)
        score = p.w_uncertainty * u + p.w_influence * d_in + p.w_drift * d + pending * 10.0
        order = np.argsort(-np.where(cand, score, -np.inf), axis=-1, kind="stable")
        picked = np.zeros_like(cand)
        np.put_along_axis(picked, order, cols < k[:, None], axis=-1)
        req, col = picked.nonzero()
        seeds, bounds = (start[req] + col).tolist(), np.cumsum(picked.sum(-1)).tolist()
        return [seeds[a:b] for a, b in zip([0] + bounds, bounds)]

    # ---- after the forward -----------------------------------------------------------------
    def decide(self, batch: StepBatch) -> Decision:
        p = self.params
        seeds = torch.zeros_like(batch.valid) if batch.seeds is None else batch.seeds
        candidates = batch.candidates
        # the only rows a decision reads: the block's [MASK]s (drafts) and the seeds (checks);
        # a float64 softmax over the whole view's vocabulary cost most of a step's decision
        rows = Rows(candidates | seeds)
        picked = rows.take(batch.logits)                   # [N, V], read once when greedy
        draft_tokens = (rows.put(greedy(picked), 0) if plain_greedy(batch) else
                        propose(batch, rows=rows)[0])
        probs = torch.softmax(picked.to(torch.float64), dim=-1)               # [N, V]
        cand_conf = rows.gather(probs, draft_tokens, float("-inf"),   # = threshold's float64
                                keep=candidates)
        # the surest [MASK] of each request, and every one at least draft_threshold sure
        draft = top1_or_at_least(cand_conf, p.draft_threshold)   # a probability, or -inf
        if p.max_draft is not None:
            draft &= topk_mask(cand_conf, p.max_draft, never_inf=True)
        # each seed's leave-one-out row: its argmax, that one's probability, its own token's
        checks = Rows(seeds, within=rows)
        loo = checks.take(probs)                                             # [S, V]
        best, conf = greedy_max(loo)                        # argmax (first on ties), its prob
        best, conf = checks.put(best, 0), checks.put(conf, 0.0)
        own_token = checks.take(rows.take(batch.tokens)).clamp(max=probs.shape[-1] - 1)
        own = checks.gather_taken(loo, own_token, 0.0)
        keep, deferred, replace, remask = self._judge(batch, seeds, draft, best, conf, own)
        state = {"keep": keep, "deferred": deferred, "draft_conf": cand_conf, "conf": conf,
                 "own": own}
        for name in ("drift", "attn_in"):           # the memory update reads them (absorb)
            if getattr(batch, name) is not None:
                state[name] = getattr(batch, name)
        return Decision(commit=draft, tokens=torch.where(replace, best, draft_tokens),
                        remask=remask, replace=replace, keeps=(keep | deferred).sum(-1),
                        verified=seeds.sum(-1), state=state)

    def _judge(self, batch: StepBatch, seeds: torch.Tensor, draft: torch.Tensor,
               best: torch.Tensor, conf: torch.Tensor, own: torch.Tensor):
        """Keep / defer / Replace / ReMask, [n, W] bool each, for every seed of the batch (§1.8),
        from its leave-one-out argmax `best`, that one's probability `conf` and its own token's
        probability `own`."""
        p = self.params
        agree = best == batch.tokens
        keep = seeds & agree & (own >= p.keep_min)
        revise = and_not(seeds, keep)
        minus_own = own.neg()
        # Revise at most max_revise seeds per request and step, the least likely own tokens
        # first. Each seed's check assumed every other seed keeps its token, so two revisions in
        # one step can contradict each other (two cells of a row both taking the missing
        # digit); the rest are kept for now and checked again (`deferred`).
        if p.max_revise is not None:
            first = _least_likely(revise, minus_own, p.max_revise)
            deferred, revise = and_not(revise, first), first
        else:
            deferred = torch.zeros_like(revise)
        # Replace when the check prefers another token by majority (changed in place: no
        # progress lost, never a flip-flop); ReMask when it is unsure of every token. τ_rep =
        # 0.5 rather than τ_draft: on cover-tiny the remasks τ_draft left were 3 in 4 flip-flops
        # and replacing them instead cost no accuracy (docs/benchmarks.md).
        tau_rep = p.draft_threshold if p.replace_threshold is None else p.replace_threshold
        replace = and_not(revise, agree) & (conf >= tau_rep)
        unsure = and_not(revise, replace)
        # progress guard (§1.3 step 6): at most max(0, drafted - 1) remasks per request, the
        # least likely own tokens first, so a verification-only step (no [MASK] left) never
        # remasks. A seed it holds back keeps its token for now and is checked again.
        remask = _least_likely(unsure, minus_own, draft.sum(-1) - 1)
        return keep, deferred | and_not(unsure, remask), replace, remask

    def absorb(self, batch: StepBatch, decision: Decision) -> None:
        """Advance every request's per-position memory (block positions) at once, on an
        [n, rows, W] copy laid over the view: one gather from the memory table, one scatter
        back. A deferred seed keeps its token but counts as never checked, so the block does
        not end before its check passes."""
        p = self.params
        host, state = batch.host, decision.state
        n, width = host.tokens.shape
        tokens, blk, draft = host.tokens.numpy(), host.in_block.numpy(), decision.commit.numpy()
        seeds = _Seeds.of(np.zeros((n, width), dtype=bool) if host.seeds is None
                          else host.seeds.numpy(), decision)
        drafted = draft.sum(-1)
        mems = [self._memory(st, b) for st, b in zip(batch.states, blk.sum(-1).tolist())]
        at_req, at_col = blk.nonzero()                   # block positions, request-major
        rows = np.array([mem.row for mem in mems])[at_req]
        cols = at_col - blk.argmax(-1)[at_req]           # their memory columns
        m = np.zeros((n, len(MEMORY_FIELDS), width))
        m[at_req, :, at_col] = self.memory_rows.gather(rows, cols)
        age, checks, conf, drift, attn_in, stale = (m[:, r] for r in range(len(MEMORY_FIELDS)))
        req, pos = seeds.req, seeds.pos
        revised = seeds.replace | seeds.remask
        fresh = draft.copy()                             # positions whose token changed
        fresh[req[revised], pos[revised]] = True
        visible = host.valid.numpy() & (tokens != batch.mask_id)
        visible[req, pos] = False                        # seeds were masked in this forward
        if "drift" in state:
            seen = visible & (age >= 1)                  # the cached key was a visible version
            drift[seen] = (p.drift_beta * drift[seen]
                           + (1 - p.drift_beta) * state["drift"].numpy()[seen])
        if "attn_in" in state:
            attn_in[:] = state["attn_in"].numpy()
        changed = fresh.sum(-1)                          # [n] positions changed this step
        # stale: something else changed since the last judgement; a kept seed was judged now
        stale[:] = np.where(fresh, changed[:, None] > 1,
                            np.maximum(stale, changed[:, None] > 0))
        kept = seeds.keep
        stale[req[kept], pos[kept]] = changed[req[kept]] > 0
        age += visible
        checks[req, pos] += 1
        held = kept | seeds.deferred
        conf[draft] = state["draft_conf"].numpy()[draft]
        conf[req[held], pos[held]] = seeds.own[held]
        conf[req[seeds.replace], pos[seeds.replace]] = seeds.conf[seeds.replace]
        checks[req[seeds.deferred], pos[seeds.deferred]] = 0.0
        for row in (age, checks, drift):
            row[fresh] = 0.0
        self.memory_rows.scatter(rows, cols, m[at_req, :, at_col])
        num_seeds = np.bincount(req, minlength=n)
        hit = np.bincount(req[revised], minlength=n) / np.maximum(num_seeds, 1)
        rho = np.array([st.extra.rho for st in batch.states])
        rho = np.where((num_seeds > 0) & (hit > p.hit_high),
                       np.minimum(rho * (1 + p.rho_eta), p.rho_max),
                       np.where((num_seeds > 0) & (hit < p.hit_low),
                                np.maximum(rho * (1 - p.rho_eta), p.rho_min), rho))
        # [MASK] left in each block once the decision is applied (remasks are block seeds)
        left = (host.candidates.numpy().sum(-1) - drafted
                + np.bincount(req[seeds.remask & blk[req, pos]], minlength=n))
        for st, r, d, done in zip(batch.states, rho.tolist(), drafted.tolist(),
                                  (left == 0).tolist()):
            st.extra.rho, st.extra.drafted = r, d
            st.extra.verify_steps += int(done)
