"""Refresh-signal experiments on cover-tiny: one JSON line per (task, variant).

    PYTHONPATH=. python examples/refresh_signals.py NUM DECODING VARIANTS_JSON [TASKS] [K]

VARIANTS_JSON is a list of [label, kv_cache, {CacheRefresh fields} or null], e.g.
'[["none", "none", null], ["adaptive", "dual", {"mode": "adaptive"}],
  ["no budget", "dual", {"mode": "adaptive", "budget": null}]]'; TASKS is comma-separated
(default: all three); K is tokens per step for fixed-schedule decoders. Each line reports
accuracy (%), mean NFE and refreshes per request, and model MFLOPs per generated token
(cover_vllm/flops.py). One torch thread.
"""

from __future__ import annotations

import json
import sys

import torch

from cover_vllm import LLM
from cover_vllm.cache_refresh import CacheRefresh
from cover_vllm.eval import evaluate_one
from cover_vllm.tasks import get_task


def main(argv: list[str]) -> None:
    num, decoding, variants = int(argv[0]), argv[1], json.loads(argv[2])
    tasks = argv[3].split(",") if len(argv) > 3 else ["sudoku4", "arith", "word"]
    k = int(argv[4]) if len(argv) > 4 else None
    torch.set_num_threads(1)
    for name in tasks:
        task = get_task(name)
        examples = task.eval_split(num)
        for label, kv, fields in variants:
            extra = {} if fields is None else {"cache_refresh": CacheRefresh(**fields)}
            llm = LLM("cover-tiny", decoding=decoding, kv_cache=kv, **extra)
            row, _ = evaluate_one(llm, task, examples, decoding, k, None, False)
            print(json.dumps({"task": name, "label": label, "acc": round(row.accuracy * 100, 2),
                              "nfe": round(row.nfe, 3), "refr": round(row.refreshes, 2),
                              "fpt": round(row.flops_per_token / 1e6, 3),
                              "s": round(row.seconds, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
