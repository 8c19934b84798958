"""CanvasTable: the persistent batch's canvases, one row per running request (issue #43).

Every running request's canvas is a row of one preallocated [max_num_seqs, width] token tensor,
indexed by the request's slot. The scheduler writes a slot when it admits a request (its
prompt and [MASK]s) and frees it when the request finishes or is aborted (the request keeps a
private copy, which its outputs read); `Request.canvas` is a view of its row, so every
per-request read and write goes to the table, and whole-batch code reads and writes many rows
with one tensor op (`DecisionWrites`: every request's remasks, commits and replacements of a
step).
The width grows, by doubling, when a longer canvas is admitted; the views are re-pointed then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.step_plan import RowDecision


class CanvasTable:
    def __init__(self, max_rows: int):
        self.tokens = torch.zeros(max_rows, 0, dtype=torch.long)   # [max_rows, width]
        self._free = list(range(max_rows - 1, -1, -1))              # pop() -> lowest slot
        self._owners: dict[int, object] = {}                        # slot -> Request

    def attach(self, reqs: list) -> None:
        """Give each of `reqs` a slot: their canvases are copied in (one write for all) and
        each becomes a view of its row."""
        if not reqs:
            return
        longest = max(req.canvas_len for req in reqs)
        if longest > self.tokens.shape[1]:
            self._grow(max(longest, 2 * self.tokens.shape[1]))
        width, cols = self.tokens.shape[1], []
        for req in reqs:
            req.slot = self._free.pop()
            cols.append(req.slot * width)
        starts = torch.tensor(cols, dtype=torch.long)
        lengths = torch.tensor([req.canvas_len for req in reqs], dtype=torch.long)
        total = sum(req.canvas_len for req in reqs)
        first = torch.cumsum(lengths, 0) - lengths
        flat = torch.repeat_interleave(starts - first, lengths, output_size=total) + \
            torch.arange(total)
        self.tokens.view(-1).index_copy_(0, flat, torch.cat([req.canvas for req in reqs]))
        for req in reqs:
            req.canvas = self._row(req)
            self._owners[req.slot] = req

    def _row(self, req) -> torch.Tensor:
        """[L] view of `req`'s row (one op)."""
        return self.tokens.as_strided((req.canvas_len,), (1,),
                                      req.slot * self.tokens.shape[1])

    def detach(self, req) -> None:
        """Free `req`'s slot; it keeps a private copy of its canvas."""
        slot = getattr(req, "slot", None)
        if slot is None or self._owners.get(slot) is not req:
            return
        req.canvas, req.slot = req.canvas.clone(), None
        del self._owners[slot]
        self._free.append(slot)
        self._free.sort(reverse=True)

    def _grow(self, width: int) -> None:
        grown = torch.zeros(self.tokens.shape[0], width, dtype=torch.long)
        grown[:, :self.tokens.shape[1]] = self.tokens
        self.tokens = grown
        for req in self._owners.values():
            req.canvas = self._row(req)


@dataclass
class RowWrites:
    """What one step wrote into one request's canvas (a DecisionWrites row, or the request's
    own write): its counts, and each remasked position with the token it held before."""

    commits: int
    replaces: int
    remasked: list[tuple[int, int]]       # (canvas position, its token before the remask)


class DecisionWrites:
    """Every request's remasks, commits and replacements of one step, as one write into the
    table (a fixed number of tensor ops: the rows of all requests laid end to end). Build it
    (it reads the tokens the remasks replace), let each request apply its counters with
    `per_request[i]` (Request.apply_step), then `write()`. A strategy commits [MASK] positions
    and remasks or replaces visible ones, so the three never overlap and one write applies them
    in any order."""

    def __init__(self, table: CanvasTable, reqs: list, view_starts: list[int],
                 decisions: list[RowDecision]):
        widths = [int(d.commit.numel()) for d in decisions]
        total = sum(widths)
        ints = torch.tensor([(req.slot, start, width) for req, start, width
                             in zip(reqs, view_starts, widths)], dtype=torch.long)
        slot, start, width = ints.t()
        first = torch.cumsum(width, 0) - width
        pos = torch.repeat_interleave(start - first, width, output_size=total) + \
            torch.arange(total)                                          # [sum W] canvas pos
        commit = torch.cat([d.commit for d in decisions])                 # [sum W] bool
        replace, remask = (_flags(decisions, name, commit) for name in ("replace", "remask"))
        where = (commit | replace | remask).nonzero().flatten()
        self.table, self.pos = table, pos.index_select(0, where)
        self.rows = torch.repeat_interleave(slot, width, output_size=total).index_select(0, where)
        self.tokens = torch.cat([d.tokens for d in decisions]).index_select(0, where)
        flags = torch.stack((commit, replace, remask)).long()
        sums = torch.nn.functional.pad(torch.cumsum(flags, 1), (1, 0))[:, first.tolist() + [total]]
        counts = (sums[:, 1:] - sums[:, :-1]).t().tolist()   # (commits, replaces, remasks) each
        remasked = [[] for _ in reqs]
        if any(c[2] for c in counts):
            hit = remask.index_select(0, where)
            at_rows, at_pos = self.rows[hit], self.pos[hit]
            before = table.tokens[at_rows, at_pos].tolist()
            self.tokens = self.tokens.masked_fill(hit, reqs[0].mask_id)
            flat = iter(zip(at_pos.tolist(), before))
            remasked = [[next(flat) for _ in range(c[2])] for c in counts]
        self.per_request = [RowWrites(c[0], c[1], r) for c, r in zip(counts, remasked)]

    def write(self) -> None:
        self.table.tokens.index_put_((self.rows, self.pos), self.tokens)


def _flags(decisions: list[RowDecision], name: str, like: torch.Tensor) -> torch.Tensor:
    """[sum W] bool: the decisions' `name` mask laid end to end (False where one has none)."""
    if all(getattr(d, name) is None for d in decisions):
        return torch.zeros_like(like)
    return torch.cat([torch.zeros_like(d.commit) if getattr(d, name) is None
                      else getattr(d, name) for d in decisions])
