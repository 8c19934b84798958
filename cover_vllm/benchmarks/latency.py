"""`cover-vllm bench latency`: one request per decoding, per-step time split by engine phase.

Phases: schedule, prepare (batch layout), forward (the model), strategy (decide), update.
Window steps (not refreshes) are reported separately, so decoders are compared over the same
forward window; `vs_first` is each decoding's mean window-step time over the first one's.
"""

from __future__ import annotations

import statistics

import torch

from cover_vllm.benchmarks.throughput import ThroughputSpec, Workload
from cover_vllm.entrypoints.llm import LLM
from cover_vllm.models.builtin import resolve_model

PHASES = ("schedule", "prepare", "forward", "strategy", "update")


def run_latency(spec: ThroughputSpec, repeats: int = 3, log=print) -> list[dict]:
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    load_format = "dummy" if resolve_model(spec.model).path is None else "auto"
    llm = LLM(spec.model, decoding=spec.decodings[0], load_format=load_format, seed=spec.seed)
    work = Workload(spec, llm, max(repeats, 1))
    rows = []
    for kv in spec.kv_caches:
        for decoding in spec.decodings:
            sp = work.params(spec, decoding, kv)
            llm.generate(work.prompts[:1], sp, use_tqdm=False)            # warm-up
            steps, nfe = [], []
            for prompt in work.prompts[:repeats]:
                llm.engine.step_times = []
                (out,) = llm.generate([prompt], sp, use_tqdm=False)
                steps += llm.engine.step_times
                nfe.append(out.metrics.nfe)
            llm.engine.step_times = None
            window = [t for t in steps if not t["num_refresh"]] or steps
            row = {"decoding": decoding, "kv_cache": kv, "nfe": statistics.mean(nfe),
                   "steps_timed": len(window)}
            for phase in PHASES:
                row[f"{phase}_ms"] = 1e3 * statistics.mean(t[phase] for t in window)
            row["step_ms"] = sum(row[f"{p}_ms"] for p in PHASES)
            row["request_ms"] = 1e3 * sum(sum(t[p] for p in PHASES) for t in steps) / repeats
            rows.append(row)
    for kv in spec.kv_caches:
        group = [r for r in rows if r["kv_cache"] == kv]
        for r in group:
            r["vs_first"] = r["step_ms"] / group[0]["step_ms"]
    return rows


def format_latency(rows: list[dict]) -> str:
    cols = ["decoding", "kv_cache", "nfe", *[f"{p}_ms" for p in PHASES], "step_ms", "vs_first",
            "request_ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
