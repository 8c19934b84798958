"""The `cover-vllm serve` and `cover-vllm bench serve` subcommands (registered by cli.py)."""

from __future__ import annotations

import argparse
import json

from cover_vllm.entrypoints.cli import (KV_CACHES, LOAD_FORMATS, _json_obj, _positive_int,
                                        _positive_ints, add_memory_args, add_threads_arg)


def serve_args(args: argparse.Namespace):
    """The ServeArgs of a parsed `cover-vllm serve` command line."""
    from cover_vllm.entrypoints.server import ServeArgs

    return ServeArgs(model=args.model, host=args.host, port=args.port, decoding=args.decoding,
                     kv_cache=args.kv_cache, cache_refresh=args.cache_refresh,
                     max_num_seqs=args.max_num_seqs,
                     api_key=args.api_key, served_model_name=args.served_model_name,
                     load_format=args.load_format, threads=args.threads, seed=args.seed,
                     tensor_parallel_size=args.tensor_parallel_size,
                     distributed_executor_backend=args.distributed_executor_backend,
                     data_parallel_size=args.data_parallel_size, ray_address=args.ray_address,
                     dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                     memory_utilization=args.memory_utilization)


def cmd_serve(args: argparse.Namespace) -> None:
    from cover_vllm.entrypoints.server import run_server

    run_server(serve_args(args))


def cmd_bench_serve(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.serve import ServeBenchSpec, format_table, run_serve_bench

    extra = {k: v for k, v in (("decoding", args.decoding), ("block_length", args.block_length),
                               ("decoding_params", args.decoding_params)) if v is not None}
    spec = ServeBenchSpec(url=args.url, concurrency=args.concurrency, duration_s=args.duration,
                          max_tokens=args.max_tokens, model=args.model, api_key=args.api_key,
                          prompts=tuple(args.prompt) if args.prompt else ServeBenchSpec.prompts,
                          extra_body=tuple(extra.items()))
    results = run_serve_bench(spec)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": vars(args) | {"func": None},
                       "results": [r.as_row() for r in results]}, f, indent=2, default=str)


def add_serve_parsers(sub, bench) -> None:
    """`serve` under the top-level subparsers `sub`, `serve` under `bench`'s subparsers."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'serve' extra)")
    s.add_argument("model", help="built-in name or model directory")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--decoding", default="cover", help="default strategy (per request: decoding)")
    s.add_argument("--kv-cache", default="dual", choices=KV_CACHES)
    s.add_argument("--cache-refresh", default="block",
                   help="default refresh policy: block, interval:N or adaptive (per request: "
                   "the cache_refresh body field)")
    s.add_argument("--max-num-seqs", type=_positive_int, default=64,
                   help="requests decoded together")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    s.add_argument("--served-model-name", default=None, help="id in /v1/models (default: MODEL)")
    s.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    add_memory_args(s)
    add_threads_arg(s)
    s.add_argument("--seed", type=int, default=0, help="engine seed")
    s.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="shard each engine's model over N worker processes")
    s.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="how tensor-parallel workers run (default: mp)")
    s.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                   help="serve N whole engine replicas (Ray actors), least-loaded routing")
    s.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: RAY_ADDRESS, else start a small "
                        "local one); used by --data-parallel-size > 1 and the ray backend")
    s.set_defaults(func=cmd_serve)

    v = bench.add_parser("serve", help="load a running server: req/s, tok/s, TTFT per level")
    v.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    v.add_argument("--concurrency", type=_positive_ints, default=(1, 8, 64),
                   help="client levels, comma-separated")
    v.add_argument("--duration", type=float, default=30.0, help="seconds per concurrency level")
    v.add_argument("--max-tokens", type=_positive_int, default=64, help="per request")
    v.add_argument("--model", default=None, help="default: the server's first model")
    v.add_argument("--prompt", action="append", default=None, help="repeat for several prompts")
    v.add_argument("--decoding", default=None, help="default: the server's")
    v.add_argument("--block-length", type=_positive_int, default=None,
                   help="default: the model's")
    v.add_argument("--decoding-params", type=_json_obj, default=None)
    v.add_argument("--api-key", default=None)
    v.add_argument("--json", default=None)
    v.set_defaults(func=cmd_bench_serve)
