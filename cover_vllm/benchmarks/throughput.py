"""`cover-vllm bench throughput`: every (decoding, kv_cache, batch size) combination in one run.

Prompts are random token ids (or a task's held-out split with --task); every request decodes
exactly --output-len slots (ignore_eos), so tokens/s compares like with like. Each combination
gets a warm-up generate first. Compare ratios within one run: absolute times on shared CPUs drift.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from cover_vllm.entrypoints.llm import LLM
from cover_vllm.models.builtin import resolve_model
from cover_vllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ThroughputSpec:
    model: str
    decodings: tuple[str, ...] = ("low_confidence",)
    kv_caches: tuple[str, ...] = ("dual",)
    batch_sizes: tuple[int, ...] = (1,)
    num_prompts: int | None = None     # default: 2 x the batch size
    input_len: int = 64
    output_len: int = 128
    block_length: int = 32
    steps: int | None = None
    threads: int | None = None
    seed: int = 0


@dataclass
class ThroughputRow:
    decoding: str
    kv_cache: str
    batch_size: int
    num_prompts: int
    tokens_per_s: float
    requests_per_s: float
    nfe_per_token: float
    tokens_per_step: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p99_s: float
    peak_kv_pages: int
    seconds: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(n)]


def run_throughput(spec: ThroughputSpec, log=print) -> list[ThroughputRow]:
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    load_format = "dummy" if resolve_model(spec.model).path is None else "auto"
    rows = []
    for bs in spec.batch_sizes:
        llm = LLM(spec.model, decoding=spec.decodings[0], kv_cache=spec.kv_caches[0],
                  max_num_seqs=bs, load_format=load_format, seed=spec.seed)
        vocab = min(llm.engine.spec.eos_token_ids + (llm.engine.spec.mask_token_id,))
        n = spec.num_prompts or 2 * bs
        prompts = random_prompts(n, spec.input_len, vocab, spec.seed)
        for decoding in spec.decodings:
            for kv in spec.kv_caches:
                sp = SamplingParams(max_tokens=spec.output_len, block_length=spec.block_length,
                                    steps=spec.steps, ignore_eos=True, decoding=decoding,
                                    kv_cache=kv)
                llm.generate(prompts[:1], sp, use_tqdm=False)            # warm-up
                llm.engine.pool.peak_used = 0
                start = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                seconds = time.perf_counter() - start
                lat = [o.metrics.latency_s for o in outs]
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                row = ThroughputRow(
                    decoding=decoding, kv_cache=kv, batch_size=bs, num_prompts=n,
                    tokens_per_s=tokens / seconds, requests_per_s=n / seconds,
                    nfe_per_token=statistics.mean(o.metrics.nfe for o in outs) / spec.output_len,
                    tokens_per_step=statistics.mean(o.metrics.tokens_per_step for o in outs),
                    latency_mean_s=statistics.mean(lat), latency_p50_s=_percentile(lat, 0.5),
                    latency_p99_s=_percentile(lat, 0.99), peak_kv_pages=llm.engine.pool.peak_used,
                    seconds=seconds)
                rows.append(row)
                log(f"  {decoding:>15} {kv:>6} bs={bs:<3} {row.tokens_per_s:8.1f} tok/s  "
                    f"NFE/token {row.nfe_per_token:.3f}  ({seconds:.1f}s)")
    return rows


COLUMNS = [("decoding", "{}"), ("kv_cache", "{}"), ("batch_size", "{}"), ("num_prompts", "{}"),
           ("tokens_per_s", "{:.1f}"), ("requests_per_s", "{:.2f}"), ("nfe_per_token", "{:.3f}"),
           ("tokens_per_step", "{:.2f}"), ("latency_mean_s", "{:.2f}"),
           ("latency_p50_s", "{:.2f}"), ("latency_p99_s", "{:.2f}"), ("peak_kv_pages", "{}")]


def format_table(rows: list[ThroughputRow]) -> str:
    lines = ["| " + " | ".join(n for n, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(f.format(getattr(row, n)) for n, f in COLUMNS) + " |")
    return "\n".join(lines)


def rows_as_dicts(rows: list[ThroughputRow]) -> list[dict]:
    return [asdict(r) for r in rows]
