"""`cover-vllm bench scale`: what a full-size model costs to load and run on this machine.

One process (run it fresh: the peak is the process's VmHWM since start): load seconds, the
memory plan (weight bytes, KV budget and pages), peak resident memory of every rank after
loading and after generating, then one COVER + dual-cache generation at batch 1 and one at
batch 4 (`output_len` tokens, one block, random prompt ids, EOS ignored): seconds per engine
step (all steps, and window steps without the block-start refresh), output tokens/s, MFU and
MBU (the weight bytes a step reads as stored, quantized or not, over the measured read rate;
`--quantization` runs the int8 / int4 / w8a8 model; a w8a8 row's MFU is against the measured
int8 GEMM peak, `mfu_dtype` against the model dtype's). The peaks are those of the device the
engine runs on (benchmarks/machine.py), measured after the generate rows.
`logits_path` saves the driver's logits of the very first forward (batch 1) so two runs, e.g.
TP=1 and TP=2, can be compared (`compare_logits`).

A uniform-state model (DiffusionGemma) runs its own decoder instead: `output_len` tokens in whole
canvases with `denoising_steps` decoder steps per canvas (its adaptive stop off, so every canvas
takes exactly that many), prompts of ordinary ids; a step is then one decoder forward of every
canvas (plus, at a canvas's start, the encoder); FLOPs come from the requests' counters (experts
counted as active per token), reported per generated token and per canvas position and step.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from cover_vllm.benchmarks.machine import (dtype_name, forward_weight_bytes, machine_info,
                                           utilization)
from cover_vllm.engine.observer import PHASES
from cover_vllm.llm import LLM
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.loader import resolve_dtype
from cover_vllm.models.spec import ModelSpec
from cover_vllm.sampling_params import SamplingParams

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ScaleSpec:
    model: str
    dtype: str = "auto"
    quantization: str | None = None        # int8 / int4 / w8a8 (EngineConfig)
    tensor_parallel_size: int = 1
    kv_cache_memory_bytes: int | None = None
    memory_utilization: float | None = None   # None: the engine default (0.9)
    threads: int | None = None
    input_len: int = 16
    output_len: int = 32
    batch_sizes: tuple[int, ...] = (1, 4)
    seed: int = 0
    logits_path: str | None = None
    denoising_steps: int = 2               # uniform-state models: decoder steps per canvas
    enforce_eager: bool = False            # vLLM's knob (EngineConfig.enforce_eager)


def _capture_first_logits(llm: LLM, path: str) -> None:
    """Wrap the executor so the first forward's driver logits are saved to `path` (fp32)."""
    executor = llm.engine.executor
    real = executor.execute_model

    def execute(out):
        result = real(out)
        logits = result.logits or [t for t in result.canvas_logits or [] if t is not None]
        if logits and not getattr(execute, "done", False):
            torch.save([t.float() for t in logits], path)
            execute.done = True
        return result
    executor.execute_model = execute


def _params(llm: LLM, spec: ScaleSpec) -> tuple[tuple[int, int], SamplingParams]:
    """The prompt id range and the request of one generate row."""
    es = llm.engine.spec
    if es.uniform_state:          # ids above the special ones; its own decoder, fixed steps
        knobs = {"max_denoising_steps": spec.denoising_steps, "confidence_threshold": 0.0}
        return (max(es.eos_token_ids) + 1, es.vocab_size), SamplingParams(
            max_tokens=spec.output_len, ignore_eos=True, seed=spec.seed, decoding_params=knobs)
    # one block of the whole output; a block-causal model decodes its own blocks
    block = None if es.attention.is_block_causal else spec.output_len
    return (0, es.mask_token_id), SamplingParams(   # ids below the mask id are ordinary tokens
        max_tokens=spec.output_len, block_length=block, ignore_eos=True, decoding="cover",
        kv_cache="dual", seed=spec.seed)


def _generate(llm: LLM, spec: ScaleSpec, batch: int) -> dict:
    gen = torch.Generator().manual_seed(spec.seed + batch)
    (low, high), params = _params(llm, spec)
    prompts = [{"prompt_token_ids": torch.randint(low, high, (spec.input_len,),
                                                  generator=gen).tolist()} for _ in range(batch)]
    llm.engine.step_times = []
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = llm.engine.step_times
    llm.engine.step_times = None
    totals = [sum(t[p] for p in PHASES) for t in steps]
    window = [s for s, t in zip(totals, steps) if not t["num_refresh"]] or totals
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ms = [o.metrics for o in outs]
    if llm.engine.spec.uniform_state:      # encoder + decoder calls: the requests' counters
        flops = sum(m.flops for m in ms)
        canvas = {"encoder_flops": sum(m.encoder_flops for m in ms),
                  "flops_per_position_step": (flops - sum(m.encoder_flops for m in ms))
                  / max(1, sum(m.nfe for m in ms) * llm.engine.spec.default_block_length)}
    else:
        flops = sum(llm.engine.flop_model.forward(t["num_tokens"], t["attn_pairs"],
                                                  t["logit_rows"]) for t in steps)
        canvas = {}
    return {"batch_size": batch, "steps": len(steps), "step_s": statistics.mean(totals),
            "flops": flops, "busy_s": sum(totals), "flops_per_token": flops / max(tokens, 1),
            **canvas,
            "window_step_s": statistics.mean(window), "forward_s": statistics.mean(
                t["forward"] for t in steps), "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "nfe": statistics.mean(o.metrics.nfe for o in outs),
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def run_scale(spec: ScaleSpec, log=print) -> dict:
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    resolved = resolve_model(spec.model)
    load_format = "dummy" if resolved.path is None else "auto"
    masked = not ModelSpec.from_config(resolved.config).uniform_state
    start = time.perf_counter()
    llm = LLM(spec.model, decoding="cover" if masked else None, kv_cache="dual",
              dtype=spec.dtype, seed=spec.seed,
              quantization=spec.quantization,
              tensor_parallel_size=spec.tensor_parallel_size, load_format=load_format,
              kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
              memory_utilization=spec.memory_utilization, num_threads=spec.threads,
              enforce_eager=spec.enforce_eager)
    load_s = time.perf_counter() - start
    plan = llm.engine.memory
    report = {"spec": dataclasses.asdict(spec),
              "machine": machine_info(read_rate=False, device=llm.engine.device),
              "load_s": load_s, "load_format": load_format, "weight_bytes": plan.weight_bytes,
              "kv_bytes": plan.kv_bytes, "kv_pages": plan.num_pages,
              "page_size": plan.page_size, "canvases": plan.canvases,
              "canvas_tokens": plan.canvas_tokens,
              "peak_rss_after_load": llm.engine.peak_memory_bytes()}
    log(f"loaded in {load_s:.1f} s; {plan.startup_line()}; peak RSS per rank "
        f"{[round(b / GiB, 2) for b in report['peak_rss_after_load']]} GiB")
    if spec.logits_path:
        _capture_first_logits(llm, spec.logits_path)
    report["generate"] = []
    for batch in spec.batch_sizes:
        row = _generate(llm, spec, batch)
        report["generate"].append(row)
        log(f"batch {batch}: {row['steps']} steps, {row['step_s']:.2f} s/step "
            f"({row['window_step_s']:.2f} s per window step), {row['tokens_per_s']:.2f} tok/s, "
            f"{row['flops_per_token'] / 1e9:.2f} GFLOP/token; peak RSS "
            f"{[round(b / GiB, 2) for b in llm.engine.peak_memory_bytes()]} GiB")
    report["peak_rss"] = llm.engine.peak_memory_bytes()
    _roofline(llm, report)
    llm.shutdown()
    return report


def _roofline(llm: LLM, report: dict) -> None:
    """MFU (model FLOPs / step time / the GEMM peak in the model dtype) and MBU (weight bytes a
    step reads, quantized as stored, / step time / the read rate) of every generate row; the
    probes run after the peak memory was read, so they do not count in it."""
    config, quant = llm.engine.config, llm.engine.quantization
    dtype = resolve_dtype(config.dtype, llm.engine.spec, config.device)
    w8a8 = quant is not None and quant.method == "w8a8"
    machine = machine_info((dtype,), int8=True, device=llm.engine.device)
    peaks = machine["matmul_gflops"]
    peak, read = peaks[dtype_name(dtype)], machine["read_gbps"]
    per_forward = forward_weight_bytes(llm.engine.flop_model, dtype, quant)
    report["machine"] = machine
    report["weight_bytes_per_forward"] = per_forward
    for row in report["generate"]:
        rate, at = row["flops"] / row["busy_s"] / 1e9, f"batch {row['batch_size']}"
        row["mfu"] = utilization(rate, peaks.get("int8", peak) if w8a8 else peak,
                                 f"{at} MFU")                          # its own arithmetic
        row["mfu_dtype"] = rate / peak                                 # against `dtype`'s
        row["mbu"] = row["steps"] * per_forward / row["busy_s"] / (read * 1e9)


def format_scale(report: dict) -> str:
    peaks = ", ".join(f"{b / GiB:.2f}" for b in report["peak_rss"])
    lines = [f"model {report['spec']['model']} ({report['load_format']}), "
             f"TP={report['spec']['tensor_parallel_size']}, "
             f"{report['machine']['threads']} threads",
             f"quantization {report['spec'].get('quantization') or 'none'}, "
             f"load {report['load_s']:.1f} s, weights {report['weight_bytes'] / GiB:.2f} GiB, "
             f"KV {report['kv_bytes'] / GiB:.2f} GiB ({report['kv_pages']} pages), "
             f"peak RSS per rank [{peaks}] GiB",
             f"peak GEMM rate on {report['machine'].get('device', 'cpu')} "
             + ", ".join(f"{name} {rate}" for name, rate in
                         report["machine"]["matmul_gflops"].items())
             + " GOP/s (MFU: against the peak of the arithmetic the projections run in; "
             "MFU dtype: against the model dtype's)",
             "| batch | steps | s/step | s/window step | tokens/s | NFE | GFLOP/token | MFU | "
             "MFU dtype | MBU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["generate"]:
        lines.append(f"| {r['batch_size']} | {r['steps']} | {r['step_s']:.2f} | "
                     f"{r['window_step_s']:.2f} | {r['tokens_per_s']:.2f} | {r['nfe']:.0f} | "
                     f"{r['flops_per_token'] / 1e9:.2f} | {r['mfu']:.1%} | "
                     f"{r['mfu_dtype']:.1%} | {r['mbu']:.1%} |")
    return "\n".join(lines)


def compare_logits(path_a: str, path_b: str) -> float:
    """Max |a - b| over the first-forward logits saved by two runs (`logits_path`)."""
    a, b = torch.load(path_a), torch.load(path_b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))
