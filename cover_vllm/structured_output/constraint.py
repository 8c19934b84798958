"""GrammarState and the two hooks of the engine's strategy stage that enforce it.

Invariant (per request): the generated tokens are a prefix the grammar accepted, canvas
positions [prompt_len, frontier), followed by [MASK] up to the end of the generation slots.

* `mask_frontiers` (before `decide`): the frontier position's logits row keeps only the tokens
  the grammar allows there, so the strategy's proposal and confidence at the frontier are the
  constrained ones. The matcher fills its token bitmask on the host (V / 32 words); the mask is
  applied where the logits are (xgrammar's kernel on the CPU, bit arithmetic on any other
  device). The raw row is restored after `decide` (logprobs report the model's distribution).
* `constrain_decision` (after `decide`): the decision is applied to a copy of the view, then
  - a position of the accepted prefix that the decision revised (Replace / ReMask of a
    revocable check) rolls the grammar back to just before it;
  - from the frontier, tokens are accepted left to right while the grammar takes them. A
    revised token the grammar rejects keeps its old token when that still fits, else it is
    re-drawn from its own row under the grammar's mask; so is a remasked prefix position (the
    prefix has no holes), and the frontier itself when nothing else advanced (at least one
    token a step: no decoder can stall);
  - every token after the new frontier goes back to [MASK] (a commit the grammar could not
    check yet is dropped, not kept);
  - once the grammar accepts an end-of-sequence token, the rest of the block becomes that
    token and the request ends ("stop").
  Re-drawn tokens follow the request's temperature (argmax at 0, else a draw from the masked
  softmax with the request's generator), on the logits' device; each re-draw reads its one token
  back (the only device reads of a step outside its one decision copy, and only when a grammar
  refuses what the decoder chose). Rows a sparse window may leave out (non-masked,
  non-seed positions of `masked_rows_only` decoders) are never read: a rejected token there is
  masked, and a remask there undone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cover_vllm.step_plan import RowDecision
from cover_vllm.structured_output.completion import CompletionSearch

CLOSE_MARGIN = 16       # slots beyond twice the completion estimate that need no check


class GrammarState:
    """One request's grammar matcher and how far into the canvas it has accepted."""

    def __init__(self, compiled, prompt_len: int, stop_ids: list[int], vocab_size: int,
                 candidates: list[int]):
        import xgrammar as xgr

        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.frontier = prompt_len          # canvas positions < frontier are accepted
        self.prompt_len = prompt_len
        self.stop_ids = set(stop_ids)
        self.vocab_size = vocab_size
        self.seconds = 0.0                  # time spent in this request's constraint
        self.rollbacks = 0                  # times a revised token rolled the grammar back
        self.search = CompletionSearch(self.matcher, candidates, vocab_size)
        # the last completion length found: completability is checked once the slots left come
        # within twice it plus a margin (one token can open a structure that needs more), so
        # most tokens of a long canvas search nothing
        self.close_estimate = 0
        self._estimate(self.search.path_after(prompt_len - 1))

    def completion(self, position: int, slots: int) -> list[int]:
        """The completion kept for the state before canvas `position` (the matcher's now) when
        it fits in `slots` tokens, its end-of-sequence token included when one more fits."""
        tokens = (self.search.path_after(position - 1) or [])[:slots]
        if len(tokens) < slots:
            tokens = tokens + [min(self.stop_ids)]
        return tokens

    def accept(self, token: int, position: int, limit: int) -> bool | None:
        """Accept `token` at canvas `position` if the grammar takes it (None: it does not) and
        the value can then still be completed, with its end-of-sequence token, before `limit`
        (False: it cannot, but it can from here: write `completion`). The state is unchanged
        unless the result is True."""
        if not self.matcher.accept_token(token):
            return None
        if token in self.stop_ids:
            return True
        # one slot stays free for the end-of-sequence token, so a complete value ends "stop"
        slots = limit - position - 2
        if slots >= 2 * self.close_estimate + CLOSE_MARGIN:
            return True                          # far from the end: nothing to check yet
        after = self.search.path_after(position, token)
        if after is None or len(after) <= slots:
            self._estimate(after)
            return True                          # it fits, or the search gave up: keep it
        self.matcher.rollback(1)
        self.search.forget_from(position)
        before = self.search.path_after(position - 1)
        if before is None or len(before) > limit - position - 1:
            self.matcher.accept_token(token)     # no better way either: keep it
            return True
        return False

    def _estimate(self, path: list[int] | None) -> None:
        if path is not None:
            self.close_estimate = len(path)

    def restrict(self, row: torch.Tensor) -> None:
        """Set every token the grammar forbids at the frontier to -inf in `row` [V], in place
        (on `row`'s device)."""
        bitmask = self.search.bitmask                  # [1, ceil(V / 32)] int32, shared
        self.matcher.fill_next_token_bitmask(bitmask)
        apply_bitmask(row, bitmask, self.vocab_size)

    def draw(self, row: torch.Tensor, temperature: float,
             generator: torch.Generator | None) -> int:
        """The token for the frontier from logits `row` [V] under the grammar's mask."""
        row = row.detach().clone()
        self.restrict(row)
        if temperature <= 0:
            return int(row.argmax())
        probs = torch.softmax(row.double() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def rollback_to(self, position: int) -> None:
        """Un-accept the tokens from canvas `position` on (a check revised that token)."""
        if position < self.frontier:
            self.matcher.rollback(self.frontier - position)
            self.frontier = position
            self.rollbacks += 1
            self.search.forget_from(position)
            # the estimate came from a later state: take this one's (a shorter value needs
            # fewer slots, so a stale estimate would start the checks too late)
            self._estimate(self.search.path_after(position - 1))


def apply_bitmask(row: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """-inf in logits `row` [V] wherever the host bitmask [1, ceil(V / 32)] int32 has a 0 bit
    (bit j of word w: token 32 w + j), and on a padded LM head's columns past `vocab_size`."""
    if row.device.type == "cpu":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(row[None, :vocab_size], bitmask)
    else:                              # the words cross to the device; the row never leaves it
        row[:vocab_size].masked_fill_(~allowed_tokens(bitmask, vocab_size, row.device),
                                      float("-inf"))
    if row.shape[0] > vocab_size:
        row[vocab_size:] = float("-inf")


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab_size] bool on `device` from a host bitmask [1, ceil(V / 32)] int32 (bit j of
    word w: token 32 w + j), unpacked there."""
    words = bitmask[0].to(device)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    return ((words[:, None] >> bits) & 1).flatten()[:vocab_size].bool()


def mask_frontiers(rows: list[tuple[GrammarState, torch.Tensor, int]]) -> list:
    """Restrict each (state, view logits [W, V], frontier index in the view or -1) frontier row;
    returns what `restore` needs to put the raw rows back."""
    saved = []
    with torch.inference_mode():                  # the runner's logits are inference tensors
        for state, logits, index in rows:
            if index < 0:
                continue
            start = time.perf_counter()
            saved.append((logits, index, logits[index].clone()))
            state.restrict(logits[index])
            state.seconds += time.perf_counter() - start
    return saved


def restore(saved: list) -> None:
    with torch.inference_mode():
        for logits, index, row in saved:
            logits[index] = row


def constrain_decision(state: GrammarState, view: "ViewRow", d: RowDecision) -> RowDecision:
    """The decision `d` for one request made grammar-valid (see the module docstring)."""
    start = time.perf_counter()
    try:
        return _constrain(state, view, d)
    finally:
        state.seconds += time.perf_counter() - start


@dataclass
class ViewRow:
    """What `constrain_decision` reads of one request's view this step (view-relative)."""

    view_start: int
    tokens: torch.Tensor            # [W] canvas tokens before the decision
    logits: torch.Tensor            # [W, V] this forward's rows (raw)
    drawable: torch.Tensor          # [W] bool: rows that may be drawn from (all rows, or for
                                    # `masked_rows_only` decoders the masked inputs only)
    limit: int                      # canvas end of what the grammar governs (gen slots)
    mask_id: int
    temperature: float
    generator: torch.Generator | None


def _apply(d: RowDecision, old: torch.Tensor, mask_id: int) -> torch.Tensor:
    new = old.clone()
    if d.remask is not None:
        new[d.remask] = mask_id
    if d.replace is not None:
        new[d.replace] = d.tokens[d.replace]
    new[d.commit] = d.tokens[d.commit]
    return new


def _constrain(state: GrammarState, view: ViewRow, d: RowDecision) -> RowDecision:
    old, vs, mask = view.tokens, view.view_start, view.mask_id
    new = _apply(d, old, mask)
    end = min(view.limit, vs + old.shape[0])
    frontier = state.frontier
    changed = (new != old).nonzero().flatten() + vs
    changed = changed[changed < frontier]
    if changed.numel():
        state.rollback_to(int(changed[0]))
    # the request ends when the value is complete (a decoder's own stop, e.g. LLaDA2's
    # eos_early_stop, looked at tokens the grammar may have refused)
    p, stop = max(state.frontier, vs), False
    while p < end:
        i = p - vs
        token, before = int(new[i]), int(old[i])
        if token == mask:
            # a hole in the prefix (a check remasked it), or the frontier when nothing else
            # advanced it this step; without a row to draw from, the remask is undone
            if p > frontier or not (view.drawable[i] or before != mask):
                break
            token = (state.draw(view.logits[i], view.temperature, view.generator)
                     if view.drawable[i] else before)
        accepted = state.accept(token, p, view.limit)
        if accepted is None and before not in (token, mask):
            token = before                       # veto the revision if the old token fits
            accepted = state.accept(token, p, view.limit)
        if accepted is None and view.drawable[i]:
            token = state.draw(view.logits[i], view.temperature, view.generator)
            accepted = state.accept(token, p, view.limit)
        if accepted is None:
            break
        if accepted is False:
            p = _close(state, new, p, vs, end, view.limit)   # write a completion that fits
            stop = p > i + vs and int(new[p - 1 - vs]) in state.stop_ids
            break
        new[i] = token
        p += 1
        if token in state.stop_ids:                  # the value is complete
            stop = True
            break
    state.frontier = p
    # after a complete value: its end-of-sequence token to the end; else unchecked commits go
    # back to [MASK]
    new[p - vs: end - vs] = new[p - 1 - vs] if stop else mask
    return _as_decision(d, old, new, mask, stop)


def _close(state: GrammarState, new: torch.Tensor, p: int, vs: int, end: int,
           limit: int) -> int:
    """Write the grammar's completion from canvas position `p` (and an end-of-sequence token
    when it fits); returns the position after the last token accepted."""
    tokens = state.completion(p, limit - p)
    for token in tokens:
        if p >= end:
            break
        state.matcher.accept_token(token)
        new[p - vs] = token
        p += 1
    return p


def _as_decision(d: RowDecision, old: torch.Tensor, new: torch.Tensor, mask: int,
                 stop: bool) -> RowDecision:
    was_masked, is_masked = old == mask, new == mask
    commit = was_masked & ~is_masked
    replace = ~was_masked & ~is_masked & (new != old)
    remask = ~was_masked & is_masked
    return RowDecision(commit=commit, tokens=new, remask=remask if remask.any() else None,
                       replace=replace if replace.any() else None, keeps=d.keeps,
                       verified=d.verified, stop=stop)
