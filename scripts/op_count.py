"""Print device ops per layer and host ops per engine step on the meta device (issues #42, #43).

    python scripts/op_count.py --model llada-8b --decoding low_confidence,threshold,cover,wino,saber \
        --batch-size 1,16,64

Shapes only (`load_format="dummy"`, `device="meta"`): no weights are read and no arithmetic is
done, so the counts are what a GPU step would dispatch (cover_vllm/benchmarks/op_count.py). Each
row is the median over the steps that ran the model after the first (admission) step.
"""

from __future__ import annotations

import argparse
import logging

from cover_vllm import LLM, SamplingParams
from cover_vllm.benchmarks.op_count import count_steps, steady, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llada-8b")
    p.add_argument("--decoding", default="low_confidence,threshold,cover,wino,saber")
    p.add_argument("--batch-size", default="1,16,64")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache", default="dual")
    p.add_argument("--top", type=int, default=0, help="also print the N commonest device ops")
    p.add_argument("--fast-norm", action="store_true", help="the one-op RMSNorm (#48)")
    args = p.parse_args()
    logging.disable(logging.WARNING)
    batches = [int(b) for b in args.batch_size.split(",")]
    llm = LLM(args.model, load_format="dummy", device="meta", num_threads=1,
              kv_cache_memory_bytes=4 << 30, max_num_seqs=max(batches), fast_norm=args.fast_norm)
    print(f"{args.model}, kv_cache={args.kv_cache}, {args.max_tokens} tokens, blocks of 32, "
          f"fast_norm={args.fast_norm}")
    print("| decoding | batch | device ops/layer (median, max) | views/layer | host ops "
          "(median, max) |")
    print("|---|---|---|---|---|")
    for decoding in args.decoding.split(","):
        for batch in batches:
            params = SamplingParams(max_tokens=args.max_tokens, block_length=32,
                                    ignore_eos=True, decoding=decoding, kv_cache=args.kv_cache)
            steps = count_steps(llm, params, batch)
            s = summary(steps)
            print(f"| {decoding} | {batch} | {s['device_per_layer']:.1f}, "
                  f"{s['device_per_layer_max']:.1f} | {s['views_per_layer']:.1f} | "
                  f"{s['host']:.0f}, {s['host_max']:.0f} |")
            if args.top:
                step = steady(steps)[0]
                print("   ", ", ".join(f"{n} {c / step.num_layers:.2f}"
                                       for n, c in step.device.most_common(args.top)))


if __name__ == "__main__":
    main()
