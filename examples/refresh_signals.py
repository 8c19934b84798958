"""Refresh-signal experiments on cover-tiny: one JSON line per (task, variant).

Usage: python examples/refresh_signals.py NUM DECODING VARIANTS_JSON [TASKS] [K]
VARIANTS_JSON: [[label, kv_cache, {CacheRefresh fields} or null], ...]
"""
import json, sys, time
import torch
torch.set_num_threads(1)
from cover_vllm import LLM
from cover_vllm.cache_refresh import CacheRefresh
from cover_vllm.eval import evaluate_one, CacheChoice
from cover_vllm.tasks import get_task

num = int(sys.argv[1]); decoding = sys.argv[2]
variants = json.loads(sys.argv[3])   # list of [label, kv, {CacheRefresh kwargs} or null]
tasks = sys.argv[4].split(",") if len(sys.argv) > 4 else ["sudoku4", "arith", "word"]
k = int(sys.argv[5]) if len(sys.argv) > 5 else None
for tname in tasks:
    task = get_task(tname); ex = task.eval_split(num)
    for label, kv, kw in variants:
        kwargs = {} if kw is None else {"cache_refresh": CacheRefresh(**kw)}
        llm = LLM("cover-tiny", decoding=decoding, kv_cache=kv, **kwargs)
        row, outs = evaluate_one(llm, task, ex, decoding, k, None, False)
        print(json.dumps({"task": tname, "label": label, "acc": round(row.accuracy*100, 2), "nfe": round(row.nfe, 3),
                          "refr": round(row.refreshes, 2), "fpt": round(row.flops_per_token/1e6, 3),
                          "s": round(row.seconds, 1)}), flush=True)
