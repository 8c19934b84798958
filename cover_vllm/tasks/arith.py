"""`arith`: 3-digit addition worked column by column, every step checked.

Prompt: "347+158=" (two numbers in [100, 499], so the sum has 3 digits). Answer: one line per
column from the ones up, "digit+digit+carry=two-digit column sum", where each line's carry is the
tens digit of the line before, then the result assembled from the column sums' last digits:

    7+8+0=15
    5+4+1=10
    1+3+1=05
    =505

The two digits of a column may be written in either order (addition commutes; the reference
answers draw the order at random per line), so a problem has 2^3 valid worked answers, and
`check` accepts exactly those: every line must add that column's two digits (in some order) and
the previous line's carry correctly, and the last line must be the sum. The order makes the
answer multi-modal the way several-solution Sudokus are: each digit slot alone is a coin flip
between two digits, and two slots of one line committed in the same step can take one digit each
from different orders ("7+7" where 7 and 8 belong), which a one-token-per-step decoder never
does. Later lines also depend on earlier ones (the carry), and the result copies every column.
31 tokens + EOS in 32 slots, fixed layout.
"""

from __future__ import annotations

import random
import re

from cover_vllm.tasks.base import Example, Task, clean_output

_PROMPT = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")
_LINE = re.compile(r"^(\d)\+(\d)\+(\d)=(\d\d)$")
_RESULT = re.compile(r"^=(\d+)$")


def column_steps(a: int, b: int, width: int, rng: random.Random | None = None) -> list[str]:
    """The worked column additions of a + b (ones column first), then "=a+b". With `rng`, each
    line's two digits are written in a random order (both are valid)."""
    lines, carry = [], 0
    for i in range(width):
        da, db = a // 10 ** i % 10, b // 10 ** i % 10
        column = da + db + carry
        if rng is not None and rng.random() < 0.5:
            da, db = db, da
        lines.append(f"{da}+{db}+{carry}={column:02d}")
        carry = column // 10
    return [*lines, f"={a + b}"]


def check_steps(a: int, b: int, width: int, text: str) -> bool:
    """True iff `text` is one of the valid worked answers of a + b (see the module docstring)."""
    lines = text.split("\n")
    if len(lines) != width + 1:
        return False
    carry = 0
    for i, line in enumerate(lines[:width]):
        match = _LINE.match(line)
        if match is None:
            return False
        x, y, c, column = (int(g) for g in match.groups())
        if sorted((x, y)) != sorted((a // 10 ** i % 10, b // 10 ** i % 10)):
            return False
        if c != carry or column != x + y + c:
            return False
        carry = column // 10
    result = _RESULT.match(lines[width])
    return result is not None and int(result.group(1)) == a + b


class ArithSteps(Task):
    """a + b for a, b in [100, 499], worked column by column; the whole derivation is checked."""

    name = "arith"
    max_tokens = 32
    block_length = 32
    width = 3

    def __init__(self, lo: int = 100, hi: int = 499):
        if not 100 <= lo <= hi <= 499:
            raise ValueError(f"need 100 <= lo <= hi <= 499 (3-digit sums), got {lo}, {hi}")
        self.lo, self.hi = lo, hi

    def sample(self, rng: random.Random) -> Example:
        a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
        return Example(f"{a}+{b}=", "\n".join(column_steps(a, b, self.width, rng)))

    def check(self, prompt: str, output_text: str) -> bool:
        match = _PROMPT.match(prompt)
        if match is None:
            return False
        a, b = int(match.group(1)), int(match.group(2))
        return check_steps(a, b, self.width, clean_output(output_text))
