"""`cover-vllm bench latency`: one request per decoding, per-step time split by engine phase.

Phases: schedule, prepare (batch layout), forward (the model), strategy (decide), update.
Window steps (not refreshes) are reported separately, so decoders are compared over the same
forward window; `vs_first` is each decoding's mean window-step time over the first one's.

Decoders take different paths through a block (a COVER block has verification-only steps, a
threshold block does not), so mean step times also differ by which windows they visit. When
COVER is among the decodings, `run_verification_cost` replays COVER's own window steps with and
without their seeds: the cost of verification over identical windows.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

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


def _without_verification(out):
    """The same step with no seeds: no override pairs, no drift/in-mass statistics."""
    items = [dataclasses.replace(i, override=[], want_stats=False) for i in out.items]
    return dataclasses.replace(out, items=items)


def run_verification_cost(spec: ThroughputSpec, decoding: str = "cover", repeats: int = 3,
                          replays: int = 5) -> list[dict]:
    """COVER's verification cost over identical windows, per cache mode.

    Records every window step (one request at a time) that verified seeds, then replays each one
    `replays` times through the executor as recorded and with its seeds stripped (the same
    window, tokens and view, so the only difference is the override + correction and the
    statistics). The cache contents the replays write are not read back by anything.
    """
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    load_format = "dummy" if resolve_model(spec.model).path is None else "auto"
    llm = LLM(spec.model, decoding=decoding, load_format=load_format, seed=spec.seed)
    work = Workload(spec, llm, max(repeats, 1))
    executor = llm.engine.executor
    rows = []
    for kv in spec.kv_caches:
        sp = work.params(spec, decoding, kv)
        recorded = []
        run = executor.execute_model
        executor.execute_model = lambda out: recorded.append(out) or run(out)
        try:
            for prompt in work.prompts[:repeats]:            # one request at a time, as above
                llm.generate([prompt], sp, use_tqdm=False)
        finally:
            executor.execute_model = run
        steps = [o for o in recorded if any(i.override for i in o.items)
                 and (kv == "none" or not any(i.is_refresh for i in o.items))]
        if not steps:
            continue
        plain = [_without_verification(o) for o in steps]
        for out in steps[:2] + plain[:2]:                                  # warm-up
            run(out)
        with_v, without_v = [], []
        for _ in range(replays):
            for a, b in zip(steps, plain):
                for out, times in ((a, with_v), (b, without_v)):
                    start = time.perf_counter()
                    run(out)
                    times.append(time.perf_counter() - start)
        seeds = statistics.mean(sum(len(i.override) for i in o.items) for o in steps)
        rows.append({"decoding": decoding, "kv_cache": kv, "steps": len(steps),
                     "seeds_per_step": seeds,
                     "forward_ms": 1e3 * statistics.mean(with_v),
                     "forward_without_seeds_ms": 1e3 * statistics.mean(without_v),
                     "ratio": statistics.mean(with_v) / statistics.mean(without_v)})
    return rows


def format_verification(rows: list[dict]) -> str:
    lines = ["| decoding | kv_cache | steps | seeds/step | forward ms | same window, no seeds ms"
             " | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['decoding']} | {r['kv_cache']} | {r['steps']} | "
                     f"{r['seeds_per_step']:.1f} | {r['forward_ms']:.3f} | "
                     f"{r['forward_without_seeds_ms']:.3f} | {r['ratio']:.3f} |")
    return "\n".join(lines)
