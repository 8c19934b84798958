"""`sudoku4`: 4x4 Sudoku with 4-10 givens; many puzzles have several solutions and any counts.

Prompt: "Sudoku:" then the 4 rows, blanks as "_" (e.g. "Sudoku:\n1__4\n____\n_3__\n___2").
Answer: the 4 completed rows joined by newlines ("1234\n3412\n2143\n4321"), 19 tokens + EOS in
24 generation slots. Because several completions can be valid, tokens committed in parallel can
conflict — the failure COVER's revocation targets (DESIGN.md §4).
"""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

from cover_vllm.tasks.base import Example, Task, clean_output

SIZE = 4
HEADER = "Sudoku:"
BLANK = "_"
Grid = tuple[int, ...]   # 16 cells, row-major, values 1..4 (0 = blank in puzzles)


def _units() -> list[tuple[int, ...]]:
    rows = [tuple(r * SIZE + c for c in range(SIZE)) for r in range(SIZE)]
    cols = [tuple(r * SIZE + c for r in range(SIZE)) for c in range(SIZE)]
    boxes = [tuple((br + r) * SIZE + bc + c for r in range(2) for c in range(2))
             for br in (0, 2) for bc in (0, 2)]
    return rows + cols + boxes


UNITS = _units()


def is_valid_grid(grid: Grid) -> bool:
    """Every row, column and 2x2 box holds 1, 2, 3, 4 exactly once."""
    return len(grid) == SIZE * SIZE and all(
        sorted(grid[i] for i in unit) == [1, 2, 3, 4] for unit in UNITS)


@lru_cache(maxsize=1)
def all_solutions() -> tuple[Grid, ...]:
    """All 288 valid 4x4 grids in lexicographic order (rows stacked with column/box pruning)."""
    rows = list(itertools.permutations(range(1, SIZE + 1)))
    grids: list[tuple[int, ...]] = [()]
    for r in range(SIZE):
        grids = [g + row for g in grids for row in rows if _fits(g, row, r)]
    return tuple(grids)


def _fits(grid: tuple[int, ...], row: tuple[int, ...], r: int) -> bool:
    """Row `row` placed as row `r` below `grid` repeats no column or 2x2-box value."""
    for c, v in enumerate(row):
        if any(grid[rr * SIZE + c] == v for rr in range(r)):
            return False
        box_rows = range(r - r % 2, r)
        box_cols = range(c - c % 2, c - c % 2 + 2)
        if any(grid[rr * SIZE + cc] == v for rr in box_rows for cc in box_cols):
            return False
    return True


def count_solutions(puzzle: Grid) -> int:
    return sum(all(p in (0, s) for p, s in zip(puzzle, g)) for g in all_solutions())


def format_puzzle(puzzle: Grid) -> str:
    lines = ["".join(str(v) if v else BLANK for v in puzzle[r * SIZE:(r + 1) * SIZE])
             for r in range(SIZE)]
    return "\n".join([HEADER, *lines])


def parse_puzzle(prompt: str) -> Grid | None:
    lines = prompt.strip().splitlines()
    if len(lines) != SIZE + 1 or lines[0].strip() != HEADER:
        return None
    cells: list[int] = []
    for line in lines[1:]:
        line = line.strip()
        if len(line) != SIZE or any(ch not in "1234" + BLANK for ch in line):
            return None
        cells.extend(0 if ch == BLANK else int(ch) for ch in line)
    return tuple(cells)


def parse_grid(text: str) -> Grid | None:
    """The 4 answer rows as a grid, or None if the text is not exactly 4 rows of 4 digits."""
    lines = [line.strip() for line in clean_output(text).splitlines()]
    if len(lines) != SIZE or any(len(x) != SIZE or not x.isdigit() for x in lines):
        return None
    return tuple(int(ch) for line in lines for ch in line)


class Sudoku4(Task):
    """4x4 Sudoku: a random valid grid with 4-10 cells revealed (any valid completion counts)."""

    name = "sudoku4"
    max_tokens = 24
    block_length = 24

    def __init__(self, min_givens: int = 4, max_givens: int = 10):
        if not 1 <= min_givens <= max_givens <= SIZE * SIZE:
            raise ValueError(f"need 1 <= min_givens <= max_givens <= 16, got "
                             f"{min_givens}, {max_givens}")
        self.min_givens, self.max_givens = min_givens, max_givens

    def sample(self, rng: random.Random) -> Example:
        solution = rng.choice(all_solutions())
        num_givens = rng.randint(self.min_givens, self.max_givens)
        shown = set(rng.sample(range(SIZE * SIZE), num_givens))
        puzzle = tuple(v if i in shown else 0 for i, v in enumerate(solution))
        answer = "\n".join("".join(map(str, solution[r * SIZE:(r + 1) * SIZE]))
                           for r in range(SIZE))
        return Example(format_puzzle(puzzle), answer)

    def check(self, prompt: str, output_text: str) -> bool:
        puzzle, grid = parse_puzzle(prompt), parse_grid(output_text)
        if puzzle is None or grid is None:
            return False
        return is_valid_grid(grid) and all(p in (0, g) for p, g in zip(puzzle, grid))
