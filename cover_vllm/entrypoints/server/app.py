"""The FastAPI app: routes, the API-key check, size-limited JSON bodies and OpenAI-style errors.

`build_app(engine, ...)` wires one Engine (driven by an EngineLoop thread started with the app),
or with `data_parallel_size` > 1 a DPRouter over that many engine replicas (Ray actors), to
GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health and GET /metrics.
Every refused request gets a 4xx with an OpenAI error body; nothing a client sends can stop the
server. What does stop it is an engine that can never serve again (EngineClient.fatal: a dead
tensor-parallel worker, or every data-parallel replica dead for good): a watchdog task logs why,
records it in `app.state.fatal_error` and calls `app.state.on_fatal` (the launcher's: uvicorn
shuts down and `cover-vllm serve` exits non-zero, so a supervisor restarts it). Request
semantics live in serving.py, field rules in protocol.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine
from cover_vllm.entrypoints.server import scoring, serving
from cover_vllm.entrypoints.server.client import EngineClient
from cover_vllm.entrypoints.server.engine_loop import EngineLoop, EngineRequestError
from cover_vllm.entrypoints.server.errors import (APIError, InternalErrors,
                                                  from_validation_error)
from cover_vllm.entrypoints.server.metrics import ServerMetrics
from cover_vllm.entrypoints.server.protocol import ChatRequest, CompletionRequest
from cover_vllm.entrypoints.server.structured import unknown_field_hint
from cover_vllm.models.builtin import local_config, resolve_engine_model
from cover_vllm.models.spec import ModelSpec

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20          # 1 MiB
WATCHDOG_PERIOD_S = 0.5           # how often the watchdog asks the engine client if it is dead


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 400 unless sent as application/json (vLLM's rule), 413 past
    `limit` bytes, 400 for non-UTF-8 or invalid JSON."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError("Unsupported Media Type: Only 'application/json' is allowed (got "
                       f"Content-Type {media_type or 'none'!r})", code="unsupported_media_type")
    too_big = APIError(f"request body exceeds the limit of {limit} bytes", status=413,
                       code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"request body is not valid UTF-8 (bad byte at offset {exc.start})",
                       code="invalid_encoding") from exc
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise APIError(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(obj, dict):
        raise APIError(f"request body must be a JSON object, got {type(obj).__name__}",
                       code="invalid_json")
    return obj


def _parse(model: type[BaseModel], obj: dict) -> Any:
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise from_validation_error(exc, hint=unknown_field_hint) from exc


def _check_key(request: Request) -> None:
    key = request.app.state.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise APIError("Incorrect API key provided (send 'Authorization: Bearer <key>')",
                       status=401, code="invalid_api_key")


def _ctx(request: Request) -> serving.ServingContext:
    return request.app.state.ctx


async def list_models(request: Request) -> dict:
    _check_key(request)
    ctx = _ctx(request)
    return {"object": "list", "data": [
        {"id": ctx.model_name, "object": "model", "created": ctx.created,
         "owned_by": "cover_vllm", "max_model_len": ctx.max_model_len}]}


async def retrieve_model(request: Request, model: str) -> dict:
    _check_key(request)
    serving.check_model(_ctx(request), model)
    return (await list_models(request))["data"][0]


async def completions(request: Request):
    _check_key(request)
    req = _parse(CompletionRequest, await read_json(request, request.app.state.max_body_bytes))
    ctx = _ctx(request)
    serving.check_model(ctx, req.model)
    scoring.check_scoring_fields(req)
    many = len(req.prompt) > 1
    prompts = [serving.tokenize(ctx, p, f"prompt[{i}]" if many else "prompt")
               for i, p in enumerate(req.prompt)]
    if req.echo:                # echo: the prompt's values (scoring.py)
        return await scoring.create_echo_completion(ctx, request, req, prompts)
    return await serving.create_completion(ctx, request, req, prompts)


async def chat_completions(request: Request):
    _check_key(request)
    req = _parse(ChatRequest, await read_json(request, request.app.state.max_body_bytes))
    return await serving.create_chat_completion(_ctx(request), request, req)


async def version(request: Request) -> dict:
    """vLLM's GET /version: the package version."""
    from cover_vllm import __version__

    return {"version": __version__}


async def health(request: Request) -> Response:
    """200 while requests can be served, else 503 with why. A data-parallel server stays 200
    while one replica serves; the body then names the replicas that are down (degraded)."""
    loop = _ctx(request).loop
    problem = loop.health()
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "error": problem}, status_code=503)
    counts = loop.replica_counts() if hasattr(loop, "replica_counts") else []
    down = [c["index"] for c in counts if not c["alive"]]
    if down:
        return JSONResponse({"status": "degraded", "replicas_down": down})
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(f"{exc.detail}: {request.method} {request.url.path}",
                                        status=exc.status_code, code=code))

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        return _error_response(APIError(f"invalid request: {first.get('msg', exc)}",
                                        param=param))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_middleware(InternalErrors)    # any other exception: a 500, the connection kept


def build_app(engine: Engine | EngineConfig, model_name: str | None = None,
              api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              data_parallel_size: int = 1) -> FastAPI:
    """An app serving `engine` as `model_name` (default: the engine's model argument).

    `engine` may be an EngineConfig (the engine is built here); with `data_parallel_size` > 1
    it must be one, and each of the replicas (Ray actors behind a DPRouter) builds its own.
    """
    config = engine if isinstance(engine, EngineConfig) else engine.config
    name = model_name or config.model
    stats = ServerMetrics(name)
    if data_parallel_size > 1:
        if not isinstance(engine, EngineConfig):
            raise TypeError("data_parallel_size > 1 needs an EngineConfig, not an Engine: "
                            "every replica builds its own engine")
        from cover_vllm.entrypoints.server.dp_router import DPRouter

        resolved = resolve_engine_model(config)      # a hub id is downloaded once, here
        spec = ModelSpec.from_config(resolved.config).with_max_model_len(config.max_model_len)
        max_model_len = spec.max_model_len
        default_decoding = config.decoding or spec.default_decoding
        default_max_tokens = resolved.max_new_tokens()
        tokenizer = _server_tokenizer(resolved.tokenizer_dir)   # before the replicas: fail early
        router = DPRouter(local_config(config, resolved), data_parallel_size,
                          error_cls=EngineRequestError, metrics=stats)
        stats.watch_replicas(router.replica_counts)
        loop: EngineClient = router
    else:
        if isinstance(engine, EngineConfig):
            engine = Engine(engine)
        max_model_len, tokenizer = engine.spec.max_model_len, _server_tokenizer(
            engine.tokenizer_dir)
        default_max_tokens = engine.default_max_tokens
        default_decoding = engine.config.decoding           # resolved by the engine
        loop = EngineLoop(engine, stats)

    if tokenizer is None:
        logger.warning("%s has no tokenizer: send prompts as token ids; responses carry the "
                       "generated ids (choices[].token_ids, vLLM's return_token_ids form) and "
                       "empty text", name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        watchdog = asyncio.get_running_loop().create_task(_watch_engine(app, loop))
        try:
            yield
        finally:
            watchdog.cancel()
            loop.stop()

    app = FastAPI(title="cover_vllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = serving.ServingContext(
        loop=loop, model_name=name, tokenizer=tokenizer, max_model_len=max_model_len,
        default_max_tokens=default_max_tokens,
        default_decoding=default_decoding, created=int(time.time()),
        seeds=random.Random(config.seed))
    app.state.metrics, app.state.api_key = stats, api_key
    app.state.max_body_bytes, app.state.engine_loop = max_body_bytes, loop
    app.state.fatal_error, app.state.on_fatal = None, None
    _install_error_handlers(app)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app


async def _watch_engine(app: FastAPI, loop: EngineClient,
                        period_s: float = WATCHDOG_PERIOD_S) -> None:
    """Wait until `loop` can never serve again; then ask the launcher to shut the server down
    (`app.state.on_fatal`). The dead engine has failed its requests already; the shutdown's
    `loop.stop()` fails anything still open."""
    while (reason := loop.fatal()) is None:
        await asyncio.sleep(period_s)
    logger.critical("the engine can no longer serve (%s); shutting the server down so that "
                    "its supervisor restarts it", reason)
    app.state.fatal_error = reason
    if app.state.on_fatal is not None:
        app.state.on_fatal(reason)


def _server_tokenizer(path):
    """The event-loop thread's own tokenizer from the engine's tokenizer directory (HF fast
    tokenizers are not safe to share across threads, and a data-parallel server has no local
    engine), or None when there is none."""
    from cover_vllm.tokenizer import has_tokenizer, load_tokenizer

    return load_tokenizer(path) if path is not None and has_tokenizer(path) else None
