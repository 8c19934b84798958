"""`arith`: 3-digit addition worked column by column, carries written and reused.

Prompt: "347+158=" (two numbers in [100, 499], so the sum has 3 digits). Answer: one line per
column from the ones up, "digit+digit+carry=two-digit column sum", where each line's carry is
the tens digit of the line before, then the result assembled from the column sums' last digits:

    7+8+0=15
    4+5+1=10
    3+1+1=05
    =505

31 tokens + EOS in 32 slots, fixed layout. Later lines depend on earlier ones (the carry, and the
result copies every column), so answer tokens are not independent given the prompt; plain
addition without steps shows no parallel-decoding trade-off (DESIGN.md §4). Only the number after
the last "=" is checked.
"""

from __future__ import annotations

import random
import re

from cover_vllm.tasks.base import Example, Task, clean_output

_PROMPT = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")
_LAST_RESULT = re.compile(r"=\s*(\d+)\s*$")


def column_steps(a: int, b: int, width: int) -> list[str]:
    """The worked column additions of a + b (ones column first), then "=a+b"."""
    lines, carry = [], 0
    for i in range(width):
        da, db = a // 10 ** i % 10, b // 10 ** i % 10
        column = da + db + carry
        lines.append(f"{da}+{db}+{carry}={column:02d}")
        carry = column // 10
    return [*lines, f"={a + b}"]


class ArithSteps(Task):
    """a + b for a, b in [100, 499], worked column by column with written carries."""

    name = "arith"
    max_tokens = 32
    block_length = 32

    def __init__(self, lo: int = 100, hi: int = 499):
        if not 100 <= lo <= hi <= 499:
            raise ValueError(f"need 100 <= lo <= hi <= 499 (3-digit sums), got {lo}, {hi}")
        self.lo, self.hi = lo, hi

    def sample(self, rng: random.Random) -> Example:
        a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
        return Example(f"{a}+{b}=", "\n".join(column_steps(a, b, width=3)))

    def check(self, prompt: str, output_text: str) -> bool:
        match = _PROMPT.match(prompt)
        found = _LAST_RESULT.search(clean_output(output_text))
        if match is None or found is None:
            return False
        return int(found.group(1)) == int(match.group(1)) + int(match.group(2))
