"""`word`: templated word problems with a two-step chain of reasoning and a final answer.

Prompt: "Mia has 3 pens. She buys 5 more, then she gives 2 to Leo. How many pens does Mia have
now?". Answer: each step on the previous result, then the answer as a sentence
("3+5=8. 8-2=6. Mia has 6 pens."), 20 tokens + EOS in 24 slots; all numbers are single digits
(totals stay in 1-9), so the answer layout is fixed. The second step
reuses the first result, so its tokens depend on earlier answer tokens. The verifier re-solves
the prompt and checks the last number of the output.
"""

from __future__ import annotations

import random
import re

from cover_vllm.tasks.base import Example, Task, clean_output

HE = ("Tom", "Sam", "Ben", "Max", "Leo")
SHE = ("Ann", "Mia", "Eva", "Zoe", "Lily")
ITEMS = ("apples", "pens", "books", "cards", "coins", "eggs", "stamps", "shells")
# verb phrase template -> sign of the change; "{n}" is the amount, "{other}" another name.
GAINS = ("buys {n} more", "finds {n} more", "gets {n} more from {other}")
LOSSES = ("gives {n} to {other}", "loses {n}", "sells {n}")
_SIGN = {"buys": 1, "finds": 1, "gets": 1, "gives": -1, "loses": -1, "sells": -1}

_START = re.compile(r"^\s*([A-Z][a-z]+) has (\d+) ([a-z]+)\.")
_EVENT = re.compile(r"\b(buys|finds|gets|gives|loses|sells) (\d+)\b")
_NUMBER = re.compile(r"\d+")


def _event(rng: random.Random, total: int, name: str) -> tuple[str, int]:
    """One event phrase and its signed amount, keeping the running total in [1, 9]."""
    gain = total < 5 if total in (1, 9) else rng.random() < 0.5
    amount = rng.randint(1, 9 - total) if gain else rng.randint(1, total - 1)
    phrase = rng.choice(GAINS if gain else LOSSES)
    other = rng.choice([n for n in HE + SHE if n != name])
    return phrase.format(n=amount, other=other), amount if gain else -amount


def solve(prompt: str) -> int | None:
    """The answer implied by a prompt of this task's template, or None if it does not parse."""
    start = _START.match(prompt)
    if start is None:
        return None
    events = _EVENT.findall(prompt[start.end():])
    if not events:
        return None
    return int(start.group(2)) + sum(_SIGN[verb] * int(n) for verb, n in events)


class WordProblems(Task):
    """"X has a items. X gains/loses b, then gains/loses c. How many now?" with worked steps."""

    name = "word"
    max_tokens = 24
    block_length = 24

    def sample(self, rng: random.Random) -> Example:
        name = rng.choice(HE + SHE)
        pron = "He" if name in HE else "She"
        item = rng.choice(ITEMS)
        start = rng.randint(2, 8)
        phrase1, delta1 = _event(rng, start, name)
        phrase2, delta2 = _event(rng, start + delta1, name)
        prompt = (f"{name} has {start} {item}. {pron} {phrase1}, then {pron.lower()} {phrase2}. "
                  f"How many {item} does {name} have now?")
        steps, total = [], start
        for delta in (delta1, delta2):
            op = "+" if delta > 0 else "-"
            steps.append(f"{total}{op}{abs(delta)}={total + delta}.")
            total += delta
        return Example(prompt, " ".join(steps) + f" {name} has {total} {item}.")

    def check(self, prompt: str, output_text: str) -> bool:
        expected = solve(prompt)
        numbers = _NUMBER.findall(clean_output(output_text))
        return expected is not None and bool(numbers) and int(numbers[-1]) == expected
