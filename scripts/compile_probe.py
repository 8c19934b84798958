"""Does `torch.compile` pay on this CPU for a small model's forward? An experiment (issue #42),
not an engine path: the engine runs eagerly.

    .venv/bin/python scripts/compile_probe.py [--models cover-tiny,llada-50m]
        [--dtypes float32,bfloat16] [--batches 1,16] [--window 32] [--threads 1]

For every (model, dtype, batch) it takes the engine's own model (`LLM(...)`, weights as the
engine loads and packs them), and times `forward_tokens` + `compute_logits` over `batch`
windows of `window` tokens each (plain SDPA within each window: the shape of a cached window
step without its cached keys), eager against `torch.compile(model.forward_tokens)`, both warm,
timed alternately `--repeats` times (a machine whose speed drifts slows both alike). Prints the
best and the median time of each, the speed-up of each, and whether the argmax tokens of every
row agree (the compiled forward's logits' max |diff| beside it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cover_vllm.llm import LLM
from cover_vllm.models.base import DenseAttention
from cover_vllm.models.builtin import resolve_model


def _times_ms(fns, repeats: int) -> list[tuple[float, float]]:
    """Each of `fns` warmed, then timed once per round for `repeats` rounds: (best, median) ms
    of each."""
    for fn in fns:
        for _ in range(3):                          # warm: compiled code, oneDNN plans
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, took in zip(fns, times):
            start = time.perf_counter()
            fn()
            took.append(time.perf_counter() - start)
    return [(1e3 * min(t), 1e3 * statistics.median(t)) for t in times]


def probe(name: str, dtype: str, batches: list[int], args) -> list[dict]:
    load_format = "dummy" if resolve_model(name).path is None else "auto"
    llm = LLM(name, load_format=load_format, dtype=dtype, num_threads=args.threads, seed=0)
    model = llm.engine.executor.model
    compiled = torch.compile(model.forward_tokens, dynamic=False)
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, model.spec.mask_token_id, (batch * args.window,), generator=gen)
        positions = torch.arange(args.window).repeat(batch) + 64    # after a 64-token prompt
        attn = DenseAttention(batch, args.window, None)

        def run(forward):
            with torch.inference_mode():
                return model.compute_logits(forward(model.embed(ids), positions, attn))

        eager, comp = _times_ms([lambda: run(model.forward_tokens), lambda: run(compiled)],
                                args.repeats)
        a, b = run(model.forward_tokens).float(), run(compiled).float()
        rows.append({"model": name, "dtype": dtype, "batch": batch, "tokens": len(ids),
                     "eager_ms": eager, "compiled_ms": comp,
                     "speedup": (eager[0] / comp[0], eager[1] / comp[1]),
                     "same_tokens": bool((a.argmax(-1) == b.argmax(-1)).all()),
                     "max_diff": float((a - b).abs().max())})
        print(rows[-1], flush=True)
    llm.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="cover-tiny,llada-50m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rows = [row for name in args.models.split(",") for dtype in args.dtypes.split(",")
            for row in probe(name, dtype, batches, args)]
    print("| model | dtype | batch | tokens | eager ms, best / median | compiled ms | speed-up, "
          "best / median | same tokens | max logit diff |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        (eb, em), (cb, cm), (sb, sm) = r["eager_ms"], r["compiled_ms"], r["speedup"]
        print(f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['tokens']} | "
              f"{eb:.2f} / {em:.2f} | {cb:.2f} / {cm:.2f} | {sb:.2f}x / {sm:.2f}x | "
              f"{r['same_tokens']} | {r['max_diff']:.3g} |")


if __name__ == "__main__":
    main()
