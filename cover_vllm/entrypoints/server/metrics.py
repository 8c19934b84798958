"""ServerMetrics: the Prometheus series behind GET /metrics, in a registry owned by one server.

Counters are bumped by the engine thread when a request finishes, fails or is aborted; gauges
(running / waiting requests, KV pages) are snapshots it publishes after every step and command.
NFE per token is derived at scrape time from the two counters, so it is the all-time ratio.
The server process's own series (`process_resident_memory_bytes`, CPU seconds, open fds) come
from prometheus_client's ProcessCollector (Linux).
A data-parallel server adds per-replica series read from its router at scrape time:
`cover_vllm_replica_requests_total{replica="i"}` (requests replica i finished),
`cover_vllm_replica_alive{replica="i"}` (0 while dead or restarting: the server is degraded),
`cover_vllm_replica_restarts_total{replica="i"}`,
`cover_vllm_replica_last_seen_seconds{replica="i"}` (since replica i last answered a poll or
liveness probe: it grows on a frozen replica) and
`cover_vllm_replica_node_info{replica="i",node_id,node_ip}` = 1 (its Ray node, last placed).
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cover_vllm.entrypoints.server.vllm_metrics import VllmMetrics
from cover_vllm.outputs import RequestOutput
from cover_vllm.scoring.params import LoglikelihoodOutput

PREFIX = "cover_vllm_"


class _RatioCollector:
    """Exposes nfe_per_token = nfe_total / generation_tokens_total and the prefix cache's hit
    rate (prompt tokens whose K/V were reused / prompt tokens looked up) at scrape time."""

    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        yield _ratio("nfe_per_token", "Model forwards per decoded token over all finished "
                     "requests", m.nfe_sum, m.decoded_sum)
        yield _ratio("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / "
                     "tokens looked up (block-causal models; finished requests)",
                     m.prefix_hit_sum, m.prefix_query_sum)
        yield _ratio("spec_acceptance_length", "Self-speculation (decoding=linear_spec): tokens "
                     "accepted per verify, bonus included (finished requests)",
                     m.spec_accepted_sum, m.spec_verify_sum)


def _ratio(name: str, doc: str, num: float, den: float) -> GaugeMetricFamily:
    """A gauge PREFIX + name = num / den (0 while den is 0)."""
    family = GaugeMetricFamily(PREFIX + name, doc)
    family.add_metric([], num / den if den else 0.0)
    return family


class _ReplicaCollector:
    """Per-replica series from a DPRouter's `replica_counts()` (read on the event loop, which
    is where the router updates them, so a scrape sees a consistent snapshot)."""

    def __init__(self, counts: Callable[[], list[dict[str, Any]]]):
        self.counts = counts

    def collect(self):
        served = CounterMetricFamily(PREFIX + "replica_requests", "Requests finished, by "
                                     "data-parallel replica", labels=["replica"])
        alive = GaugeMetricFamily(PREFIX + "replica_alive", "1 while the data-parallel replica "
                                  "serves, 0 while it is dead or restarting", labels=["replica"])
        restarts = CounterMetricFamily(PREFIX + "replica_restarts", "Restarts that brought a "
                                       "dead data-parallel replica back", labels=["replica"])
        seen = GaugeMetricFamily(PREFIX + "replica_last_seen_seconds", "Seconds since the "
                                 "data-parallel replica last answered a poll or liveness probe",
                                 labels=["replica"])
        node = GaugeMetricFamily(PREFIX + "replica_node_info", "The Ray node the data-parallel "
                                 "replica was last placed on", labels=["replica", "node_id",
                                                                       "node_ip"])
        for c in self.counts():
            index = str(c["index"])
            served.add_metric([index], c["served"])
            alive.add_metric([index], 1 if c["alive"] else 0)
            restarts.add_metric([index], c.get("restarts", 0))
            if "last_seen_s" in c:
                seen.add_metric([index], c["last_seen_s"])
            if c.get("node_id"):
                node.add_metric([index, c["node_id"], c.get("node_ip") or ""], 1)
        yield from (served, alive, restarts, seen, node)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.nfe_sum = 0      # plain totals for the ratio (written by the engine thread only)
        self.decoded_sum = 0
        self.prefix_hit_sum = 0
        self.prefix_query_sum = 0
        self.spec_accepted_sum = 0
        self.spec_verify_sum = 0
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "Requests that ended, by outcome",
                                ["outcome"], registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests holding KV pages",
                             registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Accepted requests not yet running",
                             registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens of "
                                         "finished requests", registry=r)
        self.decoded_tokens = Counter(PREFIX + "decoded_tokens", "Generation slots decoded "
                                      "(EOS padding included)", registry=r)
        self.nfe = Counter(PREFIX + "nfe", "Model forwards summed over finished requests",
                           registry=r)
        self.remasks = Counter(PREFIX + "remasks", "Committed tokens turned back into [MASK]",
                               registry=r)
        self.flip_flops = Counter(PREFIX + "flip_flops", "Remasks whose next commit wrote the "
                                  "same token again", registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked "
                                      "up in the prefix cache", registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens whose K/V came "
                                   "from the prefix cache", registry=r)
        self.spec_verifies = Counter(PREFIX + "spec_verifies", "Self-speculation verifies "
                                     "(decoding=linear_spec) of finished requests", registry=r)
        self.spec_accepted = Counter(PREFIX + "spec_accepted_tokens", "Tokens those verifies "
                                     "accepted, bonus included", registry=r)
        self.kv_pages_used = Gauge(PREFIX + "kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_pages_total = Gauge(PREFIX + "kv_pages_total", "KV cache pages in the pool",
                                    registry=r)
        self.kv_cache_bytes = Gauge(PREFIX + "kv_cache_bytes", "KV cache bytes allocated, by "
                                    "part: pages (with rings) and COVER's scratch slots; "
                                    "together within the KV budget", ["part"], registry=r)
        self.info = Gauge(PREFIX + "model_info", "The served model", ["model"], registry=r)
        self.info.labels(model=model_name).set(1)
        self.vllm = VllmMetrics(model_name, r)       # vLLM's names for dashboards built for it
        r.register(_RatioCollector(self))
        ProcessCollector(registry=r)      # process_resident_memory_bytes, ... (Linux /proc)

    def watch_replicas(self, counts: Callable[[], list[dict[str, Any]]]) -> None:
        """Expose per-replica series from `counts` (DPRouter.replica_counts) at scrape time."""
        self.registry.register(_ReplicaCollector(counts))

    def on_finished(self, out: RequestOutput | LoglikelihoodOutput) -> None:
        m = out.metrics
        if isinstance(out, LoglikelihoodOutput):     # a scoring request (server/scoring.py)
            self.requests.labels(outcome="scored").inc()
            self.prompt_tokens.inc(len(out.context_token_ids) + len(out.continuation_token_ids))
            self.nfe.inc(m.nfe)
            return
        self.requests.labels(outcome=out.outputs[0].finish_reason or "unknown").inc()
        generated = sum(len(c.token_ids) for c in out.outputs)      # all n
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(generated)
        self.vllm.prompt_tokens.inc(len(out.prompt_token_ids))
        self.vllm.generation_tokens.inc(generated)
        self.vllm.e2e.observe(m.latency_s)
        self.decoded_tokens.inc(m.decoded_tokens)
        self.nfe.inc(m.nfe)
        self.nfe_sum += m.nfe
        self.decoded_sum += m.decoded_tokens
        self.remasks.inc(m.remasks)
        self.flip_flops.inc(m.flip_flops)
        self.prefix_queries.inc(m.prefix_query_tokens)
        self.prefix_hits.inc(m.cached_prompt_tokens)
        self.prefix_query_sum += m.prefix_query_tokens
        self.prefix_hit_sum += m.cached_prompt_tokens
        if m.verifies:
            self.spec_verifies.inc(m.verifies)
            self.spec_accepted.inc(m.accepted_tokens)
            self.spec_verify_sum += m.verifies
            self.spec_accepted_sum += m.accepted_tokens

    def on_outcome(self, outcome: str) -> None:
        """A request that ended without output: 'abort' (client gone) or 'error'."""
        self.requests.labels(outcome=outcome).inc()

    def on_first_token(self, seconds: float) -> None:
        """A request's first output with generated tokens, `seconds` after submission."""
        self.vllm.ttft.observe(seconds)

    def publish(self, running: int, waiting: int, pages_used: int, pages_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.vllm.running.set(running)
        self.vllm.waiting.set(waiting)
        self.kv_pages_used.set(pages_used)
        self.kv_pages_total.set(pages_total)

    def set_kv_cache_bytes(self, pages: int, scratch: int) -> None:
        """The KV allocation, once at start (worker/memory.py MemoryPlan)."""
        self.kv_cache_bytes.labels(part="pages").set(pages)
        self.kv_cache_bytes.labels(part="scratch").set(scratch)

    def render(self) -> bytes:
        return generate_latest(self.registry)
