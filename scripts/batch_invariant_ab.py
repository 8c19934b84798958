"""The batch-invariant mode's cost, measured without the drift of a shared machine: two engines
(mode off, mode on) in one process, timed in alternation (docs/benchmarks.md, issue 51).

    .venv/bin/python scripts/batch_invariant_ab.py [--model llada-50m] [--dtype bfloat16]
        [--batch 16] [--decodings low_confidence,cover] [--runs 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from cover_vllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llada-50m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--decodings", default="low_confidence,cover")
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 16000) for _ in range(32)] for _ in range(args.batch)]
    engines = {mode: LLM(args.model, load_format="dummy", dtype=args.dtype, num_threads=1,
                         batch_invariant=mode, max_num_seqs=args.batch,
                         kv_cache_memory_bytes=256 << 20) for mode in (False, True)}
    for decoding in args.decodings.split(","):
        params = SamplingParams(max_tokens=32, block_length=32, decoding=decoding)
        for llm in engines.values():                       # warm-up (and the mode's probes)
            llm.generate(prompts[:2], params, use_tqdm=False)
        seconds = {False: [], True: []}
        for _ in range(args.runs):
            for mode, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                seconds[mode].append(time.perf_counter() - start)
        off, on = (statistics.median(seconds[m]) for m in (False, True))
        print(f"{decoding} bs={args.batch}: off {off:.2f} s, on {on:.2f} s, on/off {on / off:.3f}")


if __name__ == "__main__":
    main()
