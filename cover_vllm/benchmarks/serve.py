"""`cover-vllm bench serve`: an async load generator against a running OpenAI-compatible server.

For each concurrency level, that many clients send streaming /v1/completions requests back to
back for `duration_s`, or until `num_requests` have been sent (a soak), whichever comes first (a
request started before the end runs to its end, so none is cut). Per level: requests/s, output
tokens/s, TTFT (time to the first streamed text) mean/p50/p99, time per output token after the
first, end-to-end latency and the error count. Every request's streamed text and finish reason
are kept (`LevelResult.records`) so callers can check them. The server's resident memory and KV
pages (its /metrics) are sampled at the start and end of each level, and every `sample_every`
finished requests (`LevelResult.samples`): a long run shows whether the server grows.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

DEFAULT_PROMPTS = ("What is 12+30?", "Hello, world.", "The sum of 3 and 4 is",
                   "Write a short sentence about the sea.")


@dataclass(frozen=True)
class ServeBenchSpec:
    url: str                                   # http://127.0.0.1:8000 (no /v1)
    concurrency: tuple[int, ...] = (1, 8, 64)
    duration_s: float | None = 30.0            # None: no time limit (num_requests must be set)
    num_requests: int | None = None            # per level; None: no count limit
    sample_every: int | None = None            # sample the server's /metrics every N requests
    max_tokens: int = 64
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    model: str | None = None                   # None: the first id of GET /v1/models
    api_key: str | None = None
    temperature: float = 0.0
    extra_body: tuple = ()                     # ((key, value), ...): decoding, block_length, ...
    timeout_s: float = 600.0


@dataclass
class RequestRecord:
    prompt_index: int
    text: str = ""
    finish_reason: str | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    num_chunks: int = 0
    error: str | None = None


@dataclass(frozen=True)
class ServerSample:
    """The server's /metrics after `requests` finished requests (None: not exported)."""

    requests: int
    rss_bytes: float | None              # process_resident_memory_bytes (the server process)
    kv_pages_used: float | None
    kv_pages_total: float | None


@dataclass
class LevelResult:
    concurrency: int
    duration_s: float
    requests: int
    errors: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    latency_mean_s: float
    latency_p99_s: float
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    samples: list[ServerSample] = field(default_factory=list)

    def as_row(self) -> dict:
        row = asdict(self)
        row.pop("records")
        return row


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _body(spec: ServeBenchSpec, model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens,
            "temperature": spec.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **dict(spec.extra_body)}


async def _one_request(client, spec: ServeBenchSpec, model: str, index: int) -> RequestRecord:
    record = RequestRecord(prompt_index=index)
    start = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", "/v1/completions",
                                 json=_body(spec, model, spec.prompts[index])) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "error event")
                    return record
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        record.ttft_s = record.ttft_s or time.perf_counter() - start
                        record.text += choice["text"]
                        record.num_chunks += 1
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
    except Exception as exc:                   # connection errors count, they do not stop the run
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.latency_s = time.perf_counter() - start
    if not done or record.finish_reason is None:
        record.error = "stream ended without a finish_reason and [DONE]"
    return record


def _summarise(concurrency: int, elapsed: float, records: list[RequestRecord]) -> LevelResult:
    good = [r for r in records if r.error is None]
    ttfts = [r.ttft_s if r.ttft_s is not None else r.latency_s for r in good]
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in good
             if r.ttft_s is not None and r.output_tokens > 1]
    latencies = [r.latency_s for r in good]
    return LevelResult(
        concurrency=concurrency, duration_s=elapsed, requests=len(good),
        errors=len(records) - len(good), requests_per_s=len(good) / elapsed,
        output_tokens_per_s=sum(r.output_tokens for r in good) / elapsed,
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p50_s=_percentile(ttfts, 0.5), ttft_p99_s=_percentile(ttfts, 0.99),
        tpot_mean_s=statistics.fmean(tpots) if tpots else 0.0,
        latency_mean_s=statistics.fmean(latencies) if latencies else 0.0,
        latency_p99_s=_percentile(latencies, 0.99), records=records)


_SAMPLED = {"process_resident_memory_bytes": "rss_bytes", "cover_vllm_kv_pages_used":
            "kv_pages_used", "cover_vllm_kv_pages_total": "kv_pages_total"}


async def server_sample(client, requests: int) -> ServerSample:
    """The server's RSS and KV pages from GET /metrics (None for a series it lacks, or all of
    them when /metrics does not answer)."""
    values: dict[str, float | None] = dict.fromkeys(_SAMPLED.values())
    try:
        resp = await client.get("/metrics")
        text = resp.text if resp.status_code == 200 else ""
    except Exception:                          # a sample must never stop the run
        text = ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _SAMPLED:
            values[_SAMPLED[name]] = float(value)
    return ServerSample(requests, **values)


async def run_level(client, spec: ServeBenchSpec, model: str, concurrency: int) -> LevelResult:
    """`concurrency` clients sending back-to-back requests until the deadline or the count."""
    records: list[RequestRecord] = []
    samples = [await server_sample(client, 0)]
    counter = itertools.count()
    start = time.perf_counter()
    deadline = start + spec.duration_s if spec.duration_s is not None else float("inf")

    async def worker() -> None:
        while time.perf_counter() < deadline:
            number = next(counter)
            if spec.num_requests is not None and number >= spec.num_requests:
                return
            records.append(await _one_request(client, spec, model, number % len(spec.prompts)))
            if spec.sample_every and len(records) % spec.sample_every == 0:
                samples.append(await server_sample(client, len(records)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    if samples[-1].requests != len(records):
        samples.append(await server_sample(client, len(records)))
    result = _summarise(concurrency, elapsed, records)
    result.samples = samples
    return result


async def run_serve_bench_async(spec: ServeBenchSpec) -> list[LevelResult]:
    import httpx

    if not spec.prompts or any(c < 1 for c in spec.concurrency):
        raise ValueError("need at least one prompt and concurrency levels >= 1")
    if spec.duration_s is None and spec.num_requests is None:
        raise ValueError("give duration_s or num_requests (or both): a level needs an end")
    for name in ("duration_s", "num_requests", "sample_every"):
        value = getattr(spec, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0 (or None), got {value!r}")
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=max(spec.concurrency) + 4,
                          max_keepalive_connections=max(spec.concurrency) + 4)
    async with httpx.AsyncClient(base_url=spec.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(spec.timeout_s, connect=10.0)) as client:
        model = spec.model
        if model is None:
            resp = await client.get("/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        return [await run_level(client, spec, model, c) for c in spec.concurrency]


def run_serve_bench(spec: ServeBenchSpec) -> list[LevelResult]:
    return asyncio.run(run_serve_bench_async(spec))


def format_table(results: list[LevelResult]) -> str:
    """A markdown table, one row per concurrency level."""
    head = ("| concurrency | requests | errors | req/s | out tok/s | TTFT mean ms | TTFT p50 ms "
            "| TTFT p99 ms | TPOT ms | latency p99 s |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        lines.append(f"| {r.concurrency} | {r.requests} | {r.errors} | {r.requests_per_s:.2f} | "
                     f"{r.output_tokens_per_s:.1f} | {r.ttft_mean_s * 1e3:.1f} | "
                     f"{r.ttft_p50_s * 1e3:.1f} | {r.ttft_p99_s * 1e3:.1f} | "
                     f"{r.tpot_mean_s * 1e3:.2f} | {r.latency_p99_s:.2f} |")
    return "\n".join(lines)


def format_samples(results: list[LevelResult]) -> str:
    """A markdown table of the server's samples: RSS (MB) and KV pages used / total."""
    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value / 1e6:.1f}"

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    lines = ["| concurrency | requests done | server RSS MB | KV pages used | KV pages total |",
             "|" + "---|" * 5]
    for r in results:
        for s in r.samples:
            lines.append(f"| {r.concurrency} | {s.requests} | {mb(s.rss_bytes)} | "
                         f"{num(s.kv_pages_used)} | {num(s.kv_pages_total)} |")
    return "\n".join(lines)
