"""The `cover-vllm serve` and `cover-vllm bench serve` subcommands (registered by cli.py)."""

from __future__ import annotations

import argparse
import json

from cover_vllm.config import EngineConfig
from cover_vllm.entrypoints.cli_types import json_obj, positive_int, positive_ints
from cover_vllm.entrypoints.engine_flags import (MODEL_HELP, add_engine_flags,
                                                  add_vllm_only_flags, engine_kwargs)


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def serve_model(args: argparse.Namespace) -> str:
    """The model of `serve MODEL` or `serve --model MODEL` (vLLM takes both); ValueError when
    neither or two different ones are given."""
    given = {m for m in (args.model, args.model_flag) if m is not None}
    if len(given) != 1:
        raise ValueError("serve needs one model: `cover-vllm serve MODEL` or `--model MODEL`"
                         + (f" (got {sorted(given)})" if given else ""))
    return given.pop()


def serve_args(args: argparse.Namespace):
    """The ServeArgs of a parsed `cover-vllm serve` command line."""
    from cover_vllm.chat import load_chat_template
    from cover_vllm.entrypoints.server import ServeArgs

    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    return ServeArgs(engine=EngineConfig.from_options(serve_model(args), **engine_kwargs(args)),
                     host=args.host, port=args.port, api_key=args.api_key,
                     served_model_name=args.served_model_name, log_level=args.uvicorn_log_level,
                     data_parallel_size=args.data_parallel_size, ray_address=args.ray_address,
                     chat_template=template)


def cmd_serve(args: argparse.Namespace) -> None:
    from cover_vllm.entrypoints.server import run_server

    run_server(serve_args(args))


def cmd_bench_serve(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.serve import (ServeBenchSpec, format_samples, format_table,
                                             run_serve_bench)

    extra = {k: v for k, v in (("decoding", args.decoding), ("block_length", args.block_length),
                               ("decoding_params", args.decoding_params)) if v is not None}
    duration = args.duration if args.duration is not None or args.num_requests else 30.0
    spec = ServeBenchSpec(url=args.url, concurrency=args.concurrency, duration_s=duration,
                          num_requests=args.num_requests, sample_every=args.sample_every,
                          max_tokens=args.max_tokens, model=args.model, api_key=args.api_key,
                          prompts=tuple(args.prompt) if args.prompt else ServeBenchSpec.prompts,
                          extra_body=tuple(extra.items()))
    results = run_serve_bench(spec)
    print(format_table(results))
    print(format_samples(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": vars(args) | {"func": None},
                       "results": [r.as_row() for r in results]}, f, indent=2, default=str)


def add_serve_parsers(sub, bench) -> None:
    """`serve` under the top-level subparsers `sub`, `serve` under `bench`'s subparsers."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'serve' extra)")
    s.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    s.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model as an option (vLLM's `serve --model`); give it or MODEL")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    s.add_argument("--served-model-name", default=None, help="id in /v1/models (default: MODEL)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template for /v1/chat/completions, a file or the template "
                   "itself (default: the tokenizer's)")
    s.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's log level (its access log lists each request at info)")
    add_engine_flags(s)
    s.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                   help="serve N whole engine replicas (Ray actors), least-loaded routing")
    s.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: RAY_ADDRESS, else start a small "
                        "local one); used by --data-parallel-size > 1 and the ray backend")
    add_vllm_only_flags(s)
    s.set_defaults(func=cmd_serve)

    v = bench.add_parser("serve", help="load a running server: req/s, tok/s, TTFT per level")
    v.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    v.add_argument("--concurrency", type=positive_ints, default=(1, 8, 64),
                   help="client levels, comma-separated")
    v.add_argument("--duration", type=float, default=None,
                   help="seconds per concurrency level (default 30, or none with --num-requests)")
    v.add_argument("--num-requests", type=positive_int, default=None,
                   help="requests per concurrency level (a soak: a level ends at this count or "
                        "--duration, whichever comes first)")
    v.add_argument("--sample-every", type=positive_int, default=None,
                   help="read the server's RSS and KV pages from /metrics every N requests "
                        "(always at a level's start and end)")
    v.add_argument("--max-tokens", type=positive_int, default=64, help="per request")
    v.add_argument("--model", default=None, help="default: the server's first model")
    v.add_argument("--prompt", action="append", default=None, help="repeat for several prompts")
    v.add_argument("--decoding", default=None, help="default: the server's")
    v.add_argument("--block-length", type=positive_int, default=None,
                   help="default: the model's")
    v.add_argument("--decoding-params", type=json_obj, default=None)
    v.add_argument("--api-key", default=None)
    v.add_argument("--json", default=None)
    v.set_defaults(func=cmd_bench_serve)
