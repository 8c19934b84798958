"""OpenAI-style API errors: the one exception the server raises for bad input, and its JSON body.

Every rejected request gets `{"error": {"message", "type", "param", "code"}}` with a 4xx status
naming the offending field; engine-side ValueError/TypeError messages are mapped to the field they
name. Not a place for validation rules (those live in protocol.py).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from pydantic import ValidationError

logger = logging.getLogger(__name__)

# Fields an engine or SamplingParams message may name, most specific first.
_FIELDS = ("chat_template_kwargs", "continue_final_message", "min_tokens", "min_p",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
           "include_stop_str_in_output", "decoding_params", "stop_token_ids", "max_tokens", "block_length", "temperature",
           "top_p", "top_k", "steps", "seed", "stop", "decoding", "cache_refresh", "kv_cache",
           "ignore_eos", "top_logprobs", "logprobs",
           "prompt_token_ids", "prompt", "messages")
_FIELD_RE = re.compile(r"\b(structured_outputs(?:\.\w+)?|response_format(?:\.\w+)*|"
                       + "|".join(_FIELDS) + r")\b")


class APIError(Exception):
    """A request the server refuses; rendered as an OpenAI error body with `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.code, self.type = code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def server_error(message: str) -> APIError:
    """The engine failed on this one request (the server keeps serving)."""
    return APIError(message, status=500, type="server_error", code="engine_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _loc(loc: tuple) -> str:
    """Dotted field path without pydantic's union-member tags ('stop.str' -> 'stop')."""
    parts = []
    for p in loc:
        text = str(p)
        if text in _TYPE_TAGS or "[" in text or text.startswith("function-"):
            break
        parts.append(text)
    return ".".join(parts)


def from_validation_error(exc: ValidationError,
                          hint: Callable[[str], str | None] | None = None) -> APIError:
    """The first pydantic error as an APIError whose param is the field's dotted path; `hint`
    words the error for an unknown field it knows (e.g. one vLLM renamed)."""
    err = exc.errors(include_url=False)[0]
    param = _loc(err["loc"]) or None
    if err["type"] == "extra_forbidden":
        message = (hint and param and hint(param)) or f"unknown or unsupported field '{param}'"
    elif err["type"] == "missing":
        message = f"'{param}' is a required field"
    else:
        msg = err["msg"].removeprefix("Value error, ")
        message = f"'{param}': {msg}" if param else msg
        if err["type"] not in ("value_error", "assertion_error") and "input" in err:
            message += f" (got {_short(err['input'])})"
    return APIError(message, param=param, code=err["type"])


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def from_value_error(exc: Exception, default_param: str | None = None) -> APIError:
    """A ValueError/TypeError from SamplingParams, a strategy or the engine, as a 400."""
    message = str(exc).replace("SamplingParams.", "")
    found = _FIELD_RE.search(message)
    param = found.group(1) if found else default_param
    if param == "prompt_token_ids":
        param = "prompt"
    return APIError(message, param=param, code="invalid_value")


def model_not_found(name: str) -> APIError:
    return APIError(f"The model `{name}` does not exist.", param="model", status=404,
                    code="model_not_found")


class InternalErrors:
    """ASGI middleware: an exception no handler took becomes a 500 with an OpenAI error body,
    and the keep-alive connection serves the next request. (Starlette's outermost
    ServerErrorMiddleware answers such an exception and then raises it again, and uvicorn closes
    the connection of an app that raised: the client's next request met a reset.) A response
    already under way cannot be replaced; that exception goes on up."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error on %s", scope.get("path"))
            from fastapi.responses import JSONResponse

            body = APIError(f"internal server error: {type(exc).__name__}", status=500,
                            type="server_error").body()
            await JSONResponse(body, status_code=500)(scope, receive, send)
