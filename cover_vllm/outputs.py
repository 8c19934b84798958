"""What `LLM.generate` returns: RequestOutput, CompletionOutput (with per-token Logprob dicts)
and per-request RequestMetrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MAX_LOGPROBS = 20     # most alternatives `logprobs` may ask for (OpenAI's top_logprobs cap)


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
    constraint_s: float = 0.0    # structured_outputs: time spent masking, checking and rolling
                                 # back the grammar (part of the steps' strategy time)
    canvases: int = 0            # uniform-state canvases finished (DiffusionGemma)
    accepted_tokens: int = 0     # of their denoising steps: positions that kept their sample
    verifies: int = 0            # linear_spec: causal verifies (accepted_tokens / verifies
                                 # = the mean acceptance length)
    encoder_flops: float = 0.0   # the part of `flops` spent encoding prompt and canvases

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Logprob:
    """One token's log-probability at the step that committed a generated token (vLLM's
    `vllm.sequence.Logprob`): `logprob` = log_softmax of the model's logits row there ([MASK]
    excluded, before temperature / top-k / top-p), `rank` its 1-based rank in the vocabulary
    (1 + the number of tokens at least as likely, itself excluded), `decoded_token` its text
    (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (`index` among its `SamplingParams.n`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None    # "stop" | "length" | "abort"
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it
                                           # (None: EOS, length, or still running)
    # with SamplingParams.logprobs = k: per returned token {token id: Logprob} holding the
    # chosen token and the k most likely ones (docs/architecture.md "Logprobs")
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None   # sum of the chosen tokens' logprobs


@dataclass
class RequestOutput:
    """A request's output: `outputs` holds its n CompletionOutputs in index order (a partial
    output, finished=False, those that have FINAL text so far). With n > 1 `metrics` are the
    children's summed counters (latency: the slowest; tokens_per_step: over the sums)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # with SamplingParams.prompt_logprobs = k (LLM.generate): None for the first prompt token,
    # then per token {token id: Logprob} with it and the k most likely tokens given the ones
    # before it (exact: one forward each; llm.py)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
