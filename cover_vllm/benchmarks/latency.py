"""`cover-vllm bench latency`: one request per decoding, per-step time split by engine phase.

Phases: schedule, prepare (batch layout), forward (the model), strategy (decide, and the
decisions' copy to the host), update; `decide_ms` is the decoders' work on the logits' device
(engine/timing.py), `host_ms` everything but the forward and that, and `host_bytes`
what a step copies from the device to the host (0 on a CPU engine); on CUDA `device_ms` is the
forward's span on the device (CUDA events; None elsewhere).
Window steps (not refreshes) are reported separately, so decoders are compared over the same
forward window; `vs_first` is each decoding's mean window-step time over the first one's.

Decoders take different paths through a block (a COVER block has verification-only steps, a
threshold block does not), so mean step times also differ by which windows they visit. When
COVER is among the decodings, `run_verification_cost` replays COVER's own window steps with and
without their seeds: the cost of verification over identical windows.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

from cover_vllm.benchmarks.machine import pin_threads
from cover_vllm.benchmarks.throughput import ThroughputSpec, Workload
from cover_vllm.engine.observer import PHASES, StepObserver, StepTimes
from cover_vllm.llm import LLM
from cover_vllm.models.builtin import resolve_model
from cover_vllm.strategies import BlockState, decide_now, make_params, strategy_class


def _llm(spec: ThroughputSpec, decoding: str) -> tuple[LLM, int]:
    """The engine a latency run times (random weights for a weightless built-in shape) and
    its pinned thread count."""
    threads = pin_threads(spec.model, spec.threads)
    load_format = "dummy" if resolve_model(spec.model).path is None else "auto"
    return LLM(spec.model, decoding=decoding, load_format=load_format, seed=spec.seed,
               num_threads=threads, dtype=spec.dtypes[0], quantization=spec.quantization,
               device=spec.device, kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
               enforce_eager=spec.enforce_eager), threads


def run_latency(spec: ThroughputSpec, repeats: int = 3) -> list[dict]:
    llm, threads = _llm(spec, spec.decodings[0])
    work = Workload(spec, llm, max(repeats, 1))
    rows = []
    for kv in spec.kv_caches:
        for decoding in spec.decodings:
            sp = work.params(spec, decoding, (kv, spec.cache_refreshes[0]))
            llm.generate(work.prompts[:1], sp, use_tqdm=False)            # warm-up
            llm.reset_prefix_cache()      # timed requests reuse no prompt block of it
            times, nfe = StepTimes(), []
            llm.engine.add_observer(times)
            try:
                for prompt in work.prompts[:repeats]:
                    (out,) = llm.generate([prompt], sp, use_tqdm=False)
                    nfe.append(out.metrics.nfe)
            finally:
                llm.engine.remove_observer(times)
            steps = times.rows
            window = [t for t in steps if not t["num_refresh"]] or steps
            row = {"decoding": decoding, "kv_cache": kv, "nfe": statistics.mean(nfe),
                   "steps_timed": len(window)}
            for phase in PHASES:
                row[f"{phase}_ms"] = 1e3 * statistics.mean(t[phase] for t in window)
            row["step_ms"] = sum(row[f"{p}_ms"] for p in PHASES)
            decide = [t["decide_device"] for t in window]   # the decoders' work on the logits
            row["decide_ms"] = None if None in decide else 1e3 * statistics.mean(decide)
            row["host_ms"] = row["step_ms"] - row["forward_ms"] - (row["decide_ms"] or 0.0)
            row["host_bytes"] = statistics.mean(t["host_bytes"] for t in window)
            device = [t["device_forward"] for t in window]
            row["device_ms"] = None if None in device else 1e3 * statistics.mean(device)
            row["request_ms"] = 1e3 * sum(sum(t[p] for p in PHASES) for t in steps) / repeats
            rows.append(row)
    for kv in spec.kv_caches:
        group = [r for r in rows if r["kv_cache"] == kv]
        for r in group:
            r["vs_first"] = r["step_ms"] / group[0]["step_ms"]
    return rows


def format_latency(rows: list[dict]) -> str:
    cols = ["decoding", "kv_cache", "nfe", *[f"{p}_ms" for p in PHASES], "step_ms", "decide_ms",
            "host_ms", "host_bytes", "device_ms", "vs_first", "request_ms"]
    for col in ("device_ms", "decide_ms"):           # CUDA only; not on meta
        if all(r.get(col) is None for r in rows):
            cols.remove(col)
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
    window, tokens and view, so the only difference is the override views and the statistics).
    The cache contents the replays write are not read back by anything. A *step* adds the
    strategy's work: its seed selection and its `decide` on the recorded logits (its per-request
    state restored before each replay) against `threshold`'s at the same draft threshold.
    """
    llm, threads = _llm(spec, decoding)
    work = Workload(spec, llm, max(repeats, 1))
    executor = llm.engine.executor
    rows = []
    for kv in spec.kv_caches:
        sp = work.params(spec, decoding, (kv, spec.cache_refreshes[0]))
        recorded = _record_steps(llm, lambda: [llm.generate([p], sp, use_tqdm=False)
                                               for p in work.prompts[:repeats]])
        steps = [(out, dec) for out, dec in recorded if any(i.override for i in out.items)
                 and (kv == "none" or not any(i.is_refresh for i in out.items))]
        if not steps:
            continue
        replay = [_Replay(out, *dec) for out, dec in steps]
        for r in replay[:2]:                                                 # warm-up
            r.step(executor.execute_model, True)
            r.step(executor.execute_model, False)
        times = {(v, part): [] for v in (True, False) for part in ("forward", "strategy")}
        for _ in range(replays):
            for r in replay:
                for verify in (True, False):
                    forward_s, strategy_s = r.step(executor.execute_model, verify)
                    times[verify, "forward"].append(forward_s)
                    times[verify, "strategy"].append(strategy_s)
        mean = {key: statistics.mean(v) for key, v in times.items()}
        step = {v: mean[v, "forward"] + mean[v, "strategy"] for v in (True, False)}
        seeds = statistics.mean(sum(len(i.override) for i in r.out.items) for r in replay)
        rows.append({"decoding": decoding, "kv_cache": kv, "steps": len(replay),
                     "seeds_per_step": seeds,
                     "forward_ms": 1e3 * mean[True, "forward"],
                     "forward_without_seeds_ms": 1e3 * mean[False, "forward"],
                     "ratio": mean[True, "forward"] / mean[False, "forward"],
                     "strategy_ms": 1e3 * mean[True, "strategy"],
                     "threshold_strategy_ms": 1e3 * mean[False, "strategy"],
                     "step_ms": 1e3 * step[True], "step_without_seeds_ms": 1e3 * step[False],
                     "step_ratio": step[True] / step[False]})
    return rows


class _StepRecorder(StepObserver):
    """Each step's SchedulerOutput and each decision's (strategy, StepBatch, every request's
    state copied before the decision)."""

    def __init__(self):
        self.outs, self.decisions = [], []

    def on_schedule(self, out) -> None:
        self.outs.append(out)

    def on_decide(self, strategy, batch) -> None:
        self.decisions.append((strategy, batch, [copy.deepcopy(st.extra) for st in batch.states]))


def _record_steps(llm: LLM, generate) -> list[tuple]:
    """Run `generate()` (one request at a time), recording each step's SchedulerOutput with its
    decision (a step observer: engine/observer.py)."""
    recorder = _StepRecorder()
    llm.engine.add_observer(recorder)
    try:
        generate()
    finally:
        llm.engine.remove_observer(recorder)
    outs, decisions = recorder.outs, recorder.decisions
    assert len(outs) == len(decisions), "one decision per recorded step (one request at a time)"
    return list(zip(outs, decisions))


class _Replay:
    """One recorded window step, replayable as recorded (seeds, the strategy's selection and
    decision) or without verification (no seeds or statistics, `threshold` at the same bar)."""

    def __init__(self, out, strategy, batch, saved_states):
        self.out, self.plain_out = out, _without_verification(out)
        self.strategy, self.batch, self.saved = strategy, batch, saved_states
        bar = getattr(strategy.params, "draft_threshold", None)
        self.threshold = strategy_class("threshold")(
            make_params("threshold", None if bar is None else {"threshold": bar}), strategy.spec)
        states = [BlockState(block_steps=st.block_steps) for st in batch.states]
        for st, n in zip(states, batch.host.candidates.sum(-1).tolist()):
            self.threshold.start_block(st, n)
        self.plain_batch = dataclasses.replace(batch, seeds=None, drift=None, attn_in=None,
                                               states=states)
        # each request's block as the scheduler handed it to `select_seeds` (seeds unmasked)
        self.blocks = [(row[blk], int(blk.nonzero()[0])) for row, blk in
                       zip(batch.host.tokens, batch.host.in_block)]

    def step(self, execute, verify: bool) -> tuple[float, float]:
        """(forward seconds, strategy seconds) of one replay; the strategy's share is the seed
        selection before the forward plus the decision after it."""
        strategy, batch = (self.strategy, self.batch) if verify else (self.threshold,
                                                                      self.plain_batch)
        if verify:
            for st, saved in zip(self.batch.states, self.saved):
                st.extra = copy.deepcopy(saved)
        start = time.perf_counter()
        for st, (tokens, begin) in zip(batch.states, self.blocks):
            strategy.select_seeds(st, tokens, begin)
        selected = time.perf_counter()
        execute(self.out if verify else self.plain_out)
        forward = time.perf_counter()
        decide_now(strategy, batch)                  # the decision, its copy and bookkeeping
        end = time.perf_counter()
        return forward - selected, (selected - start) + (end - forward)


def format_verification(rows: list[dict]) -> str:
    lines = ["| decoding | kv_cache | steps | seeds/step | forward ms | same window, no seeds ms"
             " | ratio | step ms (+ strategy) | threshold step ms | step ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['decoding']} | {r['kv_cache']} | {r['steps']} | "
                     f"{r['seeds_per_step']:.1f} | {r['forward_ms']:.3f} | "
                     f"{r['forward_without_seeds_ms']:.3f} | {r['ratio']:.3f} | "
                     f"{r['step_ms']:.3f} | {r['step_without_seeds_ms']:.3f} | "
                     f"{r['step_ratio']:.3f} |")
    return "\n".join(lines)
