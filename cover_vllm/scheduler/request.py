"""Request: one generation's canvas, its block cursor, strategy state, pages and counters.

Canvas = prompt tokens, then `max_tokens` generation slots that start as [MASK], split into
semi-autoregressive blocks. A slot is MASKED, DRAFTED (visible, revocable) or FINAL (its block is
done); positions before `final_end` are FINAL and the only ones ever streamed or stopped on.

Every write to a request's state is a method here or in the scheduler (pages, status): after a
forward `finish_step` applies the decision, asks the strategy whether the block is complete and
moves to the next block or ends the request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable

import torch

from cover_vllm.cache_refresh import CacheRefresh, RefreshState
from cover_vllm.outputs import RequestMetrics
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.scheduler.canvas_table import RowWrites
from cover_vllm.scheduler.output import WorkItem
from cover_vllm.step_plan import RowDecision, TokenLogprobs
from cover_vllm.strategies.base import BlockState, Strategy
from cover_vllm.structured_output.constraint import GrammarState

# stop_rule(request) -> (finish reason or None, output token ids, output text, stop reason: the
# stop string or stop token id that matched, else None): the stop check on a request's FINAL
# tokens (engine/output_processor.py owns the tokenizer it needs)
StopRule = Callable[["Request"], tuple[str | None, list[int], str, int | str | None]]
# what a request keeps per canvas position with SamplingParams.logprobs: (ids [1 + k], their
# logprobs [1 + k], the written token's rank), the written token first (a TokenLogprobs row)
KeptLogprobs = tuple[list[int], list[float], int]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class PageSet:
    """Pages of one canvas copy and the cache slot of each canvas position."""

    pages: list[int]
    key_slots: torch.Tensor     # [L] long


def abort_from(request_id: str, waiting, running: list, finish: Callable) -> object | None:
    """Drop request `request_id` from a queue: a waiting one is marked aborted, a running one
    ended by `finish(req, "abort")` (which frees what it holds). Returns it, or None."""
    for req in list(waiting):
        if req.request_id == request_id:
            waiting.remove(req)
            req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
            return req
    for req in running:
        if req.request_id == request_id:
            finish(req, "abort")
            return req
    return None


def split_steps(total: int, num_blocks: int) -> list[int]:
    """Steps per block: total // num_blocks each, the first (total % num_blocks) one more."""
    base, rem = divmod(total, num_blocks)
    return [base + (1 if i < rem else 0) for i in range(num_blocks)]


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, strategy: Strategy, generator: torch.Generator,
                 kv_cache: str, cache_refresh: CacheRefresh | None = None):
        spec = strategy.spec
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids = list(prompt_token_ids)
        self.strategy, self.generator, self.kv_cache = strategy, generator, kv_cache
        self.prompt_len = len(prompt_token_ids)
        self.mask_id = spec.mask_token_id
        self.causal_block = self._causal_block(params, strategy)
        self.causal_commit = (self.causal_block is not None
                              and strategy.spec.attention.causal_commit)
        canvas_len = self.prompt_len + params.max_tokens
        if self.causal_block is None:
            block = params.block_length or strategy.default_block_length(params.max_tokens)
            starts = range(self.prompt_len, canvas_len, block)
            self.blocks = [(s, min(s + block, canvas_len)) for s in starts]
        else:                  # blocks aligned to position 0; the prompt's tail block first
            block = self.causal_block
            canvas_len = -(-canvas_len // block) * block
            self.blocks = [(max(k * block, self.prompt_len), (k + 1) * block)
                           for k in range(self.prompt_len // block, canvas_len // block)]
        self.canvas = torch.tensor(
            self.prompt_token_ids + [self.mask_id] * (canvas_len - self.prompt_len),
            dtype=torch.long)
        self.block_length = block
        total = params.steps or strategy.default_steps(params.max_tokens)
        self.block_steps = split_steps(max(total, len(self.blocks)), len(self.blocks))
        # block-causal: canvas positions below `cached_end` hold K/V computed from their final
        # tokens (exact for every later step, never recomputed); 0 until the first forward
        self.cached_end = 0
        self.prefix_keys: list[bytes] = []     # content keys of its shareable prompt pages
        self.prefix_indexed = 0                # of which indexed in the pool (or hits)
        self.block_idx = 0
        self.state = self._block_state(self.block_steps[0])
        self.final_end = self.prompt_len       # canvas positions < final_end are FINAL
        self.pages: list[PageSet] = []         # [cond] or [cond, uncond] for cfg
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics()
        self.remasked_from: dict[int, int] = {}   # position -> token before its last remask
        self.arrival = time.perf_counter()
        self.refresh = RefreshState(cache_refresh or CacheRefresh())
        # [L] the token each position's cached K/V were computed from (-1: never computed)
        self.kv_tokens = torch.full_like(self.canvas, -1)
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: int | str | None = None
        # SamplingParams.logprobs: the last write's entry per canvas position, and the output's
        # per-token dicts built so far (FINAL tokens only; engine/logprobs.py)
        self.token_logprobs: dict[int, KeptLogprobs] = {}
        self.output_logprobs: list = []
        self.grammar: GrammarState | None = None   # structured outputs: set by the engine
        self.slot: int | None = None           # row of the canvas table while running

    # ---- geometry --------------------------------------------------------------------------
    @staticmethod
    def _causal_block(params: SamplingParams, strategy: Strategy) -> int | None:
        """The block size of a block-causal model's attention for this request (the request's
        block_length, else the model's own), None for full attention."""
        kind = strategy.spec.attention
        if not kind.is_block_causal:
            return None
        return params.block_length or kind.block_size

    def _block_state(self, block_steps: int) -> BlockState:
        return BlockState(block_steps=block_steps, block_size=self.block_length,
                          max_tokens=self.params.max_tokens, steps=self.params.steps)

    @property
    def gen_end(self) -> int:
        """End of the generation slots the user asked for (a block-causal canvas runs on to its
        last block's end; those extra slots are decoded but never returned)."""
        return self.prompt_len + self.params.max_tokens

    @property
    def block_window_start(self) -> int:
        """Block-causal: the first position the next forward must run, the start of the first
        block whose K/V are not final (it covers the prefill of the prompt's full blocks and the
        commit of a block just finished; ALGORITHMS/architecture "per-block KV reuse")."""
        start = self.blocks[self.block_idx][0]
        block_start = start // self.causal_block * self.causal_block
        return min(self.cached_end, block_start)

    @property
    def num_canvases(self) -> int:
        return 2 if self.strategy.cfg_scale > 0 else 1

    @property
    def canvas_len(self) -> int:
        return int(self.canvas.numel())

    @property
    def block(self) -> tuple[int, int]:
        return self.blocks[self.block_idx]

    @property
    def in_last_block(self) -> bool:
        return self.block_idx + 1 == len(self.blocks)

    def uncond_canvas(self) -> torch.Tensor:
        """The classifier-free-guidance copy: every prompt position replaced by [MASK]."""
        out = self.canvas.clone()
        out[: self.prompt_len] = self.mask_id
        return out

    @property
    def needs_refresh(self) -> bool:
        """A refresh is owed unconditionally (block start, first step)."""
        return self.refresh.pending

    @needs_refresh.setter
    def needs_refresh(self, value: bool) -> None:
        self.refresh.pending = value

    def block_masked(self) -> int:
        start, end = self.block
        return int((self.canvas[start:end] == self.mask_id).sum())

    # ---- state changes ---------------------------------------------------------------------
    def begin_block(self, masked: int | None = None) -> None:
        """Start the current block; `masked` = its [MASK] count when the caller counted it."""
        memory = self.state.memory                                # per-request, across blocks
        self.state = self._block_state(self.block_steps[self.block_idx])
        self.state.memory = memory
        self.strategy.start_block(self.state, self.block_masked() if masked is None else masked)
        self.needs_refresh = True

    def apply(self, view_start: int, commit: torch.Tensor, tokens: torch.Tensor,
              remask: torch.Tensor | None, replace: torch.Tensor | None,
              written: RowWrites | None = None) -> tuple[int, int]:
        """Apply one decision row (view-relative [W] tensors) to the canvas and the counters.
        `written`: what the engine already wrote into the canvas table for the whole batch
        (scheduler/canvas_table.py); else the row is written here. Returns (positions whose
        token changed, of which revised by a check: replace/remask)."""
        m = self.metrics
        if written is None:
            written = self._write(view_start, commit, tokens, remask, replace)
        for pos, before in written.remasked:
            self.remasked_from[pos] = before
            self.token_logprobs.pop(pos, None)
        revised = len(written.remasked) + written.replaces
        m.remasks += len(written.remasked)
        m.replaces += written.replaces
        if self.remasked_from and written.commits:     # a remasked position drafted again
            idx = commit.nonzero().flatten()
            for pos, token in zip((view_start + idx).tolist(), tokens[idx].tolist()):
                m.flip_flops += self.remasked_from.pop(pos, None) == token
        self.state.step += 1
        m.steps += 1
        return revised + written.commits, revised

    def _write(self, view_start: int, commit: torch.Tensor, tokens: torch.Tensor,
               remask: torch.Tensor | None, replace: torch.Tensor | None) -> RowWrites:
        """Write one row's remasks, replacements and commits into the canvas."""
        remasked, replaces = [], 0
        if remask is not None and bool(remask.any()):
            pos = view_start + remask.nonzero().flatten()
            remasked = list(zip(pos.tolist(), self.canvas[pos].tolist()))
            self.canvas[pos] = self.mask_id
        if replace is not None and bool(replace.any()):
            idx = replace.nonzero().flatten()
            self.canvas[view_start + idx] = tokens[idx]
            replaces = int(idx.numel())
        idx = commit.nonzero().flatten()
        self.canvas[view_start + idx] = tokens[idx]
        return RowWrites(int(idx.numel()), replaces, remasked)

    def note_written(self, item: WorkItem) -> None:
        """Record which token each written position's cached K/V now hold (override positions
        keep their old K/V); block-causal: every block before the current one is final now."""
        if self.causal_block is not None:
            block_start = self.block[0] // self.causal_block * self.causal_block
            if item.window_start <= self.cached_end:
                self.cached_end = max(self.cached_end, block_start)
        if not self.tracks_kv_tokens:
            return
        pos, ids = item.positions(), item.canvases[0].input_ids
        if item.override:
            keep = ~torch.isin(pos, torch.tensor([s for s, _ in item.override]))
            pos, ids = pos[keep], ids[keep]
        self.kv_tokens[pos] = ids

    @property
    def tracks_kv_tokens(self) -> bool:
        """Whether `kv_tokens` is kept: only sparse windows read it (dual cache, adaptive)."""
        return self.kv_cache == "dual" and self.refresh.policy.sparse

    def charge(self, forward_tokens: int, flops: float, cached_mass=None,
               column_mass=None) -> None:
        """Count one forward's rows and FLOPs against this request; hand the attention mass it
        measured on cached positions ([L] per column) to the refresh policy."""
        self.metrics.forward_tokens += forward_tokens
        self.metrics.flops += flops
        if cached_mass is not None:
            self.refresh.cached_mass, self.refresh.column_mass = cached_mass, column_mass

    def finish_step(self, item: WorkItem, decision: RowDecision,
                    stop_rule: StopRule) -> str | None:
        """After the forward of `item`: apply the decision, then, if the strategy says the block
        is complete, make it FINAL and check for a stop. Returns None (nothing to report),
        "block" (a block became FINAL; the request goes on) or the finish reason."""
        self.apply_step(item, decision)
        return self.end_step(decision, stop_rule, self.block_masked())

    def apply_step(self, item: WorkItem, decision: RowDecision,
                   written: RowWrites | None = None) -> None:
        """`finish_step`'s first half: the decision written to the canvas and the counters
        (`written`: see `apply`)."""
        self.note_written(item)
        changed, revised = self.apply(item.view_start, decision.commit, decision.tokens,
                                      decision.remask, decision.replace, written)
        if decision.logprobs is not None:
            self.keep_logprobs(item.view_start, decision.logprobs)
        self.refresh.record(item.is_refresh, changed, revised)
        m = self.metrics
        m.nfe += 1
        m.keeps += decision.keeps
        m.seeds_verified += decision.verified
        m.refreshes += int(item.is_refresh)

    def end_step(self, decision: RowDecision, stop_rule: StopRule, masked: int) -> str | None:
        """`finish_step`'s second half, given the [MASK]s left in the block (`masked`, counted
        for the whole batch at once by `block_masked_counts`)."""
        if decision.stop:                    # the strategy ends the request now (mid-block)
            self.final_end = self.block[1]
            reason = self._check_stop(stop_rule)
            return reason or "stop"
        if not self.strategy.block_done(self.state, masked):
            return None
        return self._complete_block(stop_rule)

    def _complete_block(self, stop_rule: StopRule) -> str | None:
        revises = self.strategy.revises_done_blocks and self.causal_block is None
        if revises and not self.in_last_block:
            self._next_block()                   # nothing is FINAL before the request ends
            return None
        self.final_end = self.block[1]
        reason = self._check_stop(stop_rule)
        if reason is None and self.in_last_block:
            reason = "length"
        if reason is None:
            self._next_block()
            return "block"
        return reason

    def _check_stop(self, stop_rule: StopRule) -> str | None:
        reason, self.output_token_ids, self.output_text, self.stop_reason = stop_rule(self)
        return reason

    def keep_logprobs(self, view_start: int, logprobs: TokenLogprobs) -> None:
        """Keep a decision's log-probabilities per canvas position (a later write replaces)."""
        for i, ids, values, rank in zip(logprobs.positions.tolist(), logprobs.token_ids.tolist(),
                                        logprobs.logprobs.tolist(), logprobs.ranks.tolist()):
            self.token_logprobs[view_start + i] = (ids, values, rank)

    def _next_block(self) -> None:
        self.block_idx += 1
        self.begin_block()

    def stamp_metrics(self) -> RequestMetrics:
        """The metrics as of now (latency so far, decoded tokens, tokens per step)."""
        m = self.metrics
        m.latency_s = time.perf_counter() - self.arrival
        m.decoded_tokens = min(self.final_end, self.gen_end) - self.prompt_len
        m.tokens_per_step = m.decoded_tokens / m.steps if m.steps else 0.0
        if self.grammar is not None:
            m.constraint_s = self.grammar.seconds
        return m

    def generated(self) -> torch.Tensor:
        """[G] the generation slots as they stand."""
        return self.canvas[self.prompt_len:]


def block_masked_counts(reqs: list[Request]) -> list[int]:
    """Each request's `block_masked()`, with a fixed number of tensor ops for the batch: one
    prefix sum over the canvases laid end to end, read at every block's two ends."""
    if not reqs:
        return []
    ends, acc = [], 0
    for req in reqs:
        start, end = req.block
        ends += [acc + start, acc + end]
        acc += req.canvas_len
    masked = torch.cat([req.canvas for req in reqs]) == reqs[0].mask_id
    csum = torch.nn.functional.pad(torch.cumsum(masked, 0), (1, 0))
    edges = csum[torch.tensor(ends, dtype=torch.long)].view(-1, 2)
    return (edges[:, 1] - edges[:, 0]).tolist()
