"""Fast-dLLM parallel decoding (NVlabs/Fast-dLLM): `threshold` and `factor` commit rules.

`threshold`: inside the block, the most confident masked position is always revealed and every
other one whose float64 softmax confidence is not below τ (Fast-dLLM §3.3, Theorem 1); the block
loops until it has no [MASK], so the step count is data-dependent. With threshold=None it follows
the LLaDA linear schedule (`steps`). With `spec.threshold_quota` (Fast-dLLM's Dream decoder,
dream/model/generation_utils.py `_sample`, alg="confidence_threshold") a step also caps the reveals:
it takes the top (quota + carry) masked positions by float32 confidence, where quota is the linear
schedule's count (masks / steps), reveals the best and every other one not below τ, and carries the
skipped ones to the next step; past the schedule the quota is 0, so extra steps follow until the
block is done. `factor`: with confidences sorted c(1) >= c(2) >= ..., reveal
the longest prefix with (k + 1)(1 - c(k)) < f, at least one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.strategies.base import BlockState, Decision, StepBatch, Strategy, StrategyParams
from cover_vllm.strategies.llada import linear_schedule, propose_scored, scheduled_count
from cover_vllm.strategies.sampling import finite, on_device, topk_mask


def _candidate_confidence(batch: StepBatch,
                          dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    candidates = batch.candidates
    tokens, conf = propose_scored(batch, candidates, dtype)
    return tokens, conf.masked_fill(~candidates, float("-inf"))


@dataclass(frozen=True)
class ThresholdParams(StrategyParams):
    threshold: float | None = 0.9

    def __post_init__(self) -> None:
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"decoding_params.threshold must be in [0, 1] or null, "
                             f"got {self.threshold}")


class Threshold(Strategy):
    name = "threshold"
    masked_rows_only = True
    params_cls = ThresholdParams

    def start_block(self, state: BlockState, num_masked: int) -> None:
        linear_schedule(state, num_masked)

    def decide(self, batch: StepBatch) -> Decision:
        tau, quota = self.params.threshold, self.spec.threshold_quota
        tokens, conf = _candidate_confidence(batch, torch.float32 if quota else torch.float64)
        if tau is None:
            return Decision(commit=topk_mask(conf, scheduled_count(batch)), tokens=tokens)
        best = topk_mask(conf, 1)
        commit = best | (finite(conf) & (conf >= tau))
        if not quota:
            return Decision(commit=commit, tokens=tokens)
        # keep the commits among the top (quota + carry); carry the skipped ones (see above)
        allowed = [st.extra.carry + st.extra.count(st.step, 0) for st in batch.states]
        top = topk_mask(conf, on_device(allowed, conf, torch.long))
        commit = commit & top
        return Decision(commit=commit, tokens=tokens, state={"carry": (top & ~commit).sum(-1)})

    def absorb(self, batch: StepBatch, decision: Decision) -> None:
        if decision.state is not None:
            for st, skipped in zip(batch.states, decision.state["carry"].tolist()):
                st.extra.carry = skipped


@dataclass(frozen=True)
class FactorParams(StrategyParams):
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"decoding_params.factor must be > 0, got {self.factor}")


class Factor(Strategy):
    name = "factor"
    masked_rows_only = True
    params_cls = FactorParams

    def decide(self, batch: StepBatch) -> Decision:
        tokens, conf = _candidate_confidence(batch)
        ordered = conf.sort(dim=-1, descending=True).values                    # [n, W]
        rank = torch.arange(1, conf.shape[1] + 1, dtype=torch.float64, device=conf.device)
        ok = ((rank + 1) * (1 - ordered) < self.params.factor) & torch.isfinite(ordered)
        count = ok.long().cumprod(dim=-1).sum(-1).clamp(min=1)                 # leading run
        return Decision(commit=topk_mask(conf, count), tokens=tokens)
