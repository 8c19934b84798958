"""What a block-causal block's commit costs fused into the next block's first forward against a
forward of its own (docs/architecture.md, "Exact per-block KV reuse").

    .venv/bin/python scripts/commit_cost.py [--model sdar-1.7b] [--block 4,32] [--repeats 15]

For each block size B it times, on the model's dummy weights (bf16 where the CPU has it), one
forward of 2B rows (the next block's first step with the finished block's commit in it)
against two forwards of B rows (a commit forward, then the step), both over the same keys, and
prints the medians and their ratio. At small B a forward reads every weight whatever its row
count, so a separate commit forward nearly doubles the step's cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cover_vllm.models.base import DenseAttention
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.loader import instantiate, resolve_dtype
from cover_vllm.models.spec import ModelSpec


def _forward(model, rows: int, start: int) -> None:
    ids = torch.randint(0, model.dims.vocab_size - 1, (rows,))
    positions = torch.arange(start, start + rows)
    hidden = model.forward_tokens(model.embed(ids), positions, DenseAttention(1, rows, None))
    model.compute_logits(hidden[-1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sdar-1.7b")
    parser.add_argument("--block", default="4,32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model)
    spec = ModelSpec.from_config(resolved.config)
    model = instantiate(resolved, spec, resolve_dtype("auto", spec), load_format="dummy")
    print(f"{args.model} {next(model.parameters()).dtype}, {args.threads} threads")
    with torch.inference_mode():
        for block in (int(b) for b in args.block.split(",")):
            fused, separate = [], []
            _forward(model, 2 * block, 0)                          # warm-up
            for _ in range(args.repeats):                          # alternate: drift hits both
                t = time.perf_counter()
                _forward(model, 2 * block, 0)
                fused.append(time.perf_counter() - t)
                t = time.perf_counter()
                _forward(model, block, 0)
                _forward(model, block, block)
                separate.append(time.perf_counter() - t)
            f, s = statistics.median(fused), statistics.median(separate)
            print(f"B={block}: fused {2 * block} rows {f * 1e3:.1f} ms, separate commit "
                  f"{block} + {block} rows {s * 1e3:.1f} ms: separate / fused = {s / f:.2f}")


if __name__ == "__main__":
    main()
