"""The flat token axis of one forward, laid out with a fixed number of host tensor ops (#43).

Every canvas window (cond, then uncond for cfg) item by item, then the scoring sequences, then
every item's extra query rows. Positions, the logit rows of each view and the statistics'
row masks are computed for all windows at once from one table of per-canvas integers
(window start and length, view start and length, flat offset): a `repeat_interleave` and an
`arange` over the batch instead of an `arange` per item. Sparse windows (`cache_refresh=
adaptive`), embedding edits and extra rows are still handled per item that has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cover_vllm.attention import SeqLayout
from cover_vllm.scheduler.output import EmbedEdit, SchedulerOutput, WorkItem
from cover_vllm.worker.scoring import ScoreLayout, lay_out_scores


@dataclass
class Layout:
    """The flat token axis of one forward: every canvas window, then every item's extra rows."""

    seqs: list[SeqLayout] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)         # pieces of the [T] input ids
    positions: list[torch.Tensor] = field(default_factory=list)   # pieces of the [T] positions
    rows: list[torch.Tensor] = field(default_factory=list)        # per canvas: flat view rows
    row_valid: list[torch.Tensor | None] = field(default_factory=list)   # per canvas [view_len]
                                       # bool: view rows in a sparse window (None: all of them)
    extra_rows: list[torch.Tensor | None] = field(default_factory=list)   # per item [E] or None
    edits: list[tuple[torch.Tensor, EmbedEdit]] = field(default_factory=list)  # (flat idx, edit)
    scores: ScoreLayout | None = None   # scoring sequences, after the generation windows
    window_positions: torch.Tensor | None = None   # [Tw] canvas position of every window token
    canvas: torch.Tensor | None = None  # [C, 5] per canvas: view start, view end, measured,
                                        # window length, flat offset
    seed_rows: list[int] = field(default_factory=list)   # flat tokens of contiguous windows'
                                                         # seeds (cond canvases)
    sparse_seeds: list[torch.Tensor] = field(default_factory=list)   # the same, sparse windows


def lay_out(out: SchedulerOutput, shift: int) -> Layout:
    """Lay `out` out on the flat token axis; `shift` is the model's logit shift (Dream: 1)."""
    lay = Layout()
    table, offset = [], 0                   # per canvas: (w0, n, view start, view len, ...)
    for item in out.items:
        n, w0 = item.window_len, item.window_start
        measured = int(item.want_stats or item.want_mass)
        for c, canvas in enumerate(item.canvases):
            cond = c == 0
            extra = (_extra_allowed(item, canvas.key_slots.numel())
                     if cond and item.extra is not None else None)
            lay.seqs.append(SeqLayout(w0, n, canvas.key_slots, item.override if cond else [],
                                      extra_allowed=extra, positions=item.window_positions,
                                      causal_block=item.causal_block,
                                      causal_commit=item.causal_commit))
            lay.ids.append(canvas.input_ids)
            table.append((w0, n, item.view_start, item.view_end - item.view_start, offset,
                          measured if cond else 0))
            if cond and item.override:
                if item.window_positions is None:
                    lay.seed_rows += [offset + s - w0 for s, _ in item.override]
                else:
                    seeds = torch.tensor([s for s, _ in item.override], dtype=torch.long)
                    lay.sparse_seeds.append(offset + torch.searchsorted(item.window_positions,
                                                                        seeds))
            if cond and item.embed_edit is not None:
                assert item.window_positions is None, "embed edits need a contiguous window"
                rel = item.embed_edit.positions - w0
                assert bool(((rel >= 0) & (rel < n)).all()), "embed edits outside the window"
                lay.edits.append((rel + offset, item.embed_edit))
            offset += n
    if out.items:
        _windows(lay, out.items, table, shift)
    if out.score_items:                        # likelihood scoring (worker/scoring.py)
        lay.scores, offset = lay_out_scores(out.score_items, lay.seqs, lay.ids,
                                            lay.positions, offset)
    for item in out.items:                     # extra rows follow every window (attention)
        if item.extra is None:
            lay.extra_rows.append(None)
            continue
        e = item.extra.num_rows
        lay.ids.append(item.extra.input_ids)
        lay.positions.append(item.extra.positions)
        lay.extra_rows.append(torch.arange(offset, offset + e))
        offset += e
    return lay


def _segments(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """[total] = starts[i] + 0..lengths[i]-1, segment after segment."""
    first = torch.cumsum(lengths, 0) - lengths                    # each segment's flat start
    return torch.repeat_interleave(starts - first, lengths, output_size=total) + \
        torch.arange(total)


def _windows(lay: Layout, items: list[WorkItem], table: list[tuple], shift: int) -> None:
    """Positions and view logit rows of every canvas, for the whole batch at once. `table`:
    per canvas (window start, window length, view start, view length, flat offset, measured)."""
    w0, n, view_start, view_len, offset, measured = torch.tensor(table, dtype=torch.long).t()
    sizes = [row[3] for row in table]
    num_tokens = sum(row[1] for row in table)
    pos = _segments(w0, n, num_tokens)                                   # [Tw]
    views = _segments(view_start, view_len, sum(sizes))                  # [V] view positions
    rows = (views - shift).clamp(min=0) + torch.repeat_interleave(offset - w0, view_len,
                                                                  output_size=len(views))
    lay.rows = list(rows.split(sizes))
    lay.row_valid = [None] * len(sizes)
    canvases = [(item, c) for item in items for c in range(len(item.canvases))]
    sparse = [i for i, (item, _) in enumerate(canvases) if item.window_positions is not None]
    if sparse:
        pieces = list(pos.split([row[1] for row in table]))
        for i in sparse:
            item, flat = canvases[i][0], table[i][4]
            pieces[i] = item.window_positions
            pred, lay.row_valid[i] = _sparse_rows(item, lay.rows[i] - flat + item.window_start)
            lay.rows[i] = pred + flat
        pos = torch.cat(pieces)
    lay.positions.append(pos)
    lay.window_positions = pos
    lay.canvas = torch.stack((view_start, view_start + view_len, measured, n, offset), 1)


def _sparse_rows(item: WorkItem, pred: torch.Tensor):
    """A sparse window's rows predicting its view (window-relative) and which view positions
    have one ([view_len] bool). `pred` = each view position's predictor position."""
    wp = item.window_positions
    idx = torch.searchsorted(wp, pred).clamp(max=wp.numel() - 1)
    valid = wp[idx] == pred
    return idx[valid], valid


def _extra_allowed(item: WorkItem, num_keys: int) -> torch.Tensor:
    """The extra rows' [E, K + E] allowed mask over the keys the window sees (a block-causal
    item's keys end at its block: the columns past it are dropped)."""
    allowed, e = item.extra.allowed, item.extra.num_rows
    if allowed.shape[1] == num_keys + e:
        return allowed
    return torch.cat((allowed[:, :num_keys], allowed[:, -e:]), dim=1)


def stat_rows(lay: Layout, ids: torch.Tensor, mask_id: int) -> torch.Tensor:
    """[Tw] bool over the window tokens: the still-masked view rows (not seeds) of the canvases
    whose item measures attention, whose attention defines downstream influence."""
    num = lay.window_positions.numel()
    view_start, view_end, measured, n, _ = lay.canvas.t()
    per = lambda t: torch.repeat_interleave(t, n, output_size=num)  # noqa: E731
    pos = lay.window_positions
    rows = (ids[:num] == mask_id) & (pos >= per(view_start)) & (pos < per(view_end)) \
        & per(measured.bool())
    if lay.seed_rows or lay.sparse_seeds:
        seeds = torch.cat([torch.tensor(lay.seed_rows, dtype=torch.long)] + lay.sparse_seeds)
        rows[seeds] = False
    return rows
