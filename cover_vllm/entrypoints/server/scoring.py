"""Echo completions: `/v1/completions` with `echo: true` returns the prompt before the completion
and, with `logprobs: k`, a value for every prompt token: likelihood scoring through the engine.

What a prompt token's value means (docs/architecture.md, "Likelihood scoring"):

* without `continuation` (what lm-eval's `local-completions` sends: `echo`, `logprobs: 1`,
  `max_tokens: 1`, and it sums `token_logprobs[ctxlen:-1]`): token i's value is log p(x_i | x_<i)
  from one forward of x_<i followed by [MASK] (the estimator with a one-token continuation, which
  is exact: no sampling), and `top_logprobs` the k most likely tokens there. A suffix sum is the
  left-to-right chain-rule likelihood of the suffix; the first token has none (null);
* with `continuation` (extra body: text, ids, or one per prompt), the prompt is the context and
  the continuation's tokens follow it in the echo (text pairs encoded as lm-eval's
  `_encode_pair`); token j of the continuation carries its share of the Monte-Carlo estimate
  (LoglikelihoodOutput.token_logprobs), so the continuation's values sum to exactly what
  `LLM.loglikelihood` gives with the same `seed`, `mc_num` and `mc_batch_size`; context tokens
  are null, and the choice's `loglikelihood` field holds the estimate and its metrics.

With `max_tokens` > 0 the completion is generated as usual and its tokens follow the prompt's.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from cover_vllm.engine.driver import Submission
from cover_vllm.entrypoints.server.errors import APIError
from cover_vllm.entrypoints.server.protocol import CompletionRequest
from cover_vllm.entrypoints.server.responses import MIN_LOGPROB, completion_logprobs
from cover_vllm.entrypoints.server.serving import (ServingContext, collect, sampling_params,
                                                   submit, submit_all)
from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams
from cover_vllm.scoring.prompts import encode_pair
from cover_vllm.text_input import check_text

SCORING_FIELDS = ("continuation", "mc_num", "mc_batch_size")


def check_scoring_fields(req: CompletionRequest) -> None:
    """The scoring-only fields need echo (and logprobs): 400 naming the first one sent."""
    for name in SCORING_FIELDS:
        if getattr(req, name) is not None and not (req.echo and req.logprobs is not None):
            raise APIError(f"'{name}' scores the prompt: it needs echo=true and logprobs",
                           param=name, code="invalid_value")
    if not req.echo and req.max_tokens == 0:
        raise APIError("max_tokens=0 generates nothing: it needs echo=true (with logprobs, the "
                       "prompt's token log-probabilities)", param="max_tokens",
                       code="invalid_value")


def _scoring_params(ctx: ServingContext, req: CompletionRequest, **fixed) -> LoglikelihoodParams:
    """LoglikelihoodParams from the extra body; ValueError naming mc_num / mc_batch_size."""
    seed = req.seed if req.seed is not None else ctx.seeds.getrandbits(63)
    fields = {"mc_num": 128 if req.mc_num is None else req.mc_num,
              "batch_size": 32 if req.mc_batch_size is None else req.mc_batch_size,
              "seed": seed, **fixed}
    if req.mc_num is not None and req.mc_batch_size is None:
        fields["batch_size"] = min(32, req.mc_num)
    try:
        return LoglikelihoodParams(**fields)
    except (ValueError, TypeError) as exc:
        param = "mc_batch_size" if "batch_size" in str(exc) and "mc_num" not in str(exc) \
            else "mc_num"
        raise APIError(str(exc).replace("LoglikelihoodParams.", "").replace(
            "batch_size", "mc_batch_size"), param=param, code="invalid_value") from exc


def _pairs(ctx: ServingContext, req: CompletionRequest,
           prompts: list[list[int]]) -> list[tuple[list[int], list[int]]] | None:
    """(context ids, continuation ids) per prompt in continuation mode, else None."""
    cont = req.continuation
    if cont is None:
        return None
    many = isinstance(cont, list) and cont and not isinstance(cont[0], int)
    conts = list(cont) if many else [cont] * len(prompts)
    if len(conts) != len(prompts):
        raise APIError(f"continuation has {len(conts)} entries for {len(prompts)} prompts",
                       param="continuation", code="invalid_value")
    raw = req.prompt
    pairs = []
    for i, (ids, c) in enumerate(zip(prompts, conts)):
        if isinstance(c, str):
            try:
                check_text(c, "continuation")
            except ValueError as exc:
                raise APIError(str(exc), param="continuation", code="invalid_value") from exc
        text = raw[i] if isinstance(raw, list) and isinstance(raw[i], str) else None
        if isinstance(c, str) and text is not None and ctx.tokenizer is not None:
            pairs.append(encode_pair(ctx.tokenizer, text, c))
        elif isinstance(c, str):
            if ctx.tokenizer is None:
                raise APIError("this model has no tokenizer: send the continuation as token "
                               "ids", param="continuation", code="no_tokenizer")
            pairs.append((ids, ctx.tokenizer.encode(c, add_special_tokens=False)))
        else:
            pairs.append((ids, list(c)))
    for context, continuation in pairs:
        if not continuation:
            raise APIError("continuation is empty: there is nothing to score",
                           param="continuation", code="invalid_value")
        if len(context) + len(continuation) > ctx.max_model_len:
            raise APIError(f"prompt ({len(context)} tokens) + continuation "
                           f"({len(continuation)} tokens) exceed this model's maximum context "
                           f"length of {ctx.max_model_len} tokens", param="continuation",
                           code="context_length_exceeded")
    return pairs


def _token_text(ctx: ServingContext, token: int) -> str:
    if ctx.tokenizer is None:
        return f"token_id:{token}"
    return ctx.tokenizer.decode([token])


def _value(v: float | None) -> float | None:
    return None if v is None else max(v, MIN_LOGPROB)


def _echo_logprobs(ctx: ServingContext, tokens: list[int], values: list[float | None],
                   tops: list[dict | None]) -> tuple[dict, int]:
    body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, value, top in zip(tokens, values, tops):
        text = _token_text(ctx, token)
        body["tokens"].append(text)
        body["token_logprobs"].append(_value(value))
        body["top_logprobs"].append(None if top is None else {
            _token_text(ctx, t): _value(v) for t, v in top.items()})
        body["text_offset"].append(offset)
        offset += len(text)
    return body, offset


def _chain_values(outs: list[LoglikelihoodOutput]) -> tuple[list, list]:
    """Per prompt token (the first has none): its value and {token: value} with the top k."""
    values, tops = [None], [None]
    for out in outs:
        token = out.continuation_token_ids[0]
        values.append(out.logprob)
        tops.append({**(out.top_logprobs[0] if out.top_logprobs else {}), token: out.logprob})
    return values, tops


async def create_echo_completion(ctx: ServingContext, request: Request,
                                 req: CompletionRequest, prompts: list[list[int]]):
    if req.stream:
        raise APIError("echo is not supported with stream=true", param="stream",
                       code="invalid_value")
    if (req.n or 1) > 1:
        raise APIError("echo supports n=1 only", param="n", code="invalid_value")
    max_tokens = req.max_new_tokens(ctx.default_max_tokens)
    pairs = _pairs(ctx, req, prompts)
    if pairs is not None and max_tokens:
        raise APIError("continuation scores a given continuation: set max_tokens to 0",
                       param="continuation", code="invalid_value")
    base_id = f"cmpl-{uuid.uuid4().hex}"
    gen_params = sampling_params(ctx, req, prompts, max_tokens) if max_tokens else None
    subs, groups = [], []                     # groups: per prompt, its scoring submissions
    if req.logprobs is not None:
        for p, ids in enumerate(prompts):
            if pairs is not None:
                context, continuation = pairs[p]
                group = [Submission(f"{base_id}-s{p}", context + continuation,
                                    _scoring_params(ctx, req), len(context))]
            else:                                    # chain rule: token i given x_<i, exact
                params = _scoring_params(ctx, req, mc_num=1, batch_size=1,
                                         logprobs=req.logprobs)
                group = [Submission(f"{base_id}-s{p}-{i}", ids[:i + 1], params, i)
                         for i in range(1, len(ids))]
            groups.append(group)
            subs += group
    streams = await submit(ctx, subs)
    if gen_params is not None:
        streams += await submit_all(ctx, base_id, prompts, gen_params)
    outs = await collect(ctx, streams, request) if streams else []
    if outs is None:
        return JSONResponse({"error": "client disconnected"}, status_code=499)
    scored, generated = outs[:len(subs)], outs[len(subs):]
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for p, ids in enumerate(prompts):
        tokens = ids if pairs is None else pairs[p][0] + pairs[p][1]
        values, tops, extra = [None] * len(tokens), [None] * len(tokens), {}
        if groups:
            group = scored[sum(len(g) for g in groups[:p]):][:len(groups[p])]
            if pairs is None:
                values, tops = _chain_values(group)
            else:
                out = group[0]
                share = out.token_logprobs
                values = [None] * len(pairs[p][0]) + share
                tops = [None] * len(pairs[p][0]) + [
                    {t: v} for t, v in zip(out.continuation_token_ids, share)]
                extra = {"loglikelihood": {"logprob": out.logprob,
                                           "metrics": out.metrics.as_dict()}}
        logprobs, offset = _echo_logprobs(ctx, tokens, values, tops)
        text = "".join(logprobs["tokens"]) if ctx.tokenizer is None else \
            ctx.tokenizer.decode(tokens)
        finish = "length"
        if generated:
            c = generated[p].outputs[0]
            text += c.text
            finish = c.finish_reason
            completion_tokens += len(c.token_ids)
            if c.logprobs is not None:
                more, _ = completion_logprobs(c, 0, len(c.token_ids), offset)
                for key in logprobs:
                    logprobs[key] += more[key]
        prompt_tokens += len(tokens)
        choices.append({"index": p, "text": text,
                        "logprobs": logprobs if req.logprobs is not None else None,
                        "finish_reason": finish, "stop_reason": None, **extra})
    return JSONResponse({"id": base_id, "object": "text_completion", "created": int(time.time()),
                         "model": ctx.model_name, "choices": choices,
                         "usage": {"prompt_tokens": prompt_tokens,
                                   "completion_tokens": completion_tokens,
                                   "total_tokens": prompt_tokens + completion_tokens}})
