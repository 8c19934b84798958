"""LoglikelihoodParams and LoglikelihoodOutput: what `LLM.loglikelihood` takes per request and
returns (the Monte-Carlo likelihood estimate of a continuation given a context)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cover_vllm.outputs import MAX_LOGPROBS


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"LoglikelihoodParams.{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"LoglikelihoodParams.{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class LoglikelihoodParams:
    """The estimator's settings, under the official names of ML-GSAI/LLaDA `eval_llada.py`
    (`cfg` is `cfg_scale` here, `is_check_greedy` is `check_greedy`).

    mc_num: masked copies of the sequence in all (a multiple of batch_size).
    batch_size: copies per mini-batch: one mask count k ~ U{1..T} is drawn per mini-batch and
        stratified over its copies, so it shifts the expected value, not only the variance
        (docs/architecture.md, "Likelihood scoring"). It does not decide how many copies share
        a forward: the engine batches copies of many requests as memory allows.
    seed: the request's own torch.Generator (None: the engine's next seed); with seed s the
        value equals the official code's right after `torch.manual_seed(s)` (CPU, fp32).
    cfg_scale: classifier-free guidance (> 0: an unconditional copy with the context masked).
    check_greedy: also run the official greedy check (T forwards of one canvas, one token
        committed per forward; it stops at the first token that differs).
    logprobs: only for a one-token continuation (whose estimate is exact: log p(token |
        context) from one forward): also return the k most likely tokens there (0 to 20).
    """

    mc_num: int = 128
    batch_size: int = 32
    seed: int | None = None
    cfg_scale: float = 0.0
    check_greedy: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_int("mc_num", self.mc_num, 1)
        _check_int("batch_size", self.batch_size, 1)
        if self.mc_num % self.batch_size:
            raise ValueError(f"LoglikelihoodParams.mc_num ({self.mc_num}) must be a multiple of "
                             f"batch_size ({self.batch_size})")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if isinstance(self.cfg_scale, bool) or not isinstance(self.cfg_scale, (int, float)):
            raise TypeError("LoglikelihoodParams.cfg_scale must be a number, got "
                            f"{type(self.cfg_scale).__name__}")
        if not 0.0 <= self.cfg_scale < float("inf"):
            raise ValueError(f"LoglikelihoodParams.cfg_scale must be finite and >= 0, got "
                             f"{self.cfg_scale}")
        if not isinstance(self.check_greedy, bool):
            raise TypeError("LoglikelihoodParams.check_greedy must be a bool, got "
                            f"{type(self.check_greedy).__name__}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"LoglikelihoodParams.logprobs must be at most {MAX_LOGPROBS}, "
                                 f"got {self.logprobs}")


@dataclass
class ScoreMetrics:
    """What one scoring request cost."""

    nfe: int = 0                 # engine forwards this request took part in
    sample_rows: int = 0         # masked copies run (mc_num; x2 sequences with cfg)
    greedy_forwards: int = 0     # forwards of the greedy check (<= T; it stops at a mismatch)
    forward_tokens: int = 0      # query rows run through the model for this request
    shared_context_tokens: int = 0   # block-causal: context positions whose K/V were computed
                                     # once and read by every copy (or taken from the cache)
    cached_context_tokens: int = 0   # of which found in the prefix cache (computed earlier)
    latency_s: float = 0.0       # arrival to finish, wall clock

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoglikelihoodOutput:
    """One request's estimate. `token_logprobs[j]` is continuation token j's share of it:
    -(1/mc_num) * sum over the copies that masked token j of (T / masked count) * its
    cross-entropy, so `sum(token_logprobs) == logprob` (up to float rounding). With T = 1 the
    estimate is exact (every copy masks the one token): log p(token | context) from one
    forward, and `top_logprobs[0]` (when asked) holds the most likely tokens there."""

    request_id: str
    logprob: float
    is_greedy: bool
    context_token_ids: list[int]
    continuation_token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None
    metrics: ScoreMetrics = field(default_factory=ScoreMetrics)
    finished: bool = True        # as RequestOutput: every scoring output is a final one
