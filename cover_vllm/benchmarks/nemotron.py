"""`bench throughput` for Nemotron-Labs-Diffusion: its three decodings of one checkpoint side by
side (`nemotron` block diffusion with a causal commit, `ar`, `linear_spec` self-speculation) on
the same engine, weights and prompts, per dtype and batch size.

Every request decodes exactly --output-len tokens (ignore_eos) from random prompt ids of
--input-len; each row gets a warm-up first and reports tokens/s, forwards (NFE) per token, the
mean acceptance length per verify (linear_spec), latency, and its speed against the `ar` row.
The rows use the keys of the engine's table (benchmarks/report.py), `kv_cache` "slot" (the
runner's cache, engine/nemotron_runner.py).
"""

from __future__ import annotations

import random
import statistics
import time

from cover_vllm.benchmarks.machine import dtype_name, machine_info, pin_threads
from cover_vllm.benchmarks.throughput import ThroughputSpec, run_throughput
from cover_vllm.llm import LLM
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.loader import resolve_dtype
from cover_vllm.models.spec import ModelSpec
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.strategies import CAUSAL_DECODERS

MODES = tuple(CAUSAL_DECODERS)          # nemotron, ar, linear_spec


def bench_throughput(spec: ThroughputSpec, load_format: str = "auto", log=print) -> dict:
    """`cover-vllm bench throughput`: a causal-commit model's (Nemotron-Labs-Diffusion) three
    decodings side by side, any other model the engine's rows (throughput.run_throughput).
    `load_format="dummy"`: random weights (always so for a built-in shape)."""
    resolved = resolve_model(spec.model)
    model_spec = ModelSpec.from_config(resolved.config)
    if not model_spec.attention.causal_commit:
        return run_throughput(spec, log)
    threads = pin_threads(spec.model, spec.threads)
    dtypes = [resolve_dtype(d, model_spec, spec.device) for d in dict.fromkeys(spec.dtypes)]
    report = {"machine": machine_info(tuple(dtypes), device=spec.device), "model": spec.model,
              "reference": {}, "results": [], "quantization": spec.quantization}
    dummy = resolved.path is None or load_format == "dummy"
    return run_nemotron_throughput(spec, report, [dtype_name(d) for d in dtypes],
                                   "dummy" if dummy else "auto", threads, log)


def run_nemotron_throughput(spec, report: dict, dtypes: list[str], load_format: str,
                            threads: int | None, log=print) -> dict:
    """Fill report["results"] with one row per (dtype, batch size, decoding)."""
    modes = tuple(d for d in spec.decodings if d in MODES) or MODES
    for name in dtypes:
        for bs in spec.batch_sizes:
            llm = LLM(spec.model, max_num_seqs=bs, load_format=load_format, seed=spec.seed,
                      num_threads=threads, dtype=name, quantization=spec.quantization,
                      device=spec.device, kv_cache_memory_bytes=spec.kv_cache_memory_bytes)
            rng = random.Random(spec.seed)
            vocab = llm.engine.spec.vocab_size
            n = spec.num_prompts or 2 * bs
            prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(spec.input_len)]}
                       for _ in range(n)]
            rows = [_row(llm, prompts, spec, mode, name, bs) for mode in modes]
            ar = next((r["tokens_per_s"] for r in rows if r["decoding"] == "ar"), None)
            for row in rows:
                row["speedup_vs_ar"] = row["tokens_per_s"] / ar if ar else None
            report["results"] += rows
            log(side_by_side(rows))
    return report


def _row(llm: LLM, prompts: list, spec, mode: str, dtype: str, bs: int) -> dict:
    knobs = dict(spec.decoding_params).get(mode)
    sp = SamplingParams(max_tokens=spec.output_len, block_length=spec.block_length,
                        decoding=mode, decoding_params=knobs, ignore_eos=True)
    llm.generate(prompts[:1], sp, use_tqdm=False)                     # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    nfe = sum(o.metrics.nfe for o in outs)
    verifies = sum(o.metrics.verifies for o in outs)
    lat = sorted(o.metrics.latency_s for o in outs)
    return {"dtype": dtype, "decoding": mode, "kv_cache": "slot", "batch_size": bs,
            "num_prompts": len(prompts), "tokens_per_s": tokens / seconds,
            "requests_per_s": len(prompts) / seconds, "nfe_per_token": nfe / tokens,
            "tokens_per_step": tokens / nfe, "latency_mean_s": statistics.mean(lat),
            "latency_p50_s": lat[len(lat) // 2], "latency_p99_s": lat[-1],
            "accepted_per_step": (sum(o.metrics.accepted_tokens for o in outs) / verifies
                                  if verifies else None)}


def side_by_side(rows: list[dict]) -> str:
    """The modes of one (dtype, batch size) as a small table."""
    head = f"  {rows[0]['dtype']} bs={rows[0]['batch_size']}:"
    lines = [head, "  | decoding | tok/s | vs ar | NFE/token | accepted/verify | latency s |",
             "  |---|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["accepted_per_step"] is None else f"{r['accepted_per_step']:.2f}"
        vs = "-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x"
        lines.append(f"  | {r['decoding']} | {r['tokens_per_s']:.2f} | {vs} | "
                     f"{r['nfe_per_token']:.3f} | {acc} | {r['latency_mean_s']:.2f} |")
    return "\n".join(lines)
