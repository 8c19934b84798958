"""OpenAI response bodies from RequestOutputs: the choices of a response and of stream chunks,
logprobs in the completions (legacy) and chat forms, vLLM's `stop_reason` and `token_ids`, and
usage. What was already streamed per choice is tracked here (DeltaTracker).

Choice indices follow vLLM: prompt p's output i is choice p * n + i. Logprob values are clamped at
-9999.0 as vLLM does (JSON has no -inf); a token without text (no tokenizer) is "token_id:<id>".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cover_vllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger(__name__)
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class ResponseShape:
    """What a response carries besides the text."""

    chat: bool
    n: int                       # choices per prompt
    logprobs: int | None         # alternatives per token (None: no logprobs)
    token_ids: bool              # vLLM's return_token_ids form (prompt_token_ids, token_ids)

    def index(self, prompt: int, output: int) -> int:
        return prompt * self.n + output


def _token(token_id: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _value(lp: Logprob) -> float:
    return max(lp.logprob, MIN_LOGPROB)


def completion_logprobs(c: CompletionOutput, start: int, end: int,
                        offset: int) -> tuple[dict, int]:
    """OpenAI's legacy form for tokens [start, end) of `c` whose text starts at character
    `offset`: tokens, token_logprobs, top_logprobs (chosen + top k as {token: logprob}),
    text_offset. Returns it and the offset after them."""
    body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(c.token_ids[start:end], c.logprobs[start:end]):
        token = _token(token_id, entry[token_id])
        body["tokens"].append(token)
        body["token_logprobs"].append(_value(entry[token_id]))
        body["top_logprobs"].append({_token(t, lp): _value(lp) for t, lp in entry.items()})
        body["text_offset"].append(offset)
        offset += len(token)
    return body, offset


def _chat_entry(token_id: int, lp: Logprob) -> dict:
    token = _token(token_id, lp)
    return {"token": token, "logprob": _value(lp), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(c: CompletionOutput, start: int, end: int, k: int) -> dict:
    """OpenAI's chat form for tokens [start, end): content = [{token, logprob, bytes,
    top_logprobs: the k most likely tokens, in rank order}]."""
    content = []
    for token_id, entry in zip(c.token_ids[start:end], c.logprobs[start:end]):
        top = sorted(((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= k))
        content.append({**_chat_entry(token_id, entry[token_id]),
                        "top_logprobs": [_chat_entry(t, lp) for _, t, lp in top]})
    return {"content": content}


def _logprobs(shape: ResponseShape, c: CompletionOutput, start: int, end: int,
              offset: int) -> tuple[dict | None, int]:
    if shape.logprobs is None or c.logprobs is None:
        return None, offset
    if shape.chat:
        return chat_logprobs(c, start, end, shape.logprobs), offset
    return completion_logprobs(c, start, end, offset)


def choice(shape: ResponseShape, prompt: int, out: RequestOutput, c: CompletionOutput) -> dict:
    """A non-streamed choice; `metrics` are the request's (summed over its n outputs)."""
    logprobs, _ = _logprobs(shape, c, 0, len(c.token_ids), 0)
    body = ({"message": {"role": "assistant", "content": c.text}} if shape.chat
            else {"text": c.text})
    extra = {}
    if shape.token_ids:
        extra = {"token_ids": list(c.token_ids)} if shape.chat else {
            "prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(c.token_ids)}
    return {"index": shape.index(prompt, c.index), **body, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, **extra,
            "metrics": out.metrics.as_dict()}


def choices(shape: ResponseShape, outs: list[RequestOutput]) -> list[dict]:
    return [choice(shape, p, out, c) for p, out in enumerate(outs) for c in out.outputs]


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass
class ChoiceDelta:
    """What is new in one choice of a stream."""

    index: int
    text: str                    # new stable text
    start: int                   # new tokens: output.token_ids[start:end]
    end: int
    offset: int                  # character offset of the new tokens' text (legacy logprobs)
    output: CompletionOutput
    prompt_token_ids: list[int]
    first: bool                  # the first delta of this choice
    finished: bool               # the choice finished with this output


@dataclass
class _Sent:
    text: str = ""
    tokens: int = 0
    offset: int = 0
    finished: bool = False


@dataclass
class DeltaTracker:
    """Per choice, what was streamed. Text goes out as it becomes stable (with `partial`; else
    only finished text); tokens (logprobs, token_ids) go out with it, except that while stop
    strings may still cut the output (`hold_tokens`) they wait for the finished output."""

    shape: ResponseShape
    partial: bool
    hold_tokens: bool
    _sent: dict[int, _Sent] = field(default_factory=dict)

    def deltas(self, prompt: int, out: RequestOutput) -> list[ChoiceDelta]:
        found = []
        for c in out.outputs:
            index = self.shape.index(prompt, c.index)
            first = index not in self._sent
            sent = self._sent.setdefault(index, _Sent())
            if sent.finished:
                continue
            done = c.finish_reason is not None
            text = ""
            if (self.partial or done) and len(c.text) > len(sent.text):
                if c.text.startswith(sent.text):
                    text, sent.text = c.text[len(sent.text):], c.text
                else:
                    logger.warning("request %s: text changed after it was streamed",
                                   out.request_id)
            start = end = sent.tokens
            if done or (self.partial and not self.hold_tokens):
                end = max(start, len(c.token_ids))
            offset = sent.offset
            if end > start and c.logprobs is not None:
                sent.offset += sum(len(_token(t, entry[t])) for t, entry in
                                   zip(c.token_ids[start:end], c.logprobs[start:end]))
            sent.tokens, sent.finished = end, done
            found.append(ChoiceDelta(index, text, start, end, offset, c,
                                     out.prompt_token_ids, first, done))
        return found


def chunk_choice(shape: ResponseShape, d: ChoiceDelta) -> dict:
    """A stream chunk's choice carrying a delta's text and tokens (finish_reason None)."""
    c = d.output
    logprobs, _ = _logprobs(shape, c, d.start, d.end, d.offset) if d.end > d.start else (
        None, 0)
    if shape.chat:
        body = {"delta": {"role": "assistant", "content": d.text} if d.first else (
            {"content": d.text} if d.text else {})}
    else:
        body = {"text": d.text}
    extra = {}
    if shape.token_ids:
        extra["token_ids"] = list(c.token_ids[d.start:d.end])
        if d.first and not shape.chat:
            extra["prompt_token_ids"] = list(d.prompt_token_ids)
    return {"index": d.index, **body, "logprobs": logprobs, "finish_reason": None, **extra}


def finish_choice(shape: ResponseShape, d: ChoiceDelta) -> dict:
    """The chunk choice that ends a choice: finish_reason and stop_reason."""
    body = {"delta": {}} if shape.chat else {"text": ""}
    extra = {"token_ids": []} if shape.token_ids else {}
    return {"index": d.index, **body, "logprobs": None,
            "finish_reason": d.output.finish_reason, "stop_reason": d.output.stop_reason,
            **extra}
