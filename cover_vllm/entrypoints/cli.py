"""The `cover-vllm` command line: generate, eval, bench (also `python -m cover_vllm`)."""

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
              load_format=args.load_format)
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
    tasks = list_tasks() if args.task == ("all",) else args.task
    params = args.decoding_params or {}
    if params and not all(isinstance(v, dict) for v in params.values()):
        params = {args.decoding[0]: params} if len(args.decoding) == 1 else None
        if params is None:
            raise SystemExit("--decoding-params: with several strategies give "
                             '{"<strategy>": {...}, ...}')
    spec = EvalSpec(model=args.model, tasks=tuple(tasks), decodings=args.decoding, num=args.num,
                    seed=args.seed, tokens_per_step=args.tokens_per_step, kv_cache=args.kv_cache,
                    decoding_params=tuple(params.items()), use_tqdm=not args.no_tqdm)
    rows = run_eval(spec)
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json)


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.throughput import (ThroughputSpec, format_table, rows_as_dicts,
                                                  run_throughput)

    spec = ThroughputSpec(model=args.model, decodings=args.decoding, kv_caches=args.kv_cache,
                          batch_sizes=args.batch_size, num_prompts=args.num_prompts,
                          input_len=args.input_len, output_len=args.output_len,
                          block_length=args.block_length, steps=args.steps,
                          threads=args.threads, seed=args.seed)
    rows = run_throughput(spec)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": vars(args) | {"func": None}, "results": rows_as_dicts(rows)}, f,
                      indent=2, default=str)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cover-vllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate once from a prompt")
    g.add_argument("model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--decoding", default="threshold")
    g.add_argument("--decoding-params", type=_json_obj, default=None)
    g.add_argument("--kv-cache", default="dual", choices=["none", "prefix", "dual"])
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
    e.add_argument("--kv-cache", default="dual", choices=["none", "prefix", "dual"])
    e.add_argument("--json", default=None, help="write one object per (task, decoding) here")
    e.add_argument("--list-tasks", action="store_true")
    e.add_argument("--no-tqdm", action="store_true")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    t = b.add_parser("throughput", help="tokens/s per decoding x kv_cache x batch size")
    t.add_argument("--model", default="cover-tiny")
    t.add_argument("--decoding", type=_csv, default=("low_confidence",))
    t.add_argument("--kv-cache", type=_csv, default=("dual",))
    t.add_argument("--batch-size", type=_ints, default=(1,))
    t.add_argument("--num-prompts", type=int, default=None)
    t.add_argument("--input-len", type=int, default=64)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--block-length", type=int, default=32)
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--threads", type=int, default=None, help="torch threads (pinned, reported)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", default=None)
    t.set_defaults(func=cmd_bench_throughput)
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
