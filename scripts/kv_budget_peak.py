"""Peak resident memory of one fresh process that loads a model with a KV budget and decodes.

Prints one JSON line: the peak (VmHWM) after loading and after generating, the planned weights,
pages and scratch, and the peak's margin over weights + budget. Run each setting in its own
process (a peak is a process's all-time high), one at a time on a shared host:

    PYTHONPATH=$PWD python scripts/kv_budget_peak.py --model llada-8b --dtype bfloat16 \
        --kv-cache-memory-bytes 268435456 [--quantization int8|int4] [--tracemalloc]

`--decoding` takes a comma-separated list: one request of each, in order, in the same process
(e.g. `--model nemotron-diffusion-8b --decoding nemotron,ar,linear_spec`, issue #50).

tests/test_kv_budget.py runs it on a small shape (and, marked slow, on LLaDA-8B).
"""

from __future__ import annotations

import argparse
import json
import tracemalloc

import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.worker.memory import peak_rss_bytes, rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llada-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--decoding", default="cover",
                        help="one decoding, or several comma-separated (a request of each)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--tracemalloc", action="store_true",
                        help="also report Python-side allocations' peak (slow)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.tracemalloc:
        tracemalloc.start()
    decodings = args.decoding.split(",")
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, quantization=args.quantization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, decoding=decodings[0],
              num_threads=1)
    loaded = peak_rss_bytes()
    loaded_rss = rss_bytes()
    for decoding in decodings:
        out = llm.generate([{"prompt_token_ids": list(range(5, 21))}],
                           SamplingParams(max_tokens=args.max_tokens, decoding=decoding,
                                          block_length=args.max_tokens, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == args.max_tokens
    plan = llm.engine.memory
    peak = peak_rss_bytes()
    result = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "decoding": args.decoding,
              "budget": plan.budget_bytes, "weights": plan.weight_bytes,
              "kv_bytes": plan.kv_bytes, "pages": plan.num_pages,
              "scratch_slots": plan.scratch_slots, "scratch_bytes": plan.scratch_bytes,
              "peak_after_load": loaded, "rss_after_load": loaded_rss, "peak": peak,
              "margin": peak - plan.weight_bytes - plan.budget_bytes}
    if args.tracemalloc:
        result["python_peak"] = tracemalloc.get_traced_memory()[1]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
