"""`cover-vllm bench throughput`: every (decoding, kv_cache, cache_refresh, batch size) combination
in one run (refresh policies apply to the prefix/dual rows; `none` runs once).

A uniform-state model (DiffusionGemma) runs its own decoder (default `diffusion_gemma`) in one
row per decoding and batch size (its encoder cache is exact: no cache modes), with no reference
loop (that loop is LLaDA's), and reports what its steps do instead: decoder steps per canvas,
tokens the entropy bound accepted per step, and the encoder's share of the model FLOPs.

Prompts are random token ids (every request decodes exactly --output-len slots, ignore_eos) or a
task's held-out split (--task: accuracy from the task's verifier; tokens counted up to EOS).
Each combination gets a warm-up first. A separately written dense loop (reference_decode: no
cache, batch 1, one token per step) runs on the same weights, dtype and prompts in the same
process, so every row has a ×-vs-reference ratio measured side by side. MFU divides by the peak
GEMM rate measured in the row's own dtype (a bf16 row against the bf16 peak) on the device the
model runs on (benchmarks/machine.py: CUDA rows against the GPU's own peaks); an MFU above 100 %
is logged as the bug it is. Compare ratios within one run. With `repeats` > 1 every combination
runs that many times, round-robin (so a machine whose speed drifts slows every row alike), and
its row reports the run of median time. A step's time is split three ways: the forward, the
decoders' work on the logits' device (CPU: from one more, untimed pass) and the host's share,
the rest (engine/timing.py). On CUDA a row also reports the forward's device time per step
(CUDA events); `count_ops` adds the ops of every step (benchmarks/step_ops.py)."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from cover_vllm.benchmarks.machine import (dense_forward_flops, dtype_name,
                                           forward_weight_bytes, machine_info, mfu_bound,
                                           pin_threads, step_flops, utilization)
from cover_vllm.benchmarks.report import device_text, rates_text, spread_text, step_text
from cover_vllm.benchmarks.step_ops import count_row_ops, decide_ms_per_step
from cover_vllm.llm import LLM
from cover_vllm.flops import flops_per_token
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.loader import resolve_dtype
from cover_vllm.models.spec import ModelSpec
from cover_vllm.reference_decode import reference_generate
from cover_vllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ThroughputSpec:
    model: str
    decodings: tuple[str, ...] = ("low_confidence",)
    kv_caches: tuple[str, ...] = ("dual",)
    cache_refreshes: tuple[str, ...] = ("block",)   # refresh policies for prefix/dual rows
    batch_sizes: tuple[int, ...] = (1,)
    num_prompts: int | None = None     # default: 2 x the batch size
    input_len: int = 64
    output_len: int = 128
    block_length: int | None = None    # None: the model's (ModelSpec.default_block_length:
                                       # 32 for full attention, a block-causal model's block)
    steps: int | None = None
    threads: int | None = None
    seed: int = 0
    task: str | None = None
    reference_prompts: int = 1         # requests timed through the reference loop (0: skip)
    decoding_params: tuple = ()        # ((strategy, {params}), ...)
    dtypes: tuple[str, ...] = ("auto",)   # weights and activations: each is a set of rows
    repeats: int = 1                   # timed runs of every combination, round-robin
    quantization: str | None = None    # EngineConfig.quantization: weight-only int8 / int4
    device: str = "cpu"                # EngineConfig.device ("meta": host work alone)
    kv_cache_memory_bytes: int | None = None
    count_ops: bool = False            # one extra, untimed run per row counting ops per step
    enforce_eager: bool = False        # vLLM's knob (EngineConfig.enforce_eager)


@dataclass
class ThroughputRow:
    dtype: str
    decoding: str
    kv_cache: str
    cache_refresh: str                 # "-" for kv_cache="none" (every step is a refresh)
    batch_size: int
    num_prompts: int
    tokens_per_s: float
    requests_per_s: float
    nfe_per_token: float
    tokens_per_step: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p99_s: float
    accuracy: float | None
    remasks: float
    flip_flops: float
    peak_kv_pages: int
    overhead_fraction: float           # share of step time outside the model forward
    mfu: float | None                  # model FLOPs / time / measured matmul peak in `dtype`
                                       # (None on the shapes-only "meta" device)
    speedup_vs_reference: float | None
    seconds: float
    gflops_per_token: float            # model FLOPs spent per useful token
    flop_ratio_vs_reference: float | None   # reference GFLOP/token over this row's: the
                                            # speed-up at equal MFU
    refreshes: float = 0.0             # full-canvas forwards per request
    flops_per_token: float = 0.0       # model FLOPs / generated slots (cover_vllm/flops.py)
    mfu_bound: float | None = 1.0      # the roofline: the highest MFU these forwards can reach
                                       # streaming their weights at the measured read rate
    mbu: float | None = 0.0            # weight bytes read per second / the measured read rate
    repeats: int = 1                   # timed runs; the time-derived fields are the median run's
    tokens_per_s_runs: tuple[float, ...] = ()   # every run's tokens/s, in run order
    prefix_hit_rate: float | None = None   # prompt tokens found in the prefix cache / looked
                                           # up, over the row's requests (None: no lookups:
                                           # prefix caching off, full attention, kv_cache none)
    host_ms_per_step: float = 0.0      # a step's wall time the device waits for the host
                                       # (mean): outside the forward and the decoders' work on
                                       # the logits (scheduling, layout, the decisions' Python
                                       # and small ops, their copy, updates; engine/timing.py)
    forward_ms_per_step: float = 0.0   # the model forward (the executor call minus layout)
    decide_ms_per_step: float | None = None   # the decoders' work on the logits' device (CPU:
                                              # time inside the aten ops on the logits; CUDA:
                                              # their span by events; None on meta)
    host_bytes_per_step: float = 0.0   # bytes copied from the device to the host per step
                                       # (0 on a CPU engine: nothing moves)
    canvas_steps: float | None = None  # uniform-state: decoder steps per canvas (mean)
    accepted_per_step: float | None = None   # positions the entropy bound accepted per step
    encoder_flop_share: float | None = None  # encoder FLOPs / all model FLOPs
    device_ms_per_step: float | None = None  # CUDA: the forward's span on the device (CUDA
                                             # events, mean); None on any other device
    # --count-ops (benchmarks/step_ops.py), per step: ops with an output on the device (CUDA:
    # launches and views; None on the CPU), of which not views, ops on the host, ops inside
    # the executor call
    device_ops_per_step: float | None = None
    launches_per_step: float | None = None
    host_ops_per_step: float | None = None
    forward_ops_per_step: float | None = None


def default_decodings(model: str) -> tuple[str, ...]:
    """The bench's decoders when none are given: low_confidence, or a uniform-state model's
    own (the only kind it can run)."""
    spec = ModelSpec.from_config(resolve_model(model).config)
    return (spec.default_decoding,) if spec.uniform_state else ("low_confidence",)


def prefix_hit_rate(metrics) -> float | None:
    """Cached prompt tokens over prompt tokens looked up in the prefix cache, summed over
    requests (RequestMetrics); None when nothing was looked up."""
    queried = sum(m.prefix_query_tokens for m in metrics)
    return sum(m.cached_prompt_tokens for m in metrics) / queried if queried else None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Workload:
    """The prompts, lengths and verifier of one benchmark run."""

    def __init__(self, spec: ThroughputSpec, llm: LLM, n: int):
        self.task = None
        if spec.task is not None:
            from cover_vllm.tasks import chat_prompt_ids, get_task

            self.task = get_task(spec.task)
            self.examples = self.task.eval_split(n)
            self.prompts = [{"prompt_token_ids": chat_prompt_ids(llm.tokenizer, ex.prompt)}
                            for ex in self.examples]
            self.output_len, self.block_length = self.task.max_tokens, self.task.block_length
        else:
            es = llm.engine.spec
            # below EOS and [MASK]; uniform-state: above the special ids (pad, EOS, bos)
            low, high = ((max(es.eos_token_ids) + 1, es.vocab_size) if es.uniform_state
                         else (0, min(es.eos_token_ids + (es.mask_token_id,))))
            rng = random.Random(spec.seed)
            self.prompts = [{"prompt_token_ids": [rng.randrange(low, high) for _ in
                                                  range(spec.input_len)]} for _ in range(n)]
            self.output_len = spec.output_len
            self.block_length = spec.block_length or llm.engine.spec.default_block_length
        self.eos = set(llm.engine.spec.eos_token_ids)
        self.uniform_state = llm.engine.spec.uniform_state

    def params(self, spec: ThroughputSpec, decoding: str, cache: tuple[str, str]
               ) -> SamplingParams:
        kv, refresh = cache
        if self.uniform_state:            # whole canvases; no block, steps or cache knobs
            return SamplingParams(max_tokens=self.output_len, ignore_eos=self.task is None,
                                  decoding=decoding,
                                  decoding_params=dict(spec.decoding_params).get(decoding))
        return SamplingParams(max_tokens=self.output_len, block_length=self.block_length,
                              steps=spec.steps, ignore_eos=self.task is None, decoding=decoding,
                              decoding_params=dict(spec.decoding_params).get(decoding),
                              kv_cache=kv, cache_refresh=None if kv == "none" else refresh)

    def accuracy(self, outs) -> float | None:
        if self.task is None:
            return None
        return statistics.mean(float(self.task.check(ex.prompt, o.outputs[0].text))
                               for ex, o in zip(self.examples, outs))

    def useful_tokens(self, ids: list[int]) -> int:
        """Tokens a user receives: all of them, or up to and including the first EOS (tasks)."""
        if self.task is None:
            return len(ids)
        cut = next((i for i, t in enumerate(ids) if t in self.eos), None)
        return len(ids) if cut is None else cut + 1


def run_reference(llm: LLM, work: Workload, count: int, peak_gflops: float,
                  read_gbps: float) -> dict | None:
    """tokens/s of the dense reference loop (LLaDA semantics, 1 token/step) on `count` prompts."""
    model = llm.engine.executor.model
    if count <= 0 or model.spec.logit_shift != 0 or model.spec.attention.is_block_causal \
            or model.spec.uniform_state:
        return None                      # the reference loop is LLaDA's (no logit shift, full
                                         # attention, [MASK])
    prompts = [p["prompt_token_ids"] for p in work.prompts[:count]]
    tokens, start = 0, time.perf_counter()
    for ids in prompts:
        out = reference_generate(model, ids, work.output_len, work.block_length,
                                 work.output_len, model.spec.mask_token_id)
        tokens += work.useful_tokens(out)
    seconds = time.perf_counter() - start
    per_token = llm.engine.flop_model.params_per_token      # whole model, even if packed
    flops = sum(work.output_len * dense_forward_flops(model.dims, per_token,
                                                      len(ids) + work.output_len)
                for ids in prompts)             # one full forward per step, output_len steps
    dtype = next(model.parameters()).dtype
    streamed = work.output_len * len(prompts) * forward_weight_bytes(
        llm.engine.flop_model, dtype, llm.engine.quantization)
    return {"dtype": dtype_name(dtype),
            "tokens_per_s": tokens / seconds, "requests": len(prompts), "seconds": seconds,
            "tokens_per_step": 1.0, "gflops_per_token": flops / tokens / 1e9,
            "mfu": utilization(flops / seconds / 1e9, peak_gflops,
                               f"reference loop ({dtype_name(dtype)}) MFU"),
            "mfu_bound": mfu_bound(flops, streamed, peak_gflops, read_gbps)}


class _Run(NamedTuple):
    """One timed run of a combination."""

    outs: list
    seconds: float
    overhead: float          # share of step time outside the model forward
    flops: float             # model FLOPs of every step
    forwards: int            # engine steps
    peak_kv_pages: int
    host_ms: float           # per step, outside the forward and the decide (mean)
    host_bytes: float        # per step, device to host (mean)
    device_ms: float | None  # per step, the forward on the device (CUDA events; else None)
    forward_ms: float        # per step, the forward on the host clock (mean)
    decide_ms: float | None  # per step, the decoders' work on the logits (None: not timed)


def _measure(llm: LLM, work: Workload, sp: SamplingParams) -> _Run:
    engine = llm.engine
    llm.generate(work.prompts[:1], sp, use_tqdm=False)               # warm-up
    llm.reset_prefix_cache()        # a run reuses no prompt block of the warm-up or other runs
    engine.pool.peak_used, engine.step_times = 0, []
    start = time.perf_counter()
    outs = llm.generate(work.prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    times, engine.step_times = engine.step_times, None
    per_token = engine.flop_model.params_per_token
    total = sum(t["schedule"] + t["prepare"] + t["forward"] + t["strategy"] + t["update"]
                for t in times)
    if engine.spec.uniform_state:        # encoder and decoder calls: the requests' own counts
        flops = sum(o.metrics.flops for o in outs)
    else:
        flops = sum(step_flops(engine.executor.model.dims, per_token, t) for t in times)
    forward = sum(t["forward"] for t in times)
    overhead = 1.0 - forward / total if total else 0.0
    steps = max(len(times), 1)
    decide = [t["decide_device"] for t in times]        # CUDA: events; CPU: one more pass
    decide_ms = (1e3 * sum(decide) / steps if times and None not in decide else
                 decide_ms_per_step(llm, work.prompts[:engine.config.max_num_seqs], sp))
    host_ms = 1e3 * (total - forward) / steps - (decide_ms or 0.0)
    host_bytes = sum(t["host_bytes"] for t in times) / steps
    device = [t["device_forward"] for t in times]
    device_ms = (1e3 * sum(device) / steps if times and None not in device else None)
    return _Run(outs, seconds, overhead, flops, len(times), engine.pool.peak_used, host_ms,
                host_bytes, device_ms, 1e3 * forward / steps, decide_ms)


def run_throughput(spec: ThroughputSpec, log=print) -> dict:
    threads = pin_threads(spec.model, spec.threads)
    resolved = resolve_model(spec.model)
    model_spec = ModelSpec.from_config(resolved.config)
    dtypes = [resolve_dtype(d, model_spec, spec.device) for d in dict.fromkeys(spec.dtypes)]
    machine = machine_info(tuple(dtypes), device=spec.device)
    load_format = "dummy" if resolved.path is None else "auto"
    report = {"machine": machine, "model": spec.model, "reference": {}, "results": [],
              "quantization": spec.quantization}
    if not spec.decodings:
        spec = dataclasses.replace(spec, decodings=default_decodings(spec.model))
    for dtype in dtypes:
        name = dtype_name(dtype)
        peak = machine["matmul_gflops"][name]
        for bs in spec.batch_sizes:
            llm = LLM(spec.model, decoding=spec.decodings[0], kv_cache=spec.kv_caches[0],
                      max_num_seqs=bs, load_format=load_format, seed=spec.seed,
                      num_threads=threads, dtype=name, quantization=spec.quantization,
                      device=spec.device, kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
                      enforce_eager=spec.enforce_eager)
            work = Workload(spec, llm, spec.num_prompts or 2 * bs)
            if name not in report["reference"] and spec.reference_prompts and \
                    spec.device != "meta":             # a shapes-only model yields no tokens
                ref = run_reference(llm, work, spec.reference_prompts, peak,
                                    machine["read_gbps"])
                report["reference"][name] = ref
                if ref:
                    log(f"  reference loop ({name}): {ref['tokens_per_s']:.1f} tok/s  "
                        f"MFU {ref['mfu']:.0%} (bound {ref['mfu_bound']:.0%})")
            _run_batch(spec, llm, work, name, peak, report, log)
    return report


def _run_batch(spec: ThroughputSpec, llm: LLM, work: Workload, dtype: str, peak: float,
               report: dict, log) -> None:
    """Every (decoding, cache, refresh) row of one engine (one dtype and batch size)."""
    bs = llm.engine.config.max_num_seqs
    ref = report["reference"].get(dtype) or {}
    read_gbps = report["machine"]["read_gbps"]
    caches = [(kv, "-" if kv == "none" else refresh) for kv in spec.kv_caches
              for refresh in (("-",) if kv == "none" else spec.cache_refreshes)]
    if work.uniform_state:
        caches = [("-", "-")]

    def record(combo: tuple[str, str, str], measured: list[_Run]) -> None:
        """Append and log the row of one combination from its runs (the median run's times)."""
        decoding, kv, refresh = combo
        median = statistics.median_low(run.seconds for run in measured)
        run = next(run for run in measured if run.seconds == median)
        outs, seconds, overhead, flops, forwards, peak_pages, host_ms, host_bytes = run[:8]
        streamed = forwards * forward_weight_bytes(llm.engine.flop_model,
                                                   getattr(torch, dtype),
                                                   llm.engine.quantization)
        ms = [o.metrics for o in outs]
        tokens = sum(work.useful_tokens(o.outputs[0].token_ids) for o in outs)
        gflops = flops / max(tokens, 1) / 1e9
        lat = [m.latency_s for m in ms]
        row = ThroughputRow(
            dtype=dtype, decoding=decoding, kv_cache=kv, cache_refresh=refresh,
            batch_size=bs, num_prompts=len(outs),
            tokens_per_s=tokens / seconds, requests_per_s=len(outs) / seconds,
            nfe_per_token=statistics.mean(m.nfe / max(m.decoded_tokens, 1) for m in ms),
            tokens_per_step=statistics.mean(m.tokens_per_step for m in ms),
            latency_mean_s=statistics.mean(lat), latency_p50_s=_percentile(lat, 0.5),
            latency_p99_s=_percentile(lat, 0.99), accuracy=work.accuracy(outs),
            remasks=statistics.mean(m.remasks for m in ms),
            flip_flops=statistics.mean(m.flip_flops for m in ms),
            peak_kv_pages=peak_pages, overhead_fraction=overhead,
            mfu=None if spec.device == "meta" else utilization(
                flops / seconds / 1e9, peak, f"{dtype} {decoding} {kv} bs={bs} MFU"),
            speedup_vs_reference=(tokens / seconds / ref["tokens_per_s"]) if ref else None,
            seconds=seconds, gflops_per_token=gflops,
            flop_ratio_vs_reference=(ref["gflops_per_token"] / gflops) if ref else None,
            refreshes=statistics.mean(m.refreshes for m in ms),
            flops_per_token=flops_per_token(ms),
            mfu_bound=mfu_bound(flops, streamed, peak, read_gbps),
            mbu=streamed / seconds / (read_gbps * 1e9), repeats=len(measured),
            tokens_per_s_runs=tuple(tokens / run.seconds for run in measured),
            prefix_hit_rate=prefix_hit_rate(ms), host_ms_per_step=host_ms,
            host_bytes_per_step=host_bytes, device_ms_per_step=run.device_ms,
            forward_ms_per_step=run.forward_ms, decide_ms_per_step=run.decide_ms,
            **_canvas_stats(ms, work), **counts[combo])
        if spec.device == "meta":           # no arithmetic ran: rates against peaks mean nothing
            row = dataclasses.replace(row, mfu=None, mfu_bound=None, mbu=None)
        report["results"].append(asdict(row))
        canvas = ("" if row.canvas_steps is None else
                  f"  steps/canvas {row.canvas_steps:.1f}  accepted/step "
                  f"{row.accepted_per_step:.2f}  encoder FLOPs {row.encoder_flop_share:.1%}")
        log(f"  {dtype:>8} {decoding:>15} {kv:>6} {refresh:>10} bs={bs:<3} "
            f"{row.tokens_per_s:8.1f} tok/s  {rates_text(row)}{canvas}  refreshes "
            f"{row.refreshes:.2f}  NFE/token {row.nfe_per_token:.3f}  overhead "
            f"{overhead:.0%}  {step_text(row)}, {host_bytes / 1e3:.1f} kB/step to "
            f"the host{device_text(row)}  ({seconds:.1f}s{spread_text(row)})")

    combos = [(decoding, kv, refresh) for decoding in spec.decodings for kv, refresh in caches]
    runs: dict[tuple[str, str, str], list[_Run]] = {combo: [] for combo in combos}
    counts: dict[tuple[str, str, str], dict] = {}       # --count-ops, after the timed runs
    for last in [False] * (spec.repeats - 1) + [True]:   # round-robin: drift slows every row
        for combo in combos:                            # alike; a row is logged after its
            decoding, kv, refresh = combo               # last run
            params = work.params(spec, decoding, (kv, refresh))
            runs[combo].append(_measure(llm, work, params))
            if last:
                counts[combo] = (count_row_ops(llm, work.prompts[:bs], params)
                                 if spec.count_ops else {})
                counts[combo].pop("counted_steps", None)
                record(combo, runs[combo])


def _canvas_stats(ms: list, work: Workload) -> dict:
    """A uniform-state row's canvas columns (empty for a masked-diffusion row)."""
    if not work.uniform_state:
        return {}
    flops = sum(m.flops for m in ms)
    return {"canvas_steps": sum(m.nfe for m in ms) / max(1, sum(m.canvases for m in ms)),
            "accepted_per_step": sum(m.accepted_tokens for m in ms) / max(1, sum(m.steps
                                                                              for m in ms)),
            "encoder_flop_share": sum(m.encoder_flops for m in ms) / flops if flops else 0.0}
