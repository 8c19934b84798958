"""What `LLM.generate` returns: RequestOutput, CompletionOutput and per-request RequestMetrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """Counters for one request. Definitions: ../shared/ALGORITHMS.md §1.10 and §4."""

    nfe: int = 0                 # model forward calls that included this request (cfg pair = 1)
    steps: int = 0               # decoding steps (one decision per forward)
    decoded_tokens: int = 0      # generation slots decoded (EOS padding included; later blocks
                                 # skipped after a stop are not)
    tokens_per_step: float = 0.0  # decoded_tokens / steps
    remasks: int = 0             # committed tokens turned back into [MASK]
    flip_flops: int = 0          # remasks whose next commit wrote the same token again
    replaces: int = 0            # committed tokens changed in place (never a flip-flop)
    keeps: int = 0               # verified tokens left as they were
    seeds_verified: int = 0      # positions verified (COVER seeds; revocable checks)
    refreshes: int = 0           # full-canvas forwards (block starts with a cache; every step without)
    forward_tokens: int = 0      # query rows this request ran through the model (all forwards)
    flops: float = 0.0           # model FLOPs of those rows (cover_vllm/flops.py)
    prefix_query_tokens: int = 0   # prompt positions looked up in the prefix cache
    cached_prompt_tokens: int = 0  # of which found: their K/V came from the cache
    latency_s: float = 0.0       # arrival to finish, wall clock

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None    # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
