"""The OpenAI-compatible HTTP server (`cover-vllm serve`): FastAPI routes over one engine thread.

Needs the `serve` extra (fastapi, uvicorn, pydantic, prometheus-client); importing this package
without it raises an ImportError naming the extra.
"""

_SERVE_DEPS = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "starlette")

try:
    from cover_vllm.entrypoints.server.app import build_app
    from cover_vllm.entrypoints.server.launch import ServeArgs, ServerThread, run_server
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    if (exc.name or "").split(".")[0] not in _SERVE_DEPS:
        raise
    raise ImportError(f"the server needs the 'serve' extra: pip install 'cover-vllm[serve]' "
                      f"(missing {exc.name})") from exc

__all__ = ["ServeArgs", "ServerThread", "build_app", "run_server"]
