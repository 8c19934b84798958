"""Accuracy against NFE for decoder settings on cover-tiny (the frontier table in
docs/benchmarks.md).

Each setting runs on the same held-out problems of every task (exact cache mode) and prints one
JSON line: [decoding, params, {task: [accuracy %, NFE, remasks, flip-flops, replaces]}].

    PYTHONPATH=. python examples/sweep_decoders.py --num 200            # the documented sweep
    PYTHONPATH=. python examples/sweep_decoders.py --num 1000 --preset near   # near the frontier
    PYTHONPATH=. python examples/sweep_decoders.py --settings '[["cover", {"draft_threshold": 0.9}]]'
"""

from __future__ import annotations

import argparse
import json

import torch

from cover_vllm import LLM
from cover_vllm.eval import evaluate_one
from cover_vllm.tasks import get_task, list_tasks

THRESHOLD = [["threshold", {"threshold": t}] for t in (0.95, 0.97, 0.99)]
WINO = [["wino", {"threshold": t, "threshold_back": back}]
        for t, back in ((0.9, 0.97), (0.95, 0.99), (0.97, 0.99), (0.99, 0.995))]

SETTINGS = THRESHOLD + [["wino", {"threshold": 0.8, "threshold_back": 0.95}]] + WINO + [
    ["saber", {"n": 4}], ["saber", {"n": 8}],
    ["cover", {"draft_threshold": 0.9, "final_verify_below": 1.0}],
    ["cover", {"draft_threshold": 0.95, "final_verify_below": 1.0}],
    ["cover", {}],
    ["cover", {"draft_threshold": 0.98}],
    ["cover", {"draft_threshold": 0.99, "final_verify": False}],
    ["cover", {"draft_threshold": 0.9, "final_verify_below": 0.99, "k_min": 16}],
    ["cover", {"draft_threshold": 0.9, "final_verify_below": 1.0, "k_min": 16}],
    # the same without this round's revision rules: revise every disagreeing seed at once, and
    # replace only at the draft bar (else remask, or keep when the guard forbids it)
    ["cover", {"draft_threshold": 0.9, "final_verify_below": 1.0, "k_min": 16,
               "max_revise": None, "replace_threshold": None}],
]

# The settings near the accuracy frontier, for the 1,000-problem table (about 12 minutes on one
# thread for the three tasks).
NEAR = THRESHOLD + WINO + [
    ["cover", {"draft_threshold": 0.95}], ["cover", {}],
    ["cover", {"final_verify_below": 0.7}],
    ["cover", {"draft_threshold": 0.99, "final_verify_below": 0.9}],
    ["cover", {"w_influence": 0.0, "w_drift": 0.0}],        # seeds ranked by uncertainty alone
]
PRESETS = {"all": SETTINGS, "near": NEAR}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cover-tiny")
    p.add_argument("--tasks", default=",".join(list_tasks()))
    p.add_argument("--num", type=int, default=200, help="held-out problems per task")
    p.add_argument("--preset", choices=sorted(PRESETS), default="all",
                   help="named list of settings (all: the 200-problem table)")
    p.add_argument("--settings", default=None,
                   help="JSON list of [decoding, params] pairs (instead of --preset)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    settings = json.loads(args.settings) if args.settings else PRESETS[args.preset]
    llm = LLM(args.model, kv_cache="none")
    tasks = [get_task(name) for name in args.tasks.split(",")]
    for decoding, params in settings:
        result = {}
        for task in tasks:
            row, _ = evaluate_one(llm, task, task.eval_split(args.num), decoding, None, params,
                                  use_tqdm=False)
            result[task.name] = [round(100 * row.accuracy, 1), round(row.nfe, 2),
                                 round(row.remasks, 2), round(row.flip_flops, 2),
                                 round(row.replaces, 2)]
        print(json.dumps([decoding, params, result]), flush=True)


if __name__ == "__main__":
    main()
