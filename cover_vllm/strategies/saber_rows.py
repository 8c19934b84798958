"""SaberRows: Saber's per-slot confidences as rows of one table (issue #48; the persistent
batch's Saber slice, after COVER's `StateRows`).

Saber remembers, for every generation slot of a request, the confidences its rules read in the
next step (LLaDA: `last_conf`, the slot's p(argmax) in the previous forward, and `reveal_conf`,
its p at its most recent reveal; Dream: `first_conf`, its p at its first reveal). They are kept
across blocks: column j of a request's row is generation slot j, which is column j of Saber's view
(the view starts at the first generation slot).

A strategy instance owns one `SaberRows`; each request holds a `RowMemory` handle in
`BlockState.memory["rows"]`, taken on its first step (length: its generation length) and
returned to the free list when the request's state goes (finished or aborted). A step reads the
rows of all its requests with one fancy index (`read`) and writes them back with one
(`write`); the thresholds τ are one float32 mean per distinct count of recorded slots
(`thresholds`). So the host work of Saber's memory does not grow with the batch.

Slot values: a slot never in a view reads −inf; on a request's first step `last_conf` reads 0.0
over that step's view (the reference's zero initial confidence), so a slot that enters the view
with a later block reads −inf, as the previous step's masked confidence there was.
"""

from __future__ import annotations

import numpy as np
import torch

from cover_vllm.strategies.base import BlockState
from cover_vllm.strategies.state_rows import RowMemory, StateRows

NEG_INF = float("-inf")
LLADA_FIELDS = ("last_conf", "reveal_conf")
DREAM_FIELDS = ("first_conf",)
INITIAL = {"last_conf": 0.0}     # a field's value over the first step's view (default −inf)


class SaberRows:
    """The per-slot confidences of every request one Saber instance serves."""

    def __init__(self, fields: tuple[str, ...]):
        self.fields = fields
        self.table = StateRows(fields)

    def handles(self, states: list[BlockState], widths: list[int]) -> np.ndarray:
        """[n] row of each request in the table, taking one on a request's first step (or
        moving in a snapshot's detached copy, or widening one narrower than its view)."""
        rows = []
        for st, w in zip(states, widths):
            mem = st.memory.get("rows")
            if mem is None:
                values = np.full((len(self.fields), max(st.max_tokens, w)), NEG_INF)
                for i, name in enumerate(self.fields):
                    values[i, :w] = INITIAL.get(name, NEG_INF)
                mem = st.memory["rows"] = RowMemory(self.table, values.shape[1])
                mem.store(values)
            else:
                self.table.adopt(mem)
                if mem.length < w:
                    values = np.full((len(self.fields), w), NEG_INF)
                    values[:, : mem.length] = mem.stacked()
                    mem = st.memory["rows"] = RowMemory(self.table, w)
                    mem.store(values)
            rows.append(mem.row)
        return np.array(rows, dtype=np.int64)

    def read(self, rows: np.ndarray, name: str, valid: torch.Tensor) -> torch.Tensor:
        """[n, W] float32 host tensor: field `name` of `rows` over the view, −inf on padding
        (`valid` [n, W] host bool)."""
        width = valid.shape[1]
        values = self.table.data[rows, self.table.index[name], :width].astype(np.float32)
        return torch.from_numpy(values).masked_fill_(~valid, NEG_INF)

    def write(self, rows: np.ndarray, values: dict[str, torch.Tensor],
              valid: torch.Tensor) -> None:
        """Store every field from `values` ([n, W] host tensors) at the view positions."""
        req, col = valid.numpy().nonzero()
        stacked = np.stack([values[name].numpy()[req, col] for name in self.fields], axis=-1)
        self.table.scatter(rows[req], col, stacked)


def thresholds(record: torch.Tensor) -> torch.Tensor:
    """[n] float32 τ: the mean of each row's recorded (> −inf) values of `record` [n, W] (host),
    1.0 where none.

    The reference takes a float32 mean of the compact vector of recorded values in position
    order. Here the rows with k recorded values are taken together as one [m, k] tensor of those
    compact vectors, and a mean over its last dimension runs the same float32 reduction on each
    row as the 1-D mean does (tests/test_saber_rows.py checks the bits): one mean per distinct k,
    not one per request."""
    recorded = record > NEG_INF
    counts = recorded.sum(-1).numpy()
    flat = record[recorded]                          # row-major: each row in position order
    starts = np.cumsum(counts) - counts
    tau = torch.ones(record.shape[0], dtype=torch.float32)
    rows, means = [], []
    for k in np.unique(counts[counts > 0]).tolist():
        rows.append(np.flatnonzero(counts == k))
        means.append(flat[torch.from_numpy(starts[rows[-1]][:, None] + np.arange(k))].mean(-1))
    if rows:
        tau[torch.from_numpy(np.concatenate(rows))] = torch.cat(means)
    return tau


def thresholds_per_row(record: torch.Tensor) -> torch.Tensor:
    """`thresholds` one request at a time (the slow reference the tests hold it to)."""
    taus = [row[row > NEG_INF].mean() if bool((row > NEG_INF).any()) else torch.tensor(1.0)
            for row in record]
    return torch.stack(taus).to(torch.float32)
