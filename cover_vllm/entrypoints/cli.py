"""The `cover-vllm` command line: generate, eval, serve, bench (also `python -m cover_vllm`)."""

from __future__ import annotations

import argparse
import json
import sys


def _csv(value: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _ints(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _csv(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from exc


def _json_obj(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def _cache_choices(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--kv-cache and --cache-refresh lists, validated (ValueError naming the bad value)."""
    from cover_vllm.cache_refresh import parse_cache_refresh
    from cover_vllm.config import KV_CACHE_MODES

    bad = [m for m in args.kv_cache if m not in KV_CACHE_MODES]
    if bad:
        raise ValueError(f"kv_cache={bad[0]!r}; choose one of {list(KV_CACHE_MODES)}")
    return args.kv_cache, tuple(parse_cache_refresh(p).label for p in args.cache_refresh)


def cmd_generate(args: argparse.Namespace) -> None:
    from cover_vllm import LLM, SamplingParams

    llm = LLM(args.model, decoding=args.decoding, kv_cache=args.kv_cache,
              cache_refresh=args.cache_refresh, load_format=args.load_format)
    sp = SamplingParams(max_tokens=args.max_tokens, block_length=args.block_length,
                        steps=args.steps, temperature=args.temperature,
                        decoding_params=args.decoding_params)
    messages = [{"role": "user", "content": args.prompt}]
    out = (llm.chat(messages, sp, use_tqdm=False) if args.chat
           else llm.generate([args.prompt], sp, use_tqdm=False))[0]
    print(out.outputs[0].text)
    m = out.metrics
    print(f"[{out.outputs[0].finish_reason}] nfe={m.nfe} steps={m.steps} "
          f"tokens/step={m.tokens_per_step:.2f} remasks={m.remasks} latency={m.latency_s:.3f}s",
          file=sys.stderr)


def cmd_eval(args: argparse.Namespace) -> None:
    from cover_vllm.eval import EvalSpec, format_table, run_eval, write_json
    from cover_vllm.tasks import list_tasks

    if args.list_tasks:
        print("\n".join(list_tasks()))
        return
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    tasks = list_tasks() if args.task == ("all",) else args.task
    kv_caches, refreshes = _cache_choices(args)
    params = _decoding_params(args.decoding_params, args.decoding)
    spec = EvalSpec(model=args.model, tasks=tuple(tasks), decodings=args.decoding, num=args.num,
                    seed=args.seed, tokens_per_step=args.tokens_per_step, kv_cache=kv_caches,
                    cache_refresh=refreshes, decoding_params=tuple(params.items()),
                    use_tqdm=not args.no_tqdm)
    def progress(row) -> None:
        k = "" if row.k is None else f" k={row.k}"
        print(f"[eval] {row.task} {row.decoding}{k} {row.kv_cache} {row.cache_refresh}: "
              f"accuracy {row.accuracy:.1%}, NFE {row.nfe:.2f}, refreshes {row.refreshes:.2f}, "
              f"FLOPs/token {row.flops_per_token:.4g}, {row.seconds:.0f}s", file=sys.stderr,
              flush=True)

    rows = run_eval(spec, on_row=progress)
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json)


def _decoding_params(value: dict | None, decodings: tuple[str, ...]) -> dict:
    """--decoding-params: {"knob": v} for a single strategy, or {"strategy": {...}, ...}."""
    params = value or {}
    if params and not all(isinstance(v, dict) for v in params.values()):
        if len(decodings) != 1:
            raise SystemExit("--decoding-params: with several strategies give "
                             '{"<strategy>": {...}, ...}')
        params = {decodings[0]: params}
    return params


def _bench_spec(args: argparse.Namespace):
    from cover_vllm.benchmarks.throughput import ThroughputSpec

    params = _decoding_params(args.decoding_params, args.decoding)
    kv_caches, refreshes = _cache_choices(args)
    return ThroughputSpec(model=args.model, decodings=args.decoding, kv_caches=kv_caches,
                          cache_refreshes=refreshes,
                          batch_sizes=getattr(args, "batch_size", (1,)),
                          num_prompts=getattr(args, "num_prompts", None),
                          input_len=args.input_len, output_len=args.output_len,
                          block_length=args.block_length, steps=args.steps, threads=args.threads,
                          seed=args.seed, task=args.task,
                          reference_prompts=getattr(args, "reference_prompts", 0),
                          decoding_params=tuple(params.items()))


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.report import format_markdown, format_table, write_plot
    from cover_vllm.benchmarks.throughput import run_throughput

    report = run_throughput(_bench_spec(args))
    print(format_table(report["results"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(report, "cover-vllm " + " ".join(sys.argv[1:])))
    if args.plot:
        write_plot(report, args.plot)


def cmd_bench_latency(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.latency import (format_latency, format_verification,
                                               run_latency, run_verification_cost)

    spec = _bench_spec(args)
    rows = run_latency(spec, repeats=args.repeats)
    print(format_latency(rows))
    verification = []
    if "cover" in spec.decodings:
        verification = run_verification_cost(spec, repeats=args.repeats)
        print("\nCOVER verification over identical windows (recorded steps replayed with and "
              "without their seeds):")
        print(format_verification(verification))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows, "verification": verification}, f, indent=2)


def _bench_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="cover-tiny")
    p.add_argument("--decoding", type=_csv, default=("low_confidence",))
    p.add_argument("--decoding-params", type=_json_obj, default=None)
    p.add_argument("--kv-cache", type=_csv, default=("dual",))
    p.add_argument("--cache-refresh", type=_csv, default=("block",),
                   help="refresh policies for prefix/dual rows, comma-separated: block, "
                   "interval:N, adaptive")
    p.add_argument("--task", default=None, help="prompts from a task's held-out split")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (pinned, reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cover-vllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate once from a prompt")
    g.add_argument("model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--decoding", default="cover")
    g.add_argument("--decoding-params", type=_json_obj, default=None)
    g.add_argument("--kv-cache", default="dual", choices=["none", "prefix", "dual"])
    g.add_argument("--cache-refresh", default="block",
                   help="block (default), interval:N or adaptive")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--block-length", type=int, default=None)
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="accuracy/NFE of strategies on verifiable tasks")
    e.add_argument("--model", default="cover-tiny")
    e.add_argument("--task", type=_csv, default=("all",), help="task names or 'all'")
    e.add_argument("--decoding", type=_csv, default=("low_confidence", "threshold"))
    e.add_argument("--decoding-params", type=_json_obj, default=None,
                   help='JSON: {"threshold": 0.8} or {"threshold": {"threshold": 0.8}, ...}')
    e.add_argument("--tokens-per-step", type=_ints, default=(1,),
                   help="for fixed-schedule strategies: run once per k (steps = max_tokens/k)")
    e.add_argument("--num", type=int, default=200)
    e.add_argument("--seed", type=int, default=None,
                   help="draw fresh problems from this seed (default: the held-out split)")
    e.add_argument("--kv-cache", type=_csv, default=("none",),
                   help="none (default) is exact; prefix/dual (comma-separated: one row each) "
                   "reuse K/V between refreshes (--cache-refresh)")
    e.add_argument("--cache-refresh", type=_csv, default=("block",),
                   help="refresh policies for prefix/dual rows, comma-separated: block, "
                   "interval:N, adaptive")
    e.add_argument("--json", default=None, help="write one object per (task, decoding) here")
    e.add_argument("--list-tasks", action="store_true")
    e.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; use 1 when other jobs share the cores)")
    e.add_argument("--no-tqdm", action="store_true")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    t = b.add_parser("throughput", help="tokens/s per decoding x kv_cache x batch size")
    _bench_common(t)
    t.add_argument("--batch-size", type=_ints, default=(1,))
    t.add_argument("--num-prompts", type=int, default=None, help="default: 2 x batch size")
    t.add_argument("--reference-prompts", type=int, default=1,
                   help="requests timed through the dense reference loop (0: skip)")
    t.add_argument("--markdown", default=None)
    t.add_argument("--plot", default=None, help="PNG: accuracy vs tokens/s, NFE/token bars")
    t.set_defaults(func=cmd_bench_throughput)
    lat = b.add_parser("latency", help="one request: per-step time by engine phase")
    _bench_common(lat)
    lat.add_argument("--repeats", type=int, default=3)
    lat.set_defaults(func=cmd_bench_latency)
    from cover_vllm.entrypoints.serve_cli import add_serve_parsers

    add_serve_parsers(sub, b)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"cover-vllm: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
