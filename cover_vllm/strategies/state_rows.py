"""StateRows: a decoder's per-request memory as rows of one preallocated array (issue #43).

The decoder side of the persistent batch. A strategy instance owns one `StateRows` table
[rows, fields, width] (float64); each request it serves holds a `RowMemory`: a handle on one row
and the length of the block it describes. A step reads the rows of all its requests with one
fancy index and writes them back with one (`gather` / `scatter`), so the host work of a memory
update is a fixed number of numpy ops whatever the batch.

Lifetime: a row is taken when a request first needs memory in a block and returned to the free
list when its handle is dropped: the request moved to its next block (a new state), finished, or
was aborted. A deep copy of a handle (a test's or a benchmark's snapshot) is a detached row in a
table of its own; a strategy `adopt`s it into its table the first time it serves it.
"""

from __future__ import annotations

import weakref

import numpy as np


class StateRows:
    """Rows [rows, len(fields), width] float64, grown by doubling (rows) or to the longest
    block seen (width); freed rows are reused, zeroed."""

    def __init__(self, fields: tuple[str, ...]):
        self.fields = fields
        self.index = {name: i for i, name in enumerate(fields)}
        self.data = np.zeros((0, len(fields), 0))
        self._free: list[int] = []

    def acquire(self, length: int) -> int:
        """A zeroed row with room for `length` columns."""
        rows, _, width = self.data.shape
        if not self._free or length > width:
            grown = np.zeros((max(8, 2 * rows) if not self._free else rows, len(self.fields),
                              max(width, length)))
            grown[:rows, :, :width] = self.data
            self.data = grown
            self._free.extend(range(grown.shape[0] - 1, rows - 1, -1))
        row = self._free.pop()
        self.data[row] = 0.0
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def adopt(self, mem: "RowMemory") -> None:
        """Move `mem` into this table (no-op when it is here already)."""
        if mem.table is self:
            return
        values = mem.stacked()
        mem._release()
        mem._bind(self)
        mem.store(values)

    def gather(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """[K, fields]: row rows[j], column cols[j] of every field."""
        return self.data[rows, :, cols]

    def scatter(self, rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> None:
        """Write `gather`'s layout back."""
        self.data[rows, :, cols] = values


class RowMemory:
    """One request's memory: row `row` of `table`, its first `length` columns. Each field name
    reads as a [length] view of the table (taken on access: keep no view across an `acquire`,
    which may move the table)."""

    def __init__(self, table: StateRows, length: int):
        self.length = length
        self._bind(table)

    @classmethod
    def detached(cls, fields: tuple[str, ...], values: np.ndarray) -> "RowMemory":
        """A memory in a table of its own holding `values` [len(fields), length]."""
        mem = cls(StateRows(fields), values.shape[1])
        mem.store(values)
        return mem

    def _bind(self, table: StateRows) -> None:
        self.table, self.row = table, table.acquire(self.length)
        self._release = weakref.finalize(self, table.release, self.row)

    def __getattr__(self, name: str) -> np.ndarray:
        table = self.__dict__.get("table")
        if table is None or name not in table.index:
            raise AttributeError(name)
        return table.data[self.row, table.index[name], :self.length]

    def stacked(self) -> np.ndarray:
        """[fields, length] copy."""
        return self.table.data[self.row, :, :self.length].copy()

    def store(self, values: np.ndarray) -> None:
        """Overwrite every field from [fields, length]."""
        self.table.data[self.row, :, :self.length] = values

    def __deepcopy__(self, memo) -> "RowMemory":
        return type(self).detached(self.table.fields, self.stacked())

    def __eq__(self, other) -> bool:
        return (isinstance(other, RowMemory) and self.table.fields == other.table.fields
                and np.array_equal(self.stacked(), other.stacked()))

    __hash__ = None

    def __repr__(self) -> str:
        return f"RowMemory(row={self.row}, length={self.length}, fields={self.table.fields})"
