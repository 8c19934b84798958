"""LLaDA reference decoders: `low_confidence` and `random` remasking (ML-GSAI/LLaDA generate.py).

Each block gets a fixed number of steps; at step i it reveals a fixed count of tokens chosen when
the block starts: with m masks and s steps, floor(m/s) per step and one more in the first m mod s
steps (the paper's linear schedule, LLaDA §2.4 / Appendix B). Candidates are the argmax of the
(optionally Gumbel-perturbed, float64) logits; `low_confidence` keeps the top-k by softmax
probability (float32, as the reference file computes it), `random` by a uniform draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.strategies.base import BlockState, Decision, StepBatch, Strategy, StrategyParams
from cover_vllm.strategies.sampling import (Rows, as_rows, filter_top_k_top_p, greedy,
                                            gumbel_candidates, on_device, token_prob, topk_mask,
                                            uniform)


@dataclass(frozen=True)
class LLaDAParams(StrategyParams):
    cfg_scale: float = 0.0   # classifier-free guidance: uncond + (cfg+1)(cond - uncond)

    def __post_init__(self) -> None:
        if self.cfg_scale < 0:
            raise ValueError(f"decoding_params.cfg_scale must be >= 0, got {self.cfg_scale}")


@dataclass
class ScheduleState:
    """Per-block state of the fixed-schedule rules (LLaDA; Fast-dLLM's Dream quota rule)."""

    schedule: list[int]     # tokens to reveal at each step of the block
    carry: int = 0          # quota rule: commits held back last step, allowed on top this step

    def count(self, step: int, past_end: int) -> int:
        """Tokens to reveal at `step`; `past_end` once the schedule is used up."""
        return self.schedule[step] if step < len(self.schedule) else past_end


def linear_schedule(state: BlockState, num_masked: int) -> None:
    """LLaDA's schedule: the block's [MASK]s spread evenly over its steps, the first ones
    taking the remainder."""
    base, rem = divmod(num_masked, state.block_steps)
    state.extra = ScheduleState([base + (1 if i < rem else 0) for i in range(state.block_steps)])


def scheduled_count(batch: StepBatch) -> torch.Tensor:
    """[n] tokens to reveal this step (host); past the schedule's end, everything left in the
    block."""
    left = batch.host.candidates.sum(-1).tolist()
    counts = [st.extra.count(st.step, n) for st, n in zip(batch.states, left)]
    return torch.tensor(counts, dtype=torch.long)


def propose(batch: StepBatch, rows: torch.Tensor | Rows | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate tokens [n, W] (Gumbel-max at T > 0, drawn from the top-k / top-p filtered
    logits) and the model's own logits [n, W, V], which every confidence is read from:
    truncation shapes sampling only, never the bars decoders compare against (at T = 0 the
    candidates, and so the decisions, do not depend on top_p / top_k). With `rows` ([n, W]
    bool) a greedy row's token is taken only there (elsewhere 0: for decoders that read no
    other row)."""
    filtered = filter_top_k_top_p(batch.logits, batch.top_k, batch.top_p)
    tokens = gumbel_candidates(filtered, batch.temperature, batch.generators,
                               batch.host.lengths, as_rows(rows))
    return tokens, batch.logits


def plain_greedy(batch: StepBatch) -> bool:
    """Whether every request decodes greedily and untruncated (temperature 0, no top-k or
    top-p): then `propose`'s tokens are the argmax of the model's own logits."""
    return not bool((batch.temperature > 0).any() or (batch.top_k > 0).any()
                    or (batch.top_p < 1.0).any())


def propose_scored(batch: StepBatch, rows: torch.Tensor | Rows,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`propose(batch, rows)`'s tokens and each one's softmax probability in `dtype` on `rows`
    (0 elsewhere): the same values as `token_prob`. When every request decodes greedily and
    untruncated (the common case) both read one compact copy of the rows."""
    rows = as_rows(rows)
    if not plain_greedy(batch):
        tokens, logits = propose(batch, rows=rows)
        return tokens, token_prob(logits, tokens, dtype, rows=rows, mask=batch.mask_column)
    picked = rows.take(batch.logits)                                         # [N, V]
    tokens = rows.put(greedy(picked), 0)
    return tokens, token_prob(batch.logits, tokens, dtype, rows=rows, picked=picked,
                              mask=batch.mask_column)


class LowConfidence(Strategy):
    name = "low_confidence"
    masked_rows_only = True
    params_cls = LLaDAParams
    fixed_schedule = True

    @property
    def cfg_scale(self) -> float:
        return self.params.cfg_scale

    def start_block(self, state: BlockState, num_masked: int) -> None:
        linear_schedule(state, num_masked)

    def scored_proposal(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate tokens [n, W] and the confidence [n, W] they are ranked by."""
        return propose_scored(batch, batch.candidates, torch.float32)

    def decide(self, batch: StepBatch) -> Decision:
        candidates = batch.candidates
        tokens, conf = self.scored_proposal(batch)
        conf = conf.to(torch.float64).masked_fill(~candidates, float("-inf"))
        return Decision(commit=topk_mask(conf, on_device(scheduled_count(batch), conf)),
                        tokens=tokens)


class RandomRemasking(LowConfidence):
    name = "random"

    def scored_proposal(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform draws over each request's own view, so batching never changes the stream."""
        tokens, _ = propose(batch, rows=batch.candidates)
        conf = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        for i, (g, n) in enumerate(zip(batch.generators, batch.host.lengths)):
            conf[i, :n] = uniform(n, g, conf)
        return tokens, conf
