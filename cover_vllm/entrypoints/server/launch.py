"""Starting the server: `cover-vllm serve` (uvicorn in the foreground) and `ServerThread` (uvicorn
in a background thread on a free loopback port, for tests and notebooks)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine
from cover_vllm.entrypoints.server.app import MAX_BODY_BYTES, build_app


@dataclass(frozen=True)
class ServeArgs:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    decoding: str = "cover"
    kv_cache: str = "dual"
    max_num_seqs: int = 64
    api_key: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"
    threads: int | None = None
    seed: int = 0
    max_body_bytes: int = MAX_BODY_BYTES
    log_level: str = "info"


def make_engine(args: ServeArgs) -> Engine:
    return Engine(EngineConfig(model=args.model, decoding=args.decoding, kv_cache=args.kv_cache,
                               max_num_seqs=args.max_num_seqs, load_format=args.load_format,
                               num_threads=args.threads, seed=args.seed))


def run_server(args: ServeArgs) -> None:
    """Serve until interrupted (Ctrl-C)."""
    import uvicorn

    app = build_app(make_engine(args), args.served_model_name, args.api_key,
                    args.max_body_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)


class ServerThread:
    """uvicorn serving `engine` from a background thread; `url` is http://127.0.0.1:<port>.

    The port is bound here (port 0: the OS picks a free one) before uvicorn starts, so there is
    no race between finding a port and using it.
    """

    def __init__(self, engine: Engine, model_name: str | None = None, api_key: str | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.app = build_app(engine, model_name, api_key)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=logging.WARNING, timeout_graceful_shutdown=5,
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True,
                                        name="cover-vllm-uvicorn")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_loop(self):
        return self.app.state.engine_loop

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
