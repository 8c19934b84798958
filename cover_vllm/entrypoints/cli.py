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


def cmd_generate(args: argparse.Namespace) -> None:
    from cover_vllm import LLM, SamplingParams

    llm = LLM(args.model, decoding=args.decoding, kv_cache=args.kv_cache,
              load_format=args.load_format, dtype=args.dtype,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              memory_utilization=args.memory_utilization)
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
    params = _decoding_params(args.decoding_params, args.decoding)
    spec = EvalSpec(model=args.model, tasks=tuple(tasks), decodings=args.decoding, num=args.num,
                    seed=args.seed, tokens_per_step=args.tokens_per_step, kv_cache=args.kv_cache,
                    decoding_params=tuple(params.items()), use_tqdm=not args.no_tqdm)
    def progress(row) -> None:
        k = "" if row.k is None else f" k={row.k}"
        print(f"[eval] {row.task} {row.decoding}{k}: accuracy {row.accuracy:.1%}, "
              f"NFE {row.nfe:.1f}, {row.seconds:.0f}s", file=sys.stderr, flush=True)

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
    return ThroughputSpec(model=args.model, decodings=args.decoding, kv_caches=args.kv_cache,
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


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """--dtype, --kv-cache-memory-bytes, --memory-utilization (engine memory options)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="explicit KV pool size (default: sized from --memory-utilization)")
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="share of host (CPU) or device memory for weights + KV cache")


def cmd_make_checkpoint(args: argparse.Namespace) -> None:
    import torch

    from cover_vllm.models.builtin import resolve_model
    from cover_vllm.models.checkpoint_writer import CheckpointSpec, write_checkpoint

    spec = CheckpointSpec(config=resolve_model(args.shape).config,
                          dtype=getattr(torch, args.dtype), seed=args.seed,
                          max_shard_bytes=args.max_shard_bytes)
    index = write_checkpoint(spec, args.out)
    shards = len(set(index["weight_map"].values()))
    print(f"wrote {index['metadata']['total_size'] / 2**30:.2f} GiB in {shards} shard(s) to "
          f"{args.out}")


def cmd_bench_scale(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.scale import ScaleSpec, format_scale, run_scale

    spec = ScaleSpec(model=args.model, dtype=args.dtype,
                     tensor_parallel_size=args.tensor_parallel_size,
                     kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                     memory_utilization=args.memory_utilization, threads=args.threads,
                     input_len=args.input_len, output_len=args.output_len,
                     batch_sizes=args.batch_size, seed=args.seed, logits_path=args.dump_logits)
    report = run_scale(spec, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_scale(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _bench_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="cover-tiny")
    p.add_argument("--decoding", type=_csv, default=("low_confidence",))
    p.add_argument("--decoding-params", type=_json_obj, default=None)
    p.add_argument("--kv-cache", type=_csv, default=("dual",))
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
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--block-length", type=int, default=None)
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    add_memory_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in the "
                       "official layout (config.json, index, <= 5 GB shards)")
    m.add_argument("--shape", required=True, help="built-in shape (llada-8b, llada-1.5, "
                   "dream-7b, dream-coder-7b, llada-moe-7b, llada-300m, ...) or a dir with "
                   "config.json")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--max-shard-bytes", type=int, default=5_000_000_000)
    m.set_defaults(func=cmd_make_checkpoint)

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
    e.add_argument("--kv-cache", default="none", choices=["none", "prefix", "dual"],
                   help="none (default) is exact; the tasks decode their answer as one block, "
                   "so prefix/dual freeze the prompt K/V of a fully masked answer")
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
    sc = b.add_parser("scale", help="load seconds, peak memory, s/step and tok/s of a "
                      "full-size model (run in a fresh process)")
    sc.add_argument("--model", required=True)
    add_memory_args(sc)
    sc.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    sc.add_argument("--threads", type=int, default=None, help="torch threads (pinned, reported)")
    sc.add_argument("--input-len", type=int, default=16)
    sc.add_argument("--output-len", type=int, default=32)
    sc.add_argument("--batch-size", type=_ints, default=(1, 4))
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("--dump-logits", default=None, help="save the first forward's logits here")
    sc.add_argument("--json", default=None)
    sc.set_defaults(func=cmd_bench_scale)
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
