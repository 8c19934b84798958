"""Completions and chat: a parsed request -> engine submissions (one per prompt; the engine
fans n > 1 out) -> an OpenAI JSON body or SSE (bodies: responses.py).

Streams carry only text that can no longer change (a partial output's stable text, then the
finished text) as per-choice deltas (`choices[].index`), so a streamed answer is never retracted
and its concatenation equals the non-streamed text; logprobs and token ids travel with them. A
client that disconnects or cancels gets its requests aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cover_vllm.engine.driver import EngineRequestError, Submission
from cover_vllm.entrypoints.server.client import EngineClient, ResultStream
from cover_vllm.entrypoints.server.errors import (APIError, from_value_error, model_not_found,
                                                  server_error)
from cover_vllm.entrypoints.server.protocol import ChatRequest, CompletionRequest, SamplingFields
from cover_vllm.entrypoints.server.responses import (DeltaTracker, ResponseShape, choices,
                                                     chunk_choice, finish_choice, usage)
from cover_vllm.entrypoints.server.structured import as_sent
from cover_vllm.outputs import RequestOutput
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.strategies import make_params, strategy_class
from cover_vllm.text_input import check_text

logger = logging.getLogger(__name__)


@dataclass
class ServingContext:
    """What the routes need besides the engine thread (never the engine itself)."""

    loop: EngineClient             # EngineLoop (one engine) or DPRouter (replicas)
    model_name: str
    tokenizer: Any | None          # the server's own copy (the engine thread uses the engine's)
    max_model_len: int
    default_max_tokens: int | None   # the checkpoint's max_new_tokens (generation_config.json)
    default_decoding: str
    created: int
    seeds: random.Random           # server-drawn seeds for requests that give none
    chat_template: str | None = None   # `serve --chat-template` (None: the tokenizer's)
    ignored_logged: set[str] = dataclasses.field(default_factory=set)  # logged once each


def check_model(ctx: ServingContext, name: str | None) -> None:
    if name is not None and name != ctx.model_name:
        raise model_not_found(name)


def tokenize(ctx: ServingContext, prompt: str | list[int], where: str = "prompt") -> list[int]:
    """A prompt's ids; a 400 naming `prompt` (`where` says which one of a list) for text that
    is not valid Unicode or has no tokenizer."""
    if not isinstance(prompt, str):
        return list(prompt)
    try:
        check_text(prompt, where)
    except ValueError as exc:
        raise APIError(str(exc), param="prompt", code="invalid_value") from exc
    if ctx.tokenizer is None:
        raise APIError("this model has no tokenizer: send the prompt as token ids",
                       param="prompt", code="no_tokenizer")
    ids = ctx.tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise APIError("prompt tokenizes to nothing", param="prompt", code="invalid_value")
    return ids


def chat_prompt(ctx: ServingContext, req: ChatRequest) -> list[int]:
    from cover_vllm.tokenizer import apply_chat_template

    if ctx.tokenizer is None:
        raise APIError("this model has no tokenizer, so it has no chat template",
                       param="messages", code="no_chat_template")
    try:
        options = req.template_options(ctx.chat_template)
    except ValueError as exc:
        raise from_value_error(exc, default_param="continue_final_message") from exc
    if req.tools is not None:
        check_tools_template(options.chat_template or getattr(ctx.tokenizer, "chat_template",
                                                              None))
    try:
        return apply_chat_template(ctx.tokenizer, req.conversation(), options)
    except Exception as exc:      # jinja errors, a template that refuses a role, ...
        raise APIError(f"the chat template rejected the messages: {exc}", param="messages",
                       code="invalid_value") from exc


def check_tools_template(template: str | None) -> None:
    """A 400 naming `tools` when the chat template would not show them to the model."""
    from cover_vllm.chat import template_reads

    if not template or not template_reads(template, "tools"):
        raise APIError("tools are given to the chat template, and this model's template never "
                       "reads `tools`, so the model would not see them; serve with a "
                       "--chat-template that renders tools, or leave them out", param="tools",
                       code="invalid_value")


def log_ignored(ctx: ServingContext, req: ChatRequest) -> None:
    """One log line per server for each OpenAI field accepted and ignored."""
    for name in req.ignored_fields():
        if name not in ctx.ignored_logged:
            ctx.ignored_logged.add(name)
            logger.info("the chat field %r is accepted and ignored (it does not change a "
                        "diffusion model's answer); logged once", name)


def check_length(ctx: ServingContext, prompts: list[list[int]], max_tokens: int,
                 prompt_field: str) -> None:
    """A 400 naming the field at fault: the prompt (`prompt_field`: prompt or messages) when it
    leaves no room for a single token, else max_tokens."""
    longest, limit = max(len(ids) for ids in prompts), ctx.max_model_len
    if longest >= limit:
        raise APIError(f"This model's maximum context length is {limit} tokens; the prompt has "
                       f"{longest} tokens, leaving no room for a generated token. Shorten the "
                       f"{prompt_field}.", param=prompt_field, code="context_length_exceeded")
    if longest + max_tokens > limit:
        raise APIError(f"This model's maximum context length is {limit} tokens; the prompt has "
                       f"{longest} tokens and max_tokens is {max_tokens} ({longest + max_tokens} "
                       f"in total). Lower max_tokens to at most {limit - longest}.",
                       param="max_tokens", code="context_length_exceeded")


def sampling_params(ctx: ServingContext, req: SamplingFields, prompts: list[list[int]],
                    max_tokens: int) -> list[SamplingParams]:
    """One SamplingParams per prompt; every seed fixed here so a replay is exact."""
    try:
        params = req.sampling_params(max_tokens)
        make_params(params.decoding or ctx.default_decoding, params.decoding_params)
    except (ValueError, TypeError) as exc:
        raise named_as_sent(req, from_value_error(exc, default_param="decoding_params")) from exc
    if params.seed is not None:
        return [params] * len(prompts)
    return [dataclasses.replace(params, seed=ctx.seeds.getrandbits(63)) for _ in prompts]


def check_constraint(ctx: ServingContext, req: SamplingFields) -> None:
    field = req.constraint_field()
    if field is not None and ctx.tokenizer is None:
        raise APIError("this model has no tokenizer, so its output cannot be constrained "
                       "(structured outputs are grammars over text)", param=field,
                       code="no_tokenizer")


def named_as_sent(req: SamplingFields, err: APIError) -> APIError:
    """An error about the constraint, naming the field the client sent (response_format or
    structured_outputs.<kind>; the engine only speaks of the latter)."""
    err.message, err.param = as_sent(req.response_format, err.message, err.param)
    return err


def streams_partial(ctx: ServingContext, params: SamplingParams) -> bool:
    """False for strategies that may still revise a finished block (Saber): the engine emits
    no partial outputs for them, and only their finished text is streamed."""
    return not strategy_class(params.decoding or ctx.default_decoding).revises_done_blocks


async def submit_all(ctx: ServingContext, base_id: str, prompts: list[list[int]],
                     params: list[SamplingParams]) -> list[ResultStream]:
    return await submit(ctx, [Submission(f"{base_id}-{i}", ids, p)
                              for i, (ids, p) in enumerate(zip(prompts, params))])


async def submit(ctx: ServingContext, subs: list[Submission]) -> list[ResultStream]:
    """Queue every submission, or (one was refused) none: a 400 for bad input."""
    streams: list[ResultStream] = []
    try:
        for sub in subs:
            streams.append(await ctx.loop.submit(sub))
    except BaseException as exc:
        for s in streams:
            ctx.loop.abort(s.request_id)
        if isinstance(exc, (ValueError, TypeError)):
            raise from_value_error(exc, default_param="prompt") from exc
        if isinstance(exc, Exception):
            raise server_error(f"the engine refused the request: {exc}") from exc
        raise
    return streams


async def _final(stream: ResultStream) -> RequestOutput:
    while True:
        out = await stream.get()
        if out.finished:
            return out


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(ctx: ServingContext, streams: list[ResultStream],
                  request: Request) -> list[RequestOutput] | None:
    """Every stream's finished output, or None when the client went away first (aborted)."""
    results = asyncio.ensure_future(asyncio.gather(*(_final(s) for s in streams)))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({results, watch}, return_when=asyncio.FIRST_COMPLETED)
        if results in done:
            try:
                return results.result()
            except EngineRequestError as exc:
                raise server_error(str(exc)) from exc
        return None
    finally:
        watch.cancel()
        ok = results.done() and not results.cancelled() and results.exception() is None
        if not ok:
            results.cancel()
            results.add_done_callback(lambda f: f.cancelled() or f.exception())
            for s in streams:
                ctx.loop.abort(s.request_id)


async def merged_outputs(streams: list[ResultStream]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as outputs arrive from any stream, until every one finished."""
    pending = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                out = task.result()
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].get())] = i
    finally:
        for task in pending:
            task.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _event_stream(ctx: ServingContext, head: dict, streams: list[ResultStream],
                        req: SamplingFields, shape: ResponseShape) -> AsyncIterator[str]:
    params = streams[0].submission.params
    tracker = DeltaTracker(shape, partial=streams_partial(ctx, params),
                           hold_tokens=bool(params.stop))
    tokens_wanted = shape.logprobs is not None or shape.token_ids
    finished, outs = set(), []
    try:
        async for i, out in merged_outputs(streams):
            for d in tracker.deltas(i, out):
                if d.text or (shape.chat and d.first) or (tokens_wanted and d.end > d.start):
                    yield _sse({**head, "choices": [chunk_choice(shape, d)]})
                if d.finished:
                    yield _sse({**head, "choices": [finish_choice(shape, d)]})
            if out.finished:
                finished.add(i)
                outs.append(out)
        if req.include_usage():
            yield _sse({**head, "choices": [], "usage": usage(outs)})
    except EngineRequestError as exc:
        yield _sse(server_error(str(exc)).body())
    finally:
        for i, s in enumerate(streams):
            if i not in finished:
                ctx.loop.abort(s.request_id)
    yield "data: [DONE]\n\n"


def response_shape(ctx: ServingContext, req: SamplingFields, chat: bool) -> ResponseShape:
    """Token ids come back when asked for (vLLM's return_token_ids) and, unless refused, from a
    model without a tokenizer (its text is empty)."""
    ids = req.return_token_ids if req.return_token_ids is not None else ctx.tokenizer is None
    return ResponseShape(chat=chat, n=req.n or 1, logprobs=req.num_logprobs(), token_ids=ids)


async def _respond(ctx: ServingContext, request: Request, req: SamplingFields,
                   prompts: list[list[int]], chat: bool):
    check_constraint(ctx, req)
    max_tokens = req.max_new_tokens(ctx.default_max_tokens)
    check_length(ctx, prompts, max_tokens, "messages" if chat else "prompt")
    params = sampling_params(ctx, req, prompts, max_tokens)
    base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:              # a malformed schema / regex / grammar is refused when the engine compiles it
        streams = await submit_all(ctx, base_id, prompts, params)
    except APIError as err:
        if chat and err.param == "prompt":       # the engine's word for the chat's messages
            err.param = "messages"
        raise named_as_sent(req, err)
    head = {"id": base_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": ctx.model_name}
    shape = response_shape(ctx, req, chat)
    if req.stream:
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        return StreamingResponse(_event_stream(ctx, head, streams, req, shape),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    outs = await collect(ctx, streams, request)
    if outs is None:                  # the client is gone; nobody reads this
        return JSONResponse({"error": "client disconnected"}, status_code=499)
    if chat and shape.token_ids:      # vLLM: the chat response's prompt ids are top-level
        head["prompt_token_ids"] = list(outs[0].prompt_token_ids)
    return JSONResponse({**head, "choices": choices(shape, outs), "usage": usage(outs)})


async def create_completion(ctx: ServingContext, request: Request, req: CompletionRequest,
                            prompts: list[list[int]]):
    """A completion without echo, its prompts already tokenized (app.py `completions` sends an
    echo to scoring.py)."""
    return await _respond(ctx, request, req, prompts, chat=False)


async def create_chat_completion(ctx: ServingContext, request: Request, req: ChatRequest):
    check_model(ctx, req.model)
    log_ignored(ctx, req)
    return await _respond(ctx, request, req, [chat_prompt(ctx, req)], chat=True)
