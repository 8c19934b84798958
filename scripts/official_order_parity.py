"""Print how many bf16 tokens the engine shares with a forward in the official op order (issue #48).

    PYTHONPATH=. python scripts/official_order_parity.py --model llada-50m --gen-lengths 128,256 \
        --seeds 0,1,2 --rules threshold,fixed,low_confidence [--fast-norm]

One random checkpoint per seed (`load_format="dummy"`), bf16, batch 1, blocks of 32, kv_cache
none / prefix / dual: the engine against the official-order reference of tests/official_order.py
(the official RMSNorm, RoPE, q/k/v and attention order; the decoding loops of Fast-dLLM's
generate / prefix / dual cache functions). Rules:
* `threshold`: Fast-dLLM's threshold (`--threshold`, 0.9; engine: decoding="threshold");
* `fixed`: Fast-dLLM without a threshold, `gen_length // 2` steps (two tokens a step), float64
  softmax (engine: decoding="threshold", threshold None);
* `low_confidence`: LLaDA's `generate`, the same schedule, float32 softmax (engine:
  decoding="low_confidence").
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
from official_order import OfficialLLaDA, Rule, generate  # noqa: E402

BLOCK = 32


def _rule(name: str, gen_length: int, threshold: float) -> tuple[Rule, dict]:
    """The reference's rule and the engine's SamplingParams fields for it."""
    steps = gen_length // 2
    if name == "threshold":
        return Rule(threshold), dict(decoding="threshold",
                                     decoding_params={"threshold": threshold})
    if name == "fixed":
        return Rule(None, steps), dict(decoding="threshold", decoding_params={"threshold": None},
                                       steps=steps)
    if name == "low_confidence":
        return Rule(None, steps, torch.float32), dict(decoding="low_confidence", steps=steps)
    raise ValueError(f"--rules: {name!r}; choose from threshold, fixed, low_confidence")


def _case(args, seed: int, gen_length: int, rule_name: str, mode: str) -> str:
    """One table row: the engine and the reference on the same random checkpoint and prompt."""
    cfg = resolve_model(args.model).config
    mask_id = cfg["mask_token_id"]
    ref = OfficialLLaDA(load_model(args.model, "bfloat16", "dummy", seed), cfg)
    prompt = torch.randint(0, mask_id - 2, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    rule, fields = _rule(rule_name, gen_length, args.threshold)
    llm = LLM(args.model, load_format="dummy", seed=seed, dtype="bfloat16", kv_cache=mode,
              num_threads=args.threads, fast_norm=args.fast_norm)
    params = SamplingParams(max_tokens=gen_length, block_length=BLOCK, ignore_eos=True, **fields)
    result = llm.generate([prompt], params, use_tqdm=False)[0]
    out = result.outputs[0]
    want = generate(ref, prompt, gen_length, BLOCK, mask_id, rule, mode)
    want_ids = want.ids[0, len(prompt):].tolist()
    equal = [a == b for a, b in zip(out.token_ids, want_ids)]
    first = equal.index(False) if not all(equal) else "-"
    return (f"| {seed} | {gen_length} | {rule_name} | {mode} | {sum(equal)}/{len(want_ids)} | "
            f"{result.metrics.nfe} | {len(want.steps)} | {first} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llada-50m")
    p.add_argument("--gen-lengths", default="128")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--modes", default="none,prefix,dual")
    p.add_argument("--rules", default="threshold")
    p.add_argument("--seeds", default="0")
    p.add_argument("--threshold", type=float, default=0.9,
                   help="the threshold rule's bar (random weights: top probabilities near 3e-4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fast-norm", action="store_true", help="the engine's one-op RMSNorm")
    args = p.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    print(f"{args.model} bf16, batch 1, blocks of {BLOCK}, fast_norm={args.fast_norm}")
    print("| seed | tokens | rule | kv_cache | tokens equal | NFE engine | NFE official order "
          "| first difference |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in map(int, args.seeds.split(",")):
        for gen_length in map(int, args.gen_lengths.split(",")):
            for rule_name in args.rules.split(","):
                for mode in args.modes.split(","):
                    print(_case(args, seed, gen_length, rule_name, mode), flush=True)


if __name__ == "__main__":
    main()
