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
past `max_len` tokens or `MAX_TRIES` attempted tokens. The first completion found is taken as
the shortest (never a search bounded by the slots left: when nothing fits, proving it would
take an exhaustive search), so the constraint closes a value at worst a little early. At each node one bitmask fill gives the
candidates the grammar takes, so a step costs one fill and one accepted token. Byte-level vocabularies (every
checkpoint this engine serves) hold all 256 single bytes, so a completion always exists in
them when the grammar has one.
"""

from __future__ import annotations

import numpy as np

MAX_TRIES = 4096
SEARCH_DEPTH = 256      # longest completion looked for
CLOSERS = b'"}])0'
WHITESPACE = b" \t\n\r"


def closing_candidates(vocab: list[bytes]) -> tuple[list[int], int]:
    """Single-byte token ids in search order (closers, the rest by byte value, whitespace),
    and how many of them are closers."""
    by_byte: dict[int, int] = {}
    for token_id, text in enumerate(vocab):
        if len(text) == 1 and text[0] not in by_byte:
            by_byte[text[0]] = token_id
    order = [b for b in CLOSERS if b in by_byte]
    order += [b for b in sorted(by_byte) if b not in CLOSERS + WHITESPACE]
    order += [b for b in WHITESPACE if b in by_byte]
    return [by_byte[b] for b in order], sum(b in by_byte for b in CLOSERS)


class CompletionSearch:
    """Depth-first completion search for one matcher, and the completion found after each
    accepted canvas position (valid while the prefix up to it is unchanged: `forget_from`
    drops it when a revision rolls the grammar back), so re-walking a prefix after a check
    searches nothing again."""

    def __init__(self, matcher, candidates: tuple[list[int], int], vocab_size: int):
        import xgrammar as xgr

        self.matcher = matcher
        candidates, closers = candidates
        self.order = np.asarray(candidates, dtype=np.int64)
        self.ordered, self.closers = list(candidates), candidates[:closers]
        self._word, self._bit = self.order >> 5, (self.order & 31).astype(np.int32)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._words = self.bitmask.numpy()[0]        # shares the tensor's memory
        self.paths: dict[int, list[int]] = {}   # canvas position -> a completion after it

    def _allowed(self) -> list[int]:
        """Candidates the grammar takes next, in search order: a closer when one fits (a few
        accept attempts; the others follow unchecked, for a backtrack), else one bitmask fill
        read at the candidates' bits."""
        for token in self.closers:
            if self.matcher.accept_token(token):
                self.matcher.rollback(1)
                return [token] + [t for t in self.ordered if t != token]
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = (self._words[self._word] >> self._bit) & 1
        return self.order[bits.astype(bool)].tolist()

    def find(self, max_len: int) -> list[int] | None:
        """Tokens (no end-of-sequence token) that complete the value from the matcher's state
        in at most `max_len` tokens, or None; the matcher is left as it was."""
        if max_len < 0:
            return None
        path: list[int] = []
        tries = 0

        def search(depth: int) -> bool:
            nonlocal tries
            if self.matcher.is_completed():
                return True
            if depth == max_len:
                return False
            for token in self._allowed():
                tries += 1
                if tries > MAX_TRIES:
                    return False
                if not self.matcher.accept_token(token):
                    continue                      # (after a closer: the others unchecked)
                path.append(token)
                if search(depth + 1):
                    return True
                path.pop()
                self.matcher.rollback(1)
            return False

        found = search(0)
        if path:
            self.matcher.rollback(len(path))
        return path if found else None

    def path_after(self, position: int, token: int | None = None) -> list[int] | None:
        """A completion from the state after canvas `position` (the matcher's state now;
        `token` is the one accepted there), kept until `forget_from`; None when the search gave
        up. The completion kept for `position - 1` is reused first (`_reuse`); only when it no
        longer completes the value is there a search."""
        if position not in self.paths:
            found = self._reuse(self.paths.get(position - 1), token)
            if found is None:
                found = self.find(SEARCH_DEPTH)
            if found is None:
                return None
            self.paths[position] = found
        return self.paths[position]

    def _reuse(self, before: list[int] | None, token: int | None) -> list[int] | None:
        """A completion after `token` from the one kept before it: its tail when `token` was
        its first token; else the tail replayed (`token` took the first token's place: another
        digit, another letter), else all of it replayed (`token` was one more: whitespace)."""
        if not before:
            return None
        if before[0] == token:
            return before[1:]
        for tail in (before[1:], before):
            found = self._replay(tail)
            if found is not None:
                return found
        return None

    def _replay(self, tokens: list[int]) -> list[int] | None:
        """The shortest prefix of `tokens` that completes the value from the matcher's state,
        or None (the matcher is left as it was)."""
        taken = 0
        for t in tokens:
            if self.matcher.is_completed() or not self.matcher.accept_token(t):
                break
            taken += 1
        completed = self.matcher.is_completed()
        if taken:
            self.matcher.rollback(taken)
        return tokens[:taken] if completed else None

    def forget_from(self, position: int) -> None:
        for key in [k for k in self.paths if k >= position]:
            del self.paths[key]
