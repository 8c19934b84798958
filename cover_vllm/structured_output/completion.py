"""How a constrained value ends within its slots: a short grammar-valid completion of the
matcher's current state, searched depth-first over single-byte tokens.

A diffusion canvas has a fixed number of generation slots, and a model can keep a constrained
value open forever (digits of an integer, spaces, the characters of a string). Before the
constraint accepts a token near the end of the slots it asks whether the value can still be
completed in what is left after it; if not, it writes a completion instead (constraint.py).

The search tries the tokens that close something first (`"` before `}`, `]`, `)`: inside a
string those are text), then `0` (the
shortest value), then every other single-byte token in byte order, whitespace last (a grammar
that allows any whitespace would otherwise send a depth-first search down a run of it), so for JSON, regexes and
choices the first completion found is also the shortest or close to it. It gives up (None)
past `max_len` tokens or `MAX_TRIES` attempted tokens. Byte-level vocabularies (every
checkpoint this engine serves) hold all 256 single bytes, so a completion always exists in
them when the grammar has one.
"""

from __future__ import annotations

MAX_TRIES = 4096
CLOSERS = b'"}])0'
WHITESPACE = b" \t\n\r"


def closing_candidates(vocab: list[bytes]) -> list[int]:
    """Single-byte token ids in search order: closers, the rest by byte value, whitespace."""
    by_byte: dict[int, int] = {}
    for token_id, text in enumerate(vocab):
        if len(text) == 1 and text[0] not in by_byte:
            by_byte[text[0]] = token_id
    order = [b for b in CLOSERS if b in by_byte]
    order += [b for b in sorted(by_byte) if b not in CLOSERS + WHITESPACE]
    order += [b for b in WHITESPACE if b in by_byte]
    return [by_byte[b] for b in order]


def shortest_completion(matcher, candidates: list[int], max_len: int) -> list[int] | None:
    """Tokens (no end-of-sequence token) that complete the value from the matcher's state in at
    most `max_len` tokens, or None; the matcher is left as it was."""
    if max_len < 0:
        return None
    path: list[int] = []
    tries = 0

    def search(depth: int) -> bool:
        nonlocal tries
        if matcher.is_completed():
            return True
        if depth == max_len:
            return False
        for token in candidates:
            tries += 1
            if tries > MAX_TRIES:
                return False
            if matcher.accept_token(token):
                path.append(token)
                if search(depth + 1):
                    return True
                path.pop()
                matcher.rollback(1)
        return False

    found = search(0)
    if path:
        matcher.rollback(len(path))
    return path if found else None
