"""The vocabulary the shared layers and the model families both speak: the attention callback a
layer calls, a model's sizes, a module's tensor-parallel plan, and the checkpoint slice a rank
reads. Plain types only; nothing here imports the rest of the package."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# (layer index, q [T, H, d], k [T, Hkv, d], v [T, Hkv, d]) -> o [T, H * d] (heads side by side: the
# output projection's input, with no reshape left to dispatch); q and k already rotated. A caller
# whose K and V heads lie side by side passes them as one k [T, 2 Hkv, d] (K heads, then V heads)
# and v=None: the paged cache then writes them in one op (`kv_halves` splits them).
AttentionFn = Callable[..., torch.Tensor]


def kv_halves(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [T, Hkv, d] of a side-by-side kv [T, 2 Hkv, d] (AttentionFn's v=None form)."""
    return kv.split(kv.shape[1] // 2, dim=1)


@dataclass(frozen=True)
class ModelDims:
    """Sizes the engine needs for KV pages and FLOP counts."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


@dataclass(frozen=True)
class ParallelPlan:
    """How tensor parallelism splits one module's own Linear layers, declared by the module in
    `parallel_plan()` (distributed/tensor_parallel.py collects them; it never looks at types).
    Names are attributes of the declaring module."""

    column: tuple[str, ...] = ()          # output rows sliced: rank r keeps its 1/N of the rows
    row: tuple[str, ...] = ()             # input columns sliced; partial outputs all-reduced
    row_unreduced: tuple[str, ...] = ()   # input columns sliced; a parent reduces the sum
                                          # (a sparse MoE's experts)
    column_splits: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # a fused column Linear whose rows are pieces side by side (LLaDA2's query_key_value: q, k,
    # v rows): rank r keeps its 1/N of every piece, so each keeps its own heads of q, k and v
    reduce_output: bool = False           # all-reduce the module's output (a sparse MoE block)
    local_dims: bool = False              # the module's `.dims` become the rank's head counts
    heads: dict[str, int] = field(default_factory=dict)
    # column Linears holding this many (query) heads side by side: the ranks must split them
    # into whole heads
    kv_heads: dict[str, int] = field(default_factory=dict)
    # column Linears holding this many kv heads: split into whole heads when the ranks divide
    # them; with fewer heads than ranks (a divisor of the ranks) each rank keeps a copy of the
    # one head its query heads read (a replicated kv head: DiffusionGemma's single one at TP=2)
    param_splits: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    # the module's own parameters (not Linears), name -> (dim, pieces): rank r keeps its 1/N of
    # every piece along `dim` (stacked MoE experts [E, 2M, H] / [E, H, M] split like an MLP)


@dataclass(frozen=True)
class Slice:
    """Elements [start, start + size) along `dim` of a checkpoint tensor whose full length there
    is `full` (one tensor-parallel rank's shard); `zero=True`: the rank holds zeros of the
    shard's shape instead (a row-parallel bias is added by rank 0 only).

    `pieces`: several (start, size) ranges along `dim`, concatenated in that order (a rank's
    share of a fused tensor such as LLaDA2's query_key_value: its q rows, then its k rows, then
    its v rows); build one with `Slice.of_ranges`. `start` is then the first range's start and
    `size` their total, so code that only reads `size` (the shard's length) stays right;
    `ranges` lists the ranges of any Slice."""

    dim: int
    start: int
    size: int
    full: int
    zero: bool = False
    pieces: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if self.pieces and (sum(n for _, n in self.pieces) != self.size
                            or self.pieces[0][0] != self.start):
            raise ValueError(f"Slice pieces {self.pieces} do not start at {self.start} and add "
                             f"up to size {self.size}")
        if any(s < 0 or n < 0 or s + n > self.full for s, n in self.ranges):
            raise ValueError(f"Slice ranges {self.ranges} leave [0, {self.full})")

    @classmethod
    def of_ranges(cls, dim: int, ranges: list[tuple[int, int]], full: int) -> Slice:
        """The concatenation of `ranges` [(start, size), ...] along `dim`; one range gives a
        plain Slice (no `pieces`)."""
        ranges = tuple((int(s), int(n)) for s, n in ranges)
        size = sum(n for _, n in ranges)
        return cls(dim, ranges[0][0], size, full, pieces=ranges if len(ranges) > 1 else ())

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The (start, size) ranges read, in shard order."""
        return self.pieces or ((self.start, self.size),)

    def full_shape(self, shard_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.full if d == self.dim else n for d, n in enumerate(shard_shape))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This slice of the full tensor (a view for one range, a new tensor for pieces)."""
        parts = [full.narrow(self.dim, s, n) for s, n in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
