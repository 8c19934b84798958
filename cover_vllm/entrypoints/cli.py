"""The `cover-vllm` command line: generate, eval, serve, bench, lm-eval (`python -m cover_vllm`)."""

from __future__ import annotations

import argparse
import json
import sys

from cover_vllm.config import KV_CACHE_MODES
from cover_vllm.entrypoints.cli_types import (csv, dtypes, json_obj, positive_int,
                                              positive_ints)
from cover_vllm.entrypoints.engine_flags import MODEL_HELP, add_engine_flags
from cover_vllm.entrypoints.generate_cli import add_generate_parser

THROUGHPUT_TIMES = (
    "Every (dtype, decoding, kv_cache, cache_refresh, batch size) row, timed. A step's time is "
    "reported in three parts: forward ms/step (the model forward), decide ms/step (the "
    "decoders' work on the logits' device: on CUDA the span of its kernels, on the CPU the time "
    "inside the aten ops that read or write a [.., vocabulary] tensor) and host ms/step (the "
    "rest: the time the device would wait for the host -- scheduling, batch layout and "
    "metadata, the decoders' Python and small per-row ops, the decisions' copy, updates). "
    "'overhead' is the share of the step outside the forward (decide included).")


def _cache_choices(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--kv-cache and --cache-refresh lists, validated (ValueError naming the bad value)."""
    from cover_vllm.cache_refresh import parse_cache_refresh
    bad = [m for m in args.kv_cache if m not in KV_CACHE_MODES]
    if bad:
        raise ValueError(f"kv_cache={bad[0]!r}; choose one of {list(KV_CACHE_MODES)}")
    return args.kv_cache, tuple(parse_cache_refresh(p).label for p in args.cache_refresh)


def cmd_eval(args: argparse.Namespace) -> None:
    from cover_vllm.eval import (EvalSpec, check_same_problems, compare, format_paired,
                                 format_table, load_baseline, run_eval, write_json)
    from cover_vllm.tasks import list_tasks

    if args.list_tasks:
        print("\n".join(list_tasks()))
        return
    tasks = list_tasks() if args.task == ("all",) else args.task
    kv_caches, refreshes = _cache_choices(args)
    params = _decoding_params(args.decoding_params, args.decoding)
    spec = EvalSpec(model=args.model, tasks=tuple(tasks), decodings=args.decoding, num=args.num,
                    seed=args.seed, tokens_per_step=args.tokens_per_step, kv_cache=kv_caches,
                    cache_refresh=refreshes, decoding_params=tuple(params.items()),
                    use_tqdm=not args.no_tqdm, threads=args.num_threads, dtype=args.dtype,
                    quantization=args.quantization, batch_invariant=args.batch_invariant,
                    device=args.device)
    baseline = load_baseline(args.baseline) if args.baseline else None   # before any work
    for base in (baseline or {}).values():
        if base["task"] in spec.tasks:
            check_same_problems(base, spec.num, spec.seed)

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
    if baseline is not None:
        paired = compare(rows, baseline)
        if not paired:
            raise ValueError(f"--baseline {args.baseline}: no row has this run's task, decoding, "
                             "k, kv_cache and cache_refresh")
        print(f"\nagainst {args.baseline} (the same problems; p: exact sign test of the "
              "problems lost vs gained)")
        print(format_paired(paired))


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
    from cover_vllm.benchmarks.throughput import ThroughputSpec, default_decodings

    args.decoding = args.decoding or default_decodings(args.model)
    params = _decoding_params(args.decoding_params, args.decoding)
    kv_caches, refreshes = _cache_choices(args)
    return ThroughputSpec(model=args.model, decodings=args.decoding, kv_caches=kv_caches,
                          cache_refreshes=refreshes,
                          batch_sizes=getattr(args, "batch_size", (1,)),
                          num_prompts=getattr(args, "num_prompts", None),
                          input_len=args.input_len, output_len=args.output_len,
                          block_length=args.block_length, steps=args.steps,
                          threads=args.num_threads, seed=args.seed,
                          dtypes=args.dtype if isinstance(args.dtype, tuple) else (args.dtype,),
                          task=args.task,
                          reference_prompts=getattr(args, "reference_prompts", 0),
                          decoding_params=tuple(params.items()),
                          repeats=getattr(args, "timed_runs", 1),
                          quantization=args.quantization, device=args.device,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          count_ops=getattr(args, "count_ops", False),
                          enforce_eager=args.enforce_eager,
                          batch_invariant=(False, True) if getattr(args, "batch_invariant",
                                                                   False) else (False,))


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.report import format_markdown, format_table, write_plot
    from cover_vllm.benchmarks.nemotron import bench_throughput

    report = bench_throughput(_bench_spec(args), args.load_format)
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


def cmd_bench_structured(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.structured import (StructuredSpec, format_structured,
                                                  run_structured)

    rows = run_structured(StructuredSpec(
        model=args.model, decodings=args.decoding, constraints=args.constraint,
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, seed=args.seed,
        threads=args.num_threads, task=args.task))
    print(format_structured(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


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

    spec = ScaleSpec(model=args.model, dtype=args.dtype, quantization=args.quantization,
                     tensor_parallel_size=args.tensor_parallel_size,
                     kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                     memory_utilization=args.memory_utilization, threads=args.num_threads,
                     input_len=args.input_len, output_len=args.output_len,
                     batch_sizes=args.batch_size, seed=args.seed, logits_path=args.dump_logits,
                     denoising_steps=args.denoising_steps, enforce_eager=args.enforce_eager)
    report = run_scale(spec, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_scale(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _bench_common(p: argparse.ArgumentParser, several_dtypes: bool = False) -> None:
    p.add_argument("--model", default="cover-tiny", help=MODEL_HELP)
    p.add_argument("--decoding", type=csv, default=None,
                   help="strategies, comma-separated; a uniform-state model runs its own, "
                   "diffusion_gemma for DiffusionGemma (default: low_confidence)")
    p.add_argument("--decoding-params", type=json_obj, default=None,
                   help='JSON: {"knob": v} or {"<strategy>": {...}, ...}')
    p.add_argument("--kv-cache", type=csv, default=("dual",),
                   help=f"cache modes, comma-separated ({', '.join(KV_CACHE_MODES)})")
    p.add_argument("--cache-refresh", type=csv, default=("block",),
                   help="refresh policies for prefix/dual rows, comma-separated: block, "
                   "interval:N, adaptive")
    p.add_argument("--task", default=None, help="prompts from a task's held-out split")
    p.add_argument("--input-len", type=positive_int, default=64, help="prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=128, help="generated tokens")
    p.add_argument("--block-length", type=positive_int, default=None,
                   help="tokens per block (default: the model's: 32 for full-attention "
                   "families, a block-causal model's own block)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="denoising steps of fixed-schedule strategies (default: theirs)")
    if several_dtypes:
        p.add_argument("--dtype", type=dtypes, default=("auto",),
                       help="weights and activations, comma-separated to compare (auto: the "
                       "checkpoint's torch_dtype); MFU is against the peak GEMM rate in each")
        add_engine_flags(p, ["num_threads", "seed", "quantization", "device",
                             "kv_cache_memory_bytes", "enforce_eager"])
    else:
        add_engine_flags(p, ["dtype", "num_threads", "seed", "quantization", "device",
                             "kv_cache_memory_bytes", "enforce_eager"])
    p.add_argument("--json", default=None, help="write the results here")


def _help_everywhere(parser: argparse.ArgumentParser) -> None:
    """--help of every subcommand shows each option's default (argparse's own formatter skips
    options without a help text, and a subparser does not inherit it)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _help_everywhere(sub)
            continue
        default = action.default
        if (not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS):
            continue
        text = action.help or ""
        if "(default" not in text and "default:" not in text:
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else "%(default)s"
            action.help = f"{text} (default: {shown})" if text else f"default: {shown}"


def build_parser() -> argparse.ArgumentParser:
    from cover_vllm import __version__

    parser = argparse.ArgumentParser(prog="cover-vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=__version__,
                        help="print the package version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)

    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in the "
                       "official layout (config.json, index, <= 5 GB shards)")
    m.add_argument("--shape", required=True, help="built-in shape (llada-8b, llada-1.5, "
                   "dream-7b, dream-coder-7b, llada-moe-7b, llada2-mini, llada2.1-mini, "
                   "sdar-1.7b, sdar-4b, sdar-8b, llada-300m, ...) or a dir with config.json")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    m.add_argument("--out", required=True, help="directory to write (under /tmp for full sizes)")
    m.add_argument("--seed", type=int, default=0, help="random values' seed")
    m.add_argument("--max-shard-bytes", type=positive_int, default=5_000_000_000,
                   help="largest shard file")
    m.set_defaults(func=cmd_make_checkpoint)

    e = sub.add_parser("eval", help="accuracy/NFE of strategies on verifiable tasks")
    e.add_argument("--model", default="cover-tiny", help=MODEL_HELP)
    e.add_argument("--task", type=csv, default=("all",), help="task names or 'all'")
    e.add_argument("--decoding", type=csv, default=("low_confidence", "threshold"),
                   help="strategies, comma-separated")
    e.add_argument("--decoding-params", type=json_obj, default=None,
                   help='JSON: {"threshold": 0.8} or {"threshold": {"threshold": 0.8}, ...}')
    e.add_argument("--tokens-per-step", type=positive_ints, default=(1,),
                   help="for fixed-schedule strategies: run once per k (steps = max_tokens/k)")
    e.add_argument("--num", type=positive_int, default=200, help="problems per task")
    e.add_argument("--seed", type=int, default=None,
                   help="draw fresh problems from this seed (default: the held-out split)")
    e.add_argument("--kv-cache", type=csv, default=("none",),
                   help="none (default) is exact; prefix/dual (comma-separated: one row each) "
                   "reuse K/V between refreshes (--cache-refresh)")
    e.add_argument("--cache-refresh", type=csv, default=("block",),
                   help="refresh policies for prefix/dual rows, comma-separated: block, "
                   "interval:N, adaptive")
    e.add_argument("--json", default=None, help="write one object per (task, decoding) here")
    e.add_argument("--baseline", default=None, metavar="JSON",
                   help="an earlier --json on the same problems: print each row's problems lost "
                   "and gained against it, and the sign test's p")
    e.add_argument("--list-tasks", action="store_true", help="print the task names and exit")
    add_engine_flags(e, ["dtype", "num_threads", "quantization", "batch_invariant", "device"])
    e.add_argument("--no-tqdm", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    t = b.add_parser("throughput", help="tokens/s per dtype x decoding x kv_cache x batch size",
                     description=THROUGHPUT_TIMES)
    _bench_common(t, several_dtypes=True)
    t.add_argument("--batch-size", type=positive_ints, default=(1,),
                   help="batch sizes, comma-separated")
    t.add_argument("--num-prompts", type=positive_int, default=None,
                   help="default: 2 x batch size")
    t.add_argument("--batch-invariant", action="store_true",
                   help="run every row also in the batch-invariant mode, beside the default "
                   "(rows <dtype>+invariant; docs/batch_invariance.md)")
    t.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights (always so for a built-in shape)")
    t.add_argument("--reference-prompts", type=int, default=1,
                   help="requests timed through the dense reference loop (0: skip)")
    t.add_argument("--repeats", dest="timed_runs", metavar="N", type=positive_int, default=1,
                   help="timed runs of every row, round-robin; a row reports the median run "
                   "(use 3+ when comparing rows on a noisy machine)")
    t.add_argument("--count-ops", action="store_true",
                   help="one extra, untimed run per row counting the aten ops of every step: "
                   "device ops (CUDA: kernel launches and views), host ops, ops in the forward")
    t.add_argument("--markdown", default=None, help="write a markdown report here")
    t.add_argument("--plot", default=None, help="PNG: accuracy vs tokens/s, NFE/token bars")
    t.set_defaults(func=cmd_bench_throughput)
    lat = b.add_parser("latency", help="one request: per-step time by engine phase")
    _bench_common(lat)
    lat.add_argument("--repeats", type=positive_int, default=3, help="requests timed")
    lat.set_defaults(func=cmd_bench_latency)
    st = b.add_parser("structured", help="structured outputs: validity, NFE, tokens/step and "
                      "the constraint's time per step, per decoding x constraint")
    st.add_argument("--model", default="cover-tiny", help=MODEL_HELP)
    st.add_argument("--decoding", type=csv, default=("cover", "threshold", "low_confidence"),
                    help="strategies, comma-separated")
    st.add_argument("--constraint", type=csv,
                    default=("none", "json", "json_compact", "regex", "choice"),
                    help="none (the baseline), json ({answer: integer}), json_compact (the same "
                    "without optional whitespace), regex, choice, worked (arith's answer layout)")
    st.add_argument("--task", default=None, help="prompts from a task's held-out split "
                    "(arith, with --constraint none,worked), accuracy reported")
    st.add_argument("--num-prompts", type=positive_int, default=10, help="requests per row")
    st.add_argument("--max-tokens", type=positive_int, default=32, help="generated tokens")
    add_engine_flags(st, ["num_threads", "seed"])
    st.add_argument("--json", default=None, help="write the rows here")
    st.set_defaults(func=cmd_bench_structured)
    sc = b.add_parser("scale", help="load seconds, peak memory, s/step and tok/s of a "
                      "full-size model (run in a fresh process)")
    sc.add_argument("--model", required=True, help=MODEL_HELP)
    add_engine_flags(sc, ["dtype", "quantization", "kv_cache_memory_bytes",
                          "memory_utilization", "tensor_parallel_size", "num_threads", "seed",
                          "enforce_eager"])
    sc.add_argument("--input-len", type=positive_int, default=16, help="prompt tokens")
    sc.add_argument("--output-len", type=positive_int, default=32, help="generated tokens")
    sc.add_argument("--batch-size", type=positive_ints, default=(1, 4),
                    help="batch sizes, comma-separated")
    sc.add_argument("--denoising-steps", type=positive_int, default=2,
                    help="uniform-state models (DiffusionGemma): decoder steps per canvas")
    sc.add_argument("--dump-logits", default=None, help="save the first forward's logits here")
    sc.add_argument("--json", default=None, help="write the report here")
    sc.set_defaults(func=cmd_bench_scale)
    from cover_vllm.entrypoints.scoring_cli import add_scoring_parsers
    from cover_vllm.entrypoints.serve_cli import add_serve_parsers

    add_serve_parsers(sub, b)
    add_scoring_parsers(sub, b)
    _help_everywhere(parser)
    return parser


def _check_local_device(args: argparse.Namespace) -> None:
    """A --device this process cannot use is a one-line error before anything loads; unless
    the engines run as Ray actors (data parallelism, --ray-address, the ray executor), which
    check their own machine's devices."""
    from cover_vllm.device_check import check_device

    device = getattr(args, "device", None)
    on_ray = (getattr(args, "ray_address", None) or (getattr(args, "data_parallel_size", 1)
              or 1) > 1 or getattr(args, "distributed_executor_backend", None) == "ray")
    if device is not None and not on_ray:
        check_device(device, "--device")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:          # lm-eval's own command line, our model registered
        from cover_vllm.entrypoints.scoring_cli import run_lm_eval

        return run_lm_eval(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        _check_local_device(args)
        args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"cover-vllm: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
