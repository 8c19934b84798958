"""Starting the server: `cover-vllm serve` (uvicorn in the foreground) and `ServerThread` (uvicorn
in a background thread on a free loopback port, for tests and notebooks).

Parallelism: `tensor_parallel_size` / `distributed_executor_backend` go into the EngineConfig;
`data_parallel_size` > 1 serves that many whole engines (Ray actors) behind a DPRouter, on the
Ray cluster at `ray_address` when given, else on a small local Ray instance (RAY_ADDRESS is
honoured too). A named cluster means Ray for the tensor-parallel ranks too: with `ray_address`
and no backend chosen they are Ray actors (as vLLM picks Ray when given a cluster), and an
explicit "mp" that would leave the cluster unused is refused, saying what to pass.

A server whose engine can never serve again shuts itself down (app.py's watchdog):
`cover-vllm serve` then exits with status 1, `ServerThread` stops serving (`fatal_error`)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from cover_vllm.chat import load_chat_template
from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine
from cover_vllm.entrypoints.server.app import MAX_BODY_BYTES, build_app


@dataclass(frozen=True)
class ServeArgs:
    """What `cover-vllm serve` runs: the engine's config (every engine option, EngineConfig)
    and the server's own settings."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    log_level: str = "info"
    data_parallel_size: int = 1
    ray_address: str | None = None
    chat_template: str | None = None     # the template's text (chat.load_chat_template)

    @property
    def engine_config(self) -> EngineConfig:
        """`engine`, its tensor-parallel ranks on Ray when a cluster is named (`ray_address`)
        and no backend was chosen."""
        e = self.engine
        if self.ray_address is not None and e.tensor_parallel_size > 1 and \
                e.distributed_executor_backend is None:
            return e.with_overrides(distributed_executor_backend="ray")
        return e

    @property
    def needs_ray(self) -> bool:
        return (self.data_parallel_size > 1
                or self.engine_config.distributed_executor_backend == "ray")


def make_app(args: ServeArgs):
    """The app for `args`: one Engine, or a DPRouter over `data_parallel_size` replicas."""
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
    config = args.engine_config
    if args.ray_address is not None and not args.needs_ray:
        if config.tensor_parallel_size > 1:
            raise ValueError(
                f"ray_address={args.ray_address!r} names a Ray cluster, but "
                "distributed_executor_backend='mp' runs the tensor-parallel ranks as local "
                "processes and nothing else would use the cluster: pass "
                "--distributed-executor-backend ray to run them there, or drop --ray-address")
        logging.getLogger(__name__).warning(
            "ray_address is ignored: nothing uses Ray without data_parallel_size > 1 or "
            "tensor_parallel_size > 1")
    source = config if args.data_parallel_size > 1 else Engine(config)
    app = build_app(source, args.served_model_name, args.api_key, args.max_body_bytes,
                    data_parallel_size=args.data_parallel_size)
    if args.chat_template is not None:       # every chat request renders with it
        app.state.ctx.chat_template = load_chat_template(args.chat_template)
    return app


def connect_ray(args: ServeArgs) -> bool:
    """Join the cluster at `args.ray_address` (when Ray is needed); True if connected here."""
    if args.ray_address is None or not args.needs_ray:
        return False
    from cover_vllm.executor.ray_ranks import ray_module

    ray = ray_module()
    if ray.is_initialized():
        return False
    ray.init(address=args.ray_address, configure_logging=False)
    return True


def run_server(args: ServeArgs) -> None:
    """Serve until interrupted (Ctrl-C), or until the engine can never serve again: then exit
    with status 1 (SystemExit) so that a supervisor restarts the server."""
    import uvicorn

    joined = connect_ray(args)
    try:
        app = make_app(args)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level=args.log_level,
                                               timeout_graceful_shutdown=5))
        app.state.on_fatal = lambda reason: setattr(server, "should_exit", True)
        server.run()
        if app.state.fatal_error is not None:
            raise SystemExit(f"cover-vllm serve: exiting because the engine died: "
                             f"{app.state.fatal_error}")
    finally:
        if joined:
            import ray

            ray.shutdown()                        # disconnects; the cluster keeps running


class ServerThread:
    """uvicorn serving `engine` from a background thread; `url` is http://127.0.0.1:<port>.

    The port is bound here (port 0: the OS picks a free one) before uvicorn starts, so there is
    no race between finding a port and using it.
    """

    def __init__(self, engine: Engine | EngineConfig | None = None, model_name: str | None = None,
                 api_key: str | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 data_parallel_size: int = 1, app=None):
        import uvicorn

        self.app = app if app is not None else build_app(
            engine, model_name, api_key, data_parallel_size=data_parallel_size)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=logging.WARNING, timeout_graceful_shutdown=5,
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self.app.state.on_fatal = lambda reason: setattr(self._server, "should_exit", True)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True,
                                        name="cover-vllm-uvicorn")

    @classmethod
    def from_args(cls, args: ServeArgs) -> "ServerThread":
        """What `cover-vllm serve` would build for `args`, on args.host and args.port (0: a
        free port). Joining args.ray_address is the caller's business (see connect_ray)."""
        return cls(host=args.host, port=args.port, app=make_app(args))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_loop(self):
        return self.app.state.engine_loop

    @property
    def fatal_error(self) -> str | None:
        """Why the server shut itself down (its engine died), else None."""
        return self.app.state.fatal_error

    @property
    def running(self) -> bool:
        """uvicorn still serves (False once stopped, or shut down by a dead engine)."""
        return self._thread.is_alive()

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
