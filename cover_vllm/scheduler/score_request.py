"""ScoringRequest: one likelihood request's copies, greedy canvas, pages and running totals.

A scoring request is forward-only work: each step it runs up to `num_slots` of its masked copies
(each a sequence over its own KV pages, reused by the next copies), plus one step of the greedy
check, and adds what the runner returns to its per-token totals. It makes no decision and has no
decoder. Its masks are drawn once, at creation, from its own generator (scoring/estimator.py).

Geometry: seq = context (P) + continuation (T), L = P + T, positions 0..L-1. On a block-causal
model (blocks of B aligned to position 0) the context's full blocks [0, C0), C0 = floor(P / B) * B,
are clean in every copy, so their K/V are computed once (a SharedPrefix, possibly shared with
other requests through the prefix cache) and every copy runs only positions [C0, L).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cover_vllm.scoring.estimator import draw_masks
from cover_vllm.scoring.items import (CrossEntropyTargets, GreedyTargets, ScoreItem,
                                      ScoreResult, ScoreSeq)
from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams, ScoreMetrics
from cover_vllm.scoring.prompts import check_pair, score_pair


@dataclass(frozen=True)
class ScoreGeometry:
    """What a scoring request needs to know about the model."""

    mask_id: int
    logit_shift: int             # Dream: position p is predicted by row p - 1 (row 0 for p = 0)
    causal_block: int | None     # block-causal attention's block size (None: full attention)


@dataclass
class SharedPrefix:
    """The K/V of a context's clean full blocks [0, end) for one canvas variant (cond: the
    context; uncond: all [MASK]), computed once and read by every copy that holds it."""

    key: tuple
    pages: list[int]
    slots: torch.Tensor          # [end] cache slot of positions 0..end-1
    written_end: int             # positions < written_end hold final K/V
    end: int
    page_keys: list[bytes]       # prefix-cache keys of its whole pages (empty: not indexed)
    refs: int = 1
    writer: str | None = None    # the request whose item writes it in the current step

    @property
    def ready(self) -> bool:
        return self.written_end >= self.end


class ScoringRequest:
    def __init__(self, request_id: str, context: list[int], continuation: list[int],
                 params: LoglikelihoodParams, generator: torch.Generator, geo: ScoreGeometry):
        self.request_id, self.params, self.geo = request_id, params, geo
        self.context, self.continuation = list(context), list(continuation)
        self.P, self.T = len(context), len(continuation)
        self.L = self.P + self.T
        self.seq = torch.tensor(self.context + self.continuation, dtype=torch.long)
        self.draws = draw_masks(self.T, params.mc_num, params.batch_size, generator)
        self.num_canvases = 2 if params.cfg_scale > 0 and self.P > 0 else 1
        b = geo.causal_block
        self.shared_end = 0 if b is None else max(self.P - geo.logit_shift, 0) // b * b
        self.prefixes: list[SharedPrefix] = []       # per canvas variant (block-causal, C0 > 0)
        self.slots: list[list[torch.Tensor]] = []    # per copy slot, per variant: [L - C0] slots
        self.pages: list[int] = []                   # pages of the copy slots
        self.greedy_slots: list[torch.Tensor] | None = None
        self.greedy_pages: list[int] = []
        self.next_copy = 0
        self.copies_done = 0
        self.token_loss = torch.zeros(self.T, dtype=torch.float64)
        self.greedy_canvas: torch.Tensor | None = None   # [T] continuation as decided so far
        self.is_greedy: bool | None = None if params.check_greedy else False
        self.top: tuple[list[int], list[float]] | None = None
        self.metrics = ScoreMetrics()
        self.arrival = time.perf_counter()
        if params.check_greedy:
            self.greedy_canvas = torch.full((self.T,), geo.mask_id, dtype=torch.long)

    # ---- geometry --------------------------------------------------------------------------
    @property
    def run_len(self) -> int:
        """Positions each copy runs: [C0, L)."""
        return self.L - self.shared_end

    def variant_tokens(self, variant: int) -> torch.Tensor:
        """[L] the clean sequence of canvas variant 0 (cond) or 1 (uncond: context masked)."""
        if variant == 0:
            return self.seq
        out = self.seq.clone()
        out[:self.P] = self.geo.mask_id
        return out

    @property
    def copies_left(self) -> int:
        return self.draws.num_copies - self.next_copy

    @property
    def samples_done(self) -> bool:
        return self.copies_done == self.draws.num_copies

    @property
    def finished(self) -> bool:
        return self.samples_done and self.is_greedy is not None

    # ---- one step --------------------------------------------------------------------------
    def next_item(self) -> tuple[ScoreItem, list[int]]:
        """This step's work item, and the copies it runs."""
        seqs: list[ScoreSeq] = []
        for variant, prefix in enumerate(self.prefixes):   # the first request to run a
            if not prefix.ready and prefix.writer in (None, self.request_id):   # prefix writes it
                prefix.writer = self.request_id
                start = prefix.written_end
                tokens = self.variant_tokens(variant)[start:prefix.end]
                seqs.append(ScoreSeq(start, tokens, prefix.slots))
        copies = list(range(self.next_copy, min(self.next_copy + len(self.slots),
                                                self.draws.num_copies)))
        ce = self._copies(copies, seqs)
        greedy = self._greedy(seqs) if self.is_greedy is None else None
        item = ScoreItem(self.request_id, seqs, self.geo.causal_block, self.T, ce, greedy,
                         self.params.cfg_scale if self.num_canvases == 2 else 0.0,
                         top_logprobs=self.params.logprobs or 0)
        self.next_copy += len(copies)
        return item, copies

    def _key_slots(self, own: list[torch.Tensor], variant: int) -> torch.Tensor:
        if not self.prefixes:
            return own[variant]
        return torch.cat((self.prefixes[variant].slots, own[variant]))

    def _predictor_rows(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions - self.geo.logit_shift).clamp(min=0) - self.shared_end

    def _copies(self, copies: list[int], seqs: list[ScoreSeq]) -> CrossEntropyTargets | None:
        """Each copy's sequences (cond, then uncond) and its masked positions' targets."""
        if not copies:
            return None
        parts = {k: [] for k in ("seq", "row", "target", "ratio", "token_index", "uncond")}
        mask_id, c0 = self.geo.mask_id, self.shared_end
        for slot, r in enumerate(copies):
            masked = self.draws.masks[r].nonzero().flatten()          # [m] continuation indices
            first = len(seqs)
            for v in range(self.num_canvases):
                tokens = self.variant_tokens(v).clone()
                tokens[self.P + masked] = mask_id
                seqs.append(ScoreSeq(c0, tokens[c0:], self._key_slots(self.slots[slot], v)))
            m = int(masked.numel())
            parts["seq"].append(torch.full((m,), first))
            parts["uncond"].append(torch.full((m,), first + 1))
            parts["row"].append(self._predictor_rows(self.P + masked))
            parts["target"].append(self.seq[self.P + masked])
            parts["ratio"].append(self.draws.ratios[r].expand(m))
            parts["token_index"].append(masked)
        cat = {k: torch.cat(v) for k, v in parts.items()}
        return CrossEntropyTargets(cat["seq"], cat["row"], cat["target"], cat["ratio"],
                                   cat["token_index"],
                                   cat["uncond"] if self.num_canvases == 2 else None)

    def _greedy(self, seqs: list[ScoreSeq]) -> GreedyTargets:
        """One step of the official greedy check: the canvas with the undecided positions masked."""
        first = len(seqs)
        for v in range(self.num_canvases):
            tokens = self.variant_tokens(v).clone()
            tokens[self.P:] = self.greedy_canvas
            seqs.append(ScoreSeq(self.shared_end, tokens[self.shared_end:],
                                 self._key_slots(self.greedy_slots, v)))
        masked = (self.greedy_canvas == self.geo.mask_id).nonzero().flatten()
        return GreedyTargets(first, self._predictor_rows(self.P + masked),
                             first + 1 if self.num_canvases == 2 else None)

    def absorb(self, item: ScoreItem, copies: list[int], result: ScoreResult) -> None:
        """Add one forward's results: the copies' cross-entropy totals and the greedy step."""
        self.token_loss += result.token_loss
        self.copies_done += len(copies)
        m = self.metrics
        m.nfe += 1
        m.sample_rows += len(copies)
        m.forward_tokens += item.num_query_tokens
        if result.top is not None and self.top is None:
            self.top = result.top
        if item.greedy is not None:
            m.greedy_forwards += 1
            masked = (self.greedy_canvas == self.geo.mask_id).nonzero().flatten()
            row, token = result.greedy
            j = int(masked[row])
            self.greedy_canvas[j] = token
            if token != self.continuation[j]:
                self.is_greedy = False          # committed tokens never change: decided now
            elif masked.numel() == 1:
                self.is_greedy = True

    def output(self) -> LoglikelihoodOutput:
        mc = self.draws.num_copies
        shares = (-self.token_loss / mc).tolist()
        self.metrics.latency_s = time.perf_counter() - self.arrival
        top = None
        if self.top is not None:
            top = [dict(zip(*self.top))]
        return LoglikelihoodOutput(self.request_id, float(-self.token_loss.sum() / mc),
                                   bool(self.is_greedy), self.context, self.continuation, shares,
                                   top, self.metrics)


def scoring_request(spec, tokenizer, request_id: str, prompt,
                    params: LoglikelihoodParams, seed: int) -> ScoringRequest:
    """A ScoringRequest for model `spec` (a ModelSpec) from a prompt as `LLM.loglikelihood`
    takes it; ValueError / TypeError naming the field for bad input."""
    context, continuation = score_pair(prompt, tokenizer)
    check_pair(context, continuation, spec.vocab_size, spec.max_model_len)
    if params.logprobs is not None and len(continuation) != 1:
        raise ValueError(f"LoglikelihoodParams.logprobs needs a one-token continuation "
                         f"(got {len(continuation)} tokens)")
    kind = spec.attention
    geo = ScoreGeometry(spec.mask_token_id, spec.logit_shift,
                        kind.block_size if kind.is_block_causal else None)
    return ScoringRequest(request_id, context, continuation, params,
                          torch.Generator().manual_seed(seed), geo)
