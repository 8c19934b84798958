"""The `vllm:` series beside `cover_vllm_*` on GET /metrics, under vLLM's names and its
`model_name` label, so dashboards built for a vLLM server read this one: requests running and
waiting, prompt and generation tokens, time to first token and end-to-end latency.

Time to first token here is from submission to the first output carrying generated tokens: a
diffusion request's first finished block (streams) or its whole answer (one that ends in one
block, or a decoder that streams no partial output). Counted on a single-engine server; a
data-parallel server's replicas report their outputs finished only, so its histogram of time
to first token stays empty there.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)


class VllmMetrics:
    """vLLM's series for one served model, in `registry` (ServerMetrics feeds them)."""

    def __init__(self, model_name: str, registry: CollectorRegistry):
        label, r = ["model_name"], registry
        self.running = Gauge("vllm:num_requests_running", "Requests holding KV pages",
                             label, registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Accepted requests not yet running",
                             label, registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished "
                                     "requests", label, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens of finished "
                                         "requests", label, registry=r).labels(model_name)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Submission to the first "
                              "output with generated tokens", label, buckets=TTFT_BUCKETS,
                              registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish of "
                             "finished requests", label, buckets=E2E_BUCKETS,
                             registry=r).labels(model_name)
