"""The LM head on the rows a step's decisions read (CPU): a `masked_rows_only` decoder reads only
its view's [MASK] rows and seeds (their inputs are [MASK] too), so the other view rows of its
canvas (committed tokens, the prompt) are left out of the LM head and come back as zero rows,
the rows a sparse window already leaves zero (model_runner.py `_full_views`).

Exact: every computed row is the same row of the same GEMM. On this CPU an fp32 GEMM's rows
depend on the number of rows M only below 12 (oneDNN's small-M kernels: M in 1-3, 5-7, 9-11
give other roundings than M >= 12, measured on an AMD EPYC Zen 4, torch 2.13), so a forward
keeps at least `MIN_ROWS` rows, padded with unread ones, and one whose views hold fewer rows is
left whole. CUDA's GEMMs pick kernels by M too and are not checked: the CPU only.
"""

from __future__ import annotations

import torch

MIN_ROWS = 16           # fewest logit rows a pruned forward computes (see above)


def _prunable(item, shift: int) -> bool:
    """A one-canvas, contiguous item of a masked-rows-only decoder whose view lies inside its
    window, so every view position's input token is on the flat axis."""
    return (item.masked_rows_only and len(item.canvases) == 1 and item.window_positions is None
            and item.view_start >= shift and item.window_start <= item.view_start
            and item.view_end <= item.window_start + item.window_len)


def read_rows(items: list, view_rows: list[torch.Tensor], ids: torch.Tensor, mask_id: int,
              shift: int) -> torch.Tensor | None:
    """[V] bool over the views' logit rows laid end to end (`Layout.rows`, one piece per canvas):
    the rows to compute (read by a decision, or padding up to MIN_ROWS); None: compute them all.
    `ids` [T] is the forward's flat input; row r predicts flat token r + shift."""
    flags = [ok for item in items for ok in [_prunable(item, shift)] * len(item.canvases)]
    if not any(flags):
        return None
    views = torch.cat(view_rows)                                              # [V]
    if views.numel() < MIN_ROWS:
        return None
    sizes = torch.tensor([r.numel() for r in view_rows])
    keep = (ids.index_select(0, views + shift) == mask_id) | \
        ~torch.tensor(flags).repeat_interleave(sizes, output_size=views.numel())
    missing = MIN_ROWS - int(keep.sum())
    if missing > 0:                                 # pad with the first unread rows
        unread = ~keep
        keep |= unread & (unread.cumsum(0) <= missing)
    return None if bool(keep.all()) else keep


def spread_rows(logits: torch.Tensor, dest: torch.Tensor, total: int) -> torch.Tensor:
    """The computed rows [N, V] back at their places `dest` [N] among `total` rows (the others
    zero): the layout the decisions slice views from."""
    full = logits.new_zeros(total, logits.shape[-1])
    return full.index_copy_(0, dest, logits)
