"""SDAR's block decoder: `sdar` (JetAstra/SDAR generate.py `block_diffusion_generate`).

The canvas is block-causal with blocks aligned to absolute position 0; the engine hands over the
current block's generation slots. `steps` is the number of denoising steps per block (default 8,
the function's `denoising_steps`); step j may reveal n[j] tokens, n = `block_schedule(
block_length, steps)` (spread over the block length, not over the block's masks). The block ends
as soon as it has no [MASK] (the reference's extra store-KV call is the engine's commit, not a
decision, so NFE counts only denoising calls). `remasking`:

* `sequential`: the n[j] slots from the first [MASK] on (a slice, clipped at the block's end).
* `low_confidence_static`: the n[j] most confident [MASK]s.
* `low_confidence_dynamic`: every [MASK] with confidence strictly above `threshold` when at least
  n[j] qualify (all of them), else the top n[j].

Confidence: the candidate's probability under the model (float32 softmax of the argmax; at
temperature > 0 candidates are drawn like every other strategy's, `propose_scored`). The official
script is deterministic only with `top_k=1`, where its confidence is 1.0 everywhere, so its
`low_confidence_dynamic` commits every [MASK] of the block at the first step; that is
`low_confidence_dynamic` with threshold 0 at temperature 0 here (every probability is > 0).

Stop ids (`stop_token_ids`, or the EOS unless ignore_eos) end the request at the end of their
block: the engine's rule, the reference's `stopping_criteria_idx`. Not reproduced (avoided by
the golden cases): when a block holds fewer [MASK]s than n[j], the reference's top-k also picks
-inf slots and overwrites their tokens (prompt tokens included); here only [MASK]s are revealed.
The reference would index past its schedule if [MASK]s were left after `steps` steps (they never
are: the schedule sums to the block length); here such a step reveals everything left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.strategies.base import BlockState, Decision, StepBatch, Strategy, StrategyParams
from cover_vllm.strategies.llada import propose, propose_scored
from cover_vllm.strategies.llada2 import (check_number, schedule_counts, start_schedule,
                                          threshold_or_top)
from cover_vllm.strategies.sampling import on_device, topk_mask

SDAR_DEFAULT_STEPS = 8           # `block_diffusion_generate(denoising_steps=8)`
REMASKING = ("sequential", "low_confidence_static", "low_confidence_dynamic")


@dataclass(frozen=True)
class SDARParams(StrategyParams):
    remasking: str = "low_confidence_dynamic"   # the reference's `remasking_strategy`
    threshold: float = 0.85                     # its `confidence_threshold` (dynamic only)

    def __post_init__(self) -> None:
        if self.remasking not in REMASKING:
            raise ValueError(f"decoding_params.remasking={self.remasking!r}; choose one of "
                             f"{list(REMASKING)}")
        check_number("threshold", self.threshold)


class SDAR(Strategy):
    name = "sdar"
    params_cls = SDARParams
    masked_rows_only = True

    def default_block_length(self, max_tokens: int) -> int:
        return self.spec.default_block_length   # blocks are aligned to 0: never capped

    def check_steps(self, steps: int | None, max_tokens: int) -> None:
        """`steps` counts denoising steps per block; any positive value is valid."""

    def start_block(self, state: BlockState, num_masked: int) -> None:
        start_schedule(state, num_masked, state.steps or SDAR_DEFAULT_STEPS)

    def decide(self, batch: StepBatch) -> Decision:
        candidates = batch.candidates                                       # [n, W]
        count = schedule_counts(batch, past_end=batch.host.candidates.sum(-1))
        rule = self.params.remasking
        if rule == "sequential":
            tokens, _ = propose(batch, rows=candidates)
            pos = torch.arange(candidates.shape[1], device=candidates.device)
            first = torch.where(candidates, pos, candidates.shape[1]).min(-1).values
            end = first + on_device(count, first)
            commit = candidates & (pos >= first[:, None]) & (pos < end[:, None])
            return Decision(commit=commit, tokens=tokens)
        tokens, conf = propose_scored(batch, candidates, torch.float32)
        conf = conf.masked_fill(~candidates, float("-inf"))
        if rule == "low_confidence_static":
            return Decision(commit=topk_mask(conf, count), tokens=tokens)
        return Decision(commit=threshold_or_top(conf, candidates, self.params.threshold, count),
                        tokens=tokens)
