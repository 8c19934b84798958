"""The bench's reference loops, timed on the engine's own weights, dtype and prompts: the dense
LLaDA loop (reference_decode.py: no cache, batch 1, every row's `speedup_vs_reference`) and
Fast-dLLM's prefix/dual cache loops (reference_cache_decode.py: batch 1, the prefix/dual rows'
`speedup_vs_cache_reference`). A timed run of several is the median one (`repeats`)."""

from __future__ import annotations

import statistics
import time

from cover_vllm.benchmarks.machine import (dense_forward_flops, dtype_name,
                                           forward_weight_bytes, mfu_bound, utilization)
from cover_vllm.reference_cache_decode import CACHE_MODES, DecodeSchedule, reference_cache_generate
from cover_vllm.reference_decode import reference_generate


def runs_reference(model) -> bool:
    """Whether the reference loops apply: LLaDA's (no logit shift, full attention, [MASK])."""
    spec = model.spec
    return spec.logit_shift == 0 and not spec.attention.is_block_causal and \
        not spec.uniform_state


def _median_seconds(decode, prompts: list[list[int]], repeats: int) -> float:
    """Median over `repeats` runs of the seconds `decode(ids)` takes over every prompt."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for ids in prompts:
            decode(ids)
        runs.append(time.perf_counter() - start)
    return statistics.median_low(runs)


def run_reference(llm, work, count: int, peak_gflops: float, read_gbps: float,
                  repeats: int = 1) -> dict | None:
    """tokens/s of the dense reference loop (LLaDA semantics, 1 token/step) on `count` prompts."""
    model = llm.engine.executor.model
    if count <= 0 or not runs_reference(model):
        return None
    prompts = [p["prompt_token_ids"] for p in work.prompts[:count]]
    tokens = sum(work.useful_tokens(reference_generate(
        model, ids, work.output_len, work.block_length, work.output_len,
        model.spec.mask_token_id)) for ids in prompts)            # untimed: the tokens (warm-up)
    seconds = _median_seconds(lambda ids: reference_generate(
        model, ids, work.output_len, work.block_length, work.output_len,
        model.spec.mask_token_id), prompts, repeats)
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


def run_cache_reference(llm, work, mode: str, count: int, repeats: int = 1) -> dict | None:
    """tokens/s of Fast-dLLM's `mode` cache loop (batch 1, LLaDA's schedule, 1 token/step) on
    `count` prompts, after one untimed pass (the engine's rows get a warm-up too)."""
    model = llm.engine.executor.model
    if count <= 0 or not runs_reference(model):
        return None
    prompts = [p["prompt_token_ids"] for p in work.prompts[:count]]
    schedule = DecodeSchedule(work.output_len, work.block_length, work.output_len,
                              model.spec.mask_token_id)
    decoded = [reference_cache_generate(model, ids, schedule, mode) for ids in prompts]
    tokens = sum(work.useful_tokens(ids) for ids, _ in decoded)
    seconds = _median_seconds(lambda ids: reference_cache_generate(model, ids, schedule, mode),
                              prompts, repeats)
    return {"mode": mode, "tokens_per_s": tokens / seconds, "requests": len(prompts),
            "seconds": seconds, "nfe": sum(nfe for _, nfe in decoded) / len(decoded)}


def time_references(llm, work, spec, report: dict, log) -> None:
    """Once per dtype: the dense loop into report["reference"][dtype], and each cache mode of
    spec.kv_caches that has a loop (prefix, dual) into report["cache_reference"][dtype][mode]."""
    model = llm.engine.executor.model
    name = dtype_name(next(model.parameters()).dtype)
    if name in report["reference"] or not spec.reference_prompts or spec.device == "meta":
        return                                     # a shapes-only model yields no tokens
    machine = report["machine"]
    ref = run_reference(llm, work, spec.reference_prompts, machine["matmul_gflops"][name],
                        machine["read_gbps"], spec.repeats)
    report["reference"][name] = ref
    if ref:
        log(f"  reference loop ({name}): {ref['tokens_per_s']:.1f} tok/s  "
            f"MFU {ref['mfu']:.0%} (bound {ref['mfu_bound']:.0%})")
    cached = report.setdefault("cache_reference", {}).setdefault(name, {})
    for mode in (m for m in CACHE_MODES if m in spec.kv_caches):
        cached[mode] = run_cache_reference(llm, work, mode, spec.reference_prompts,
                                           spec.repeats)
        if cached[mode]:
            log(f"  {mode} cache loop ({name}, Fast-dLLM's): "
                f"{cached[mode]['tokens_per_s']:.1f} tok/s")
