"""Print how many bf16 tokens the engine shares with a forward in the official op order (issue #48).

    PYTHONPATH=. python scripts/official_order_parity.py --model llada-50m --gen-length 128 \
        [--fast-norm]

One random checkpoint (`load_format="dummy"`, the given seed), bf16, batch 1, Fast-dLLM-order
threshold decoding (0.9, blocks of 32) with kv_cache none / prefix / dual: the engine against the
official-order reference of tests/official_order.py (the official RMSNorm, RoPE, q/k/v and
attention order; the decoding loops of Fast-dLLM's generate / prefix / dual cache functions).
Prints tokens equal (position by position), NFE of both, and the first differing position.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from cover_vllm import LLM, SamplingParams  # noqa: E402
from cover_vllm.models.builtin import resolve_model  # noqa: E402
from cover_vllm.models.loader import load_model  # noqa: E402
from official_order import OfficialLLaDA, generate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llada-50m")
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--modes", default="none,prefix,dual")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fast-norm", action="store_true", help="the engine's one-op RMSNorm")
    args = p.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    cfg = resolve_model(args.model).config
    mask_id = cfg["mask_token_id"]
    ref = OfficialLLaDA(load_model(args.model, "bfloat16", "dummy", args.seed), cfg)
    prompt = torch.randint(0, mask_id - 2, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(args.seed)).tolist()
    print(f"{args.model} bf16, batch 1, {args.gen_length} tokens, blocks of 32, threshold 0.9, "
          f"fast_norm={args.fast_norm}")
    print("| kv_cache | tokens equal | NFE engine | NFE official order | first difference |")
    print("|---|---|---|---|---|")
    for mode in args.modes.split(","):
        llm = LLM(args.model, load_format="dummy", seed=args.seed, dtype="bfloat16",
                  kv_cache=mode, num_threads=args.threads, fast_norm=args.fast_norm)
        params = SamplingParams(max_tokens=args.gen_length, block_length=32, ignore_eos=True,
                                decoding="threshold")
        result = llm.generate([prompt], params, use_tqdm=False)[0]
        out = result.outputs[0]
        want = generate(ref, prompt, args.gen_length, 32, mask_id, 0.9, mode)
        want_ids = want.ids[0, len(prompt):].tolist()
        equal = [a == b for a, b in zip(out.token_ids, want_ids)]
        first = equal.index(False) if not all(equal) else "-"
        print(f"| {mode} | {sum(equal)}/{len(want_ids)} | {result.metrics.nfe} | {len(want.steps)} | "
              f"{first} |", flush=True)
        del llm


if __name__ == "__main__":
    main()
