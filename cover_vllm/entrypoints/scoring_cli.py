"""`cover-vllm lm-eval ARGS...` (lm-eval's command line with the `cover_vllm` model registered)
and `cover-vllm bench loglikelihood`."""

from __future__ import annotations

import argparse
import json
import sys

from cover_vllm.entrypoints.cli_types import positive_int, positive_ints
from cover_vllm.entrypoints.engine_flags import MODEL_HELP


def run_lm_eval(argv: list[str]) -> int:
    """lm-eval's CLI (`lm-eval run ...`, `lm-eval ls tasks`, ...) with our model registered."""
    try:
        from cover_vllm.harness import run_cli
    except ImportError as exc:
        print(f"cover-vllm: error: {exc}", file=sys.stderr)
        return 2
    return run_cli(argv)


def cmd_bench_loglikelihood(args: argparse.Namespace) -> None:
    from cover_vllm.benchmarks.loglikelihood import (ScoringBenchSpec, format_loglikelihood,
                                                     run_loglikelihood_bench)

    spec = ScoringBenchSpec(model=args.model, mc_nums=args.mc_num, batch_size=args.batch_size,
                            questions=args.questions,
                            reference_requests=args.reference_requests,
                            rate_problems=args.rate_problems, block_model=args.block_model,
                            block_context=args.block_context, threads=args.num_threads,
                            seed=args.seed)
    report = run_loglikelihood_bench(spec, log=lambda line: print(line, file=sys.stderr))
    print(format_loglikelihood(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)


def add_scoring_parsers(sub, bench) -> None:
    """`lm-eval` under the top-level subparsers (help only: main() hands its arguments to
    lm-eval untouched) and `loglikelihood` under `bench`."""
    sub.add_parser("lm-eval", help="lm-evaluation-harness with the cover_vllm model "
                   "registered: cover-vllm lm-eval --model cover_vllm --model_args "
                   "pretrained=...,mc_num=128 --tasks ... (needs the 'eval' extra)",
                   add_help=False)
    ll = bench.add_parser("loglikelihood", help="likelihood scoring: req/s and forwards/s "
                          "against the official loop, accuracy per mc_num, block-causal "
                          "shared context")
    ll.add_argument("--model", default="cover-tiny", help=MODEL_HELP)
    ll.add_argument("--mc-num", type=positive_ints, default=(32, 128),
                    help="Monte-Carlo copies per request, comma-separated")
    ll.add_argument("--batch-size", type=positive_int, default=32,
                    help="the estimator's mini-batch (the official batch_size)")
    ll.add_argument("--questions", type=positive_int, default=25,
                    help="4-choice questions timed through the engine")
    ll.add_argument("--reference-requests", type=positive_int, default=8,
                    help="requests timed through the official loop")
    ll.add_argument("--rate-problems", type=int, default=100,
                    help="6-way problems for the accuracy rate (0: skip)")
    ll.add_argument("--block-model", default=None,
                    help="a block-causal checkpoint for the shared-context rows")
    ll.add_argument("--block-context", type=positive_int, default=64,
                    help="context tokens of the block-causal questions")
    ll.add_argument("--threads", dest="num_threads", type=positive_int, default=None,
                    help="torch intra-op threads")
    ll.add_argument("--seed", type=int, default=0)
    ll.add_argument("--json", default=None, help="write the report here")
    ll.set_defaults(func=cmd_bench_loglikelihood)


__all__ = ["add_scoring_parsers", "run_lm_eval"]
