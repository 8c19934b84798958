"""Scoring inputs: (context, continuation) pairs as text or token ids, validated, and text pairs
encoded the way the official lm-eval wrapper does (`_encode_pair`)."""

from __future__ import annotations

from typing import Any

from cover_vllm.text_input import check_text

ScorePair = tuple[list[int], list[int]]


def encode_pair(tokenizer, context: str, continuation: str) -> ScorePair:
    """The official `_encode_pair`: trailing whitespace of the context moves to the front of
    the continuation; the continuation's ids are those of context + continuation after the
    context's own ids (so a merge across the boundary is attributed to the continuation). Both
    are encoded as the official code calls its tokenizer, with the tokenizer's default special
    tokens (a BOS, for tokenizers that add one, starts the context)."""
    check_text(context, "context")
    check_text(continuation, "continuation")
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def _ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"{name} must be a list of token ids (ints)")
    return list(value)


def score_pair(request: Any, tokenizer) -> ScorePair:
    """One request as (context ids, continuation ids): a dict with `context_token_ids` and
    `continuation_token_ids`, or a (context, continuation) pair of strings."""
    if isinstance(request, dict):
        missing = {"context_token_ids", "continuation_token_ids"} - set(request)
        if missing:
            raise ValueError(f"a scoring request dict needs the keys 'context_token_ids' and "
                             f"'continuation_token_ids' (missing {sorted(missing)})")
        return (_ids(request["context_token_ids"], "context_token_ids"),
                _ids(request["continuation_token_ids"], "continuation_token_ids"))
    if isinstance(request, (tuple, list)) and len(request) == 2 and all(
            isinstance(s, str) for s in request):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'context_token_ids': [...], "
                             "'continuation_token_ids': [...]} instead of text")
        return encode_pair(tokenizer, request[0], request[1])
    raise TypeError("a scoring request is {'context_token_ids': [...], "
                    "'continuation_token_ids': [...]} or a (context, continuation) pair of "
                    f"strings, got {type(request).__name__}")


def check_pair(context: list[int], continuation: list[int], vocab_size: int,
               max_model_len: int) -> None:
    """ValueError naming the field: an empty continuation, ids outside the vocabulary, or a
    sequence longer than the model's max length."""
    if not continuation:
        raise ValueError("continuation_token_ids is empty: there is nothing to score")
    for name, ids in (("context_token_ids", context), ("continuation_token_ids", continuation)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    total = len(context) + len(continuation)
    if total > max_model_len:
        raise ValueError(f"context ({len(context)} tokens) + continuation "
                         f"({len(continuation)} tokens) = {total} tokens, beyond "
                         f"max_model_len={max_model_len}")
