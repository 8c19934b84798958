"""LLaDA2.x block decoders: `llada2` (LLaDA2.0 `generate`) and `llada2_edit` (LLaDA2.1's).

Both run inside one block of a block-causal canvas (blocks aligned to absolute position 0; the
engine hands over the block's generation slots). References: `LLaDA2MoeModelLM.generate` of the
HF LLaDA2.0-mini file as kept in ZHZisZZ/dllm (dllm/pipelines/llada2/models/
modeling_llada2_moe.py, with dllm PR #104's greedy fix) and of the HF LLaDA2.1-mini file (dllm/
pipelines/llada21/models/modeling_llada21_moe.py); the golden README's "Quirks" sections list
what is reproduced here. Candidates are the argmax of the model's probabilities (float32 softmax),
each scored by its own probability; at temperature > 0 they are drawn like every other strategy's
(`propose_scored`), scored by the model's own probability.

`llada2`: the per-block step budget is s = min(steps, max_tokens // minimal_topk) (`steps` is per
block here, as in the reference; default 32). Step j may reveal n[j] tokens, the schedule of
`block_schedule(block_length, s)`: spread over the block length, not over the masks actually in
the block (a first block holding the prompt's tail has fewer). A step commits every [MASK] whose
confidence is strictly above `threshold` when there are at least n[j] of them (possibly more),
else the top min(n[j], masks). At most s forwards per block. An EOS in a finished block ends the
request (the engine's EOS rule); `eos_early_stop` ends it right after a step that committed an
EOS, if no [MASK] precedes the first EOS of the block (`Decision.stop`).

`llada2_edit`: `steps` is dead in the reference. Each forward commits the [MASK]s strictly above
`threshold` when at least `num_to_transfer` qualify, else the top min(num_to_transfer, masks);
in the same forward every other filled generation slot of the block whose argmax differs from
its token with probability strictly above `editing_threshold` is overwritten (`Decision.replace`;
slots committed by this forward are not edit candidates; earlier blocks are frozen). The block
ends after a forward that started with no [MASK] and edited nothing (so every block costs one
"verification" forward after its last [MASK]), or, before a forward, once more than
`max_post_steps` forwards have started with no [MASK] (`post_steps`). Without eos_early_stop the
reference generates every block (`eos_ends_request` False: the output is still cut after the
first EOS); with it, a finished block with an EOS ends the request.

The references' softmax includes the [MASK] logit, which the engine sets to -inf so that it is
never proposed: the confidences put it back (`StepBatch.mask_column`, #48). Not reproduced:
a row whose argmax is [MASK] (the engine proposes the next token there); LLaDA2.0's early
return `x[P : eos + 1]` can pass max_tokens when the EOS lands in the last block's slots past it,
and is empty when the prompt holds an EOS: here the output is the first
max_tokens slots cut after the first generated EOS; the early-stop test looks at the current block
only (an EOS in an earlier block would have ended the request unless ignore_eos).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cover_vllm.strategies.base import BlockState, Decision, StepBatch, Strategy, StrategyParams
from cover_vllm.strategies.llada import ScheduleState, propose_scored
from cover_vllm.strategies.sampling import on_device, topk_mask

LLADA2_DEFAULT_STEPS = 32        # `generate(steps=32)` in both LLaDA2 files


def check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"decoding_params.{name} must be a number, got {value!r}")


def check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"decoding_params.{name} must be an integer >= {minimum}, got {value!r}")


def block_schedule(block_size: int, steps: int) -> list[int]:
    """The official `get_num_transfer_tokens(block_length, steps)` (LLaDA2 and SDAR): block_size
    // steps per step, the first block_size % steps steps one more (zeros once steps >
    block_size)."""
    base, rem = divmod(block_size, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def start_schedule(state: BlockState, num_masked: int, steps: int) -> None:
    """The block's schedule over the request's block length (the block's own masks when the
    engine left `block_size` unset)."""
    state.extra = ScheduleState(block_schedule(state.block_size or num_masked, steps))


def schedule_counts(batch: StepBatch, past_end: torch.Tensor | None = None) -> torch.Tensor:
    """[n] tokens step `state.step` may reveal (host); past the schedule 0 (or `past_end` [n],
    a host tensor)."""
    ends = [0] * len(batch.states) if past_end is None else past_end.tolist()
    return torch.tensor([st.extra.count(st.step, int(e)) for st, e in zip(batch.states, ends)],
                        dtype=torch.long)


def threshold_or_top(conf: torch.Tensor, candidates: torch.Tensor, threshold: float,
                     count: torch.Tensor) -> torch.Tensor:
    """[n, W] commits: every candidate with conf strictly > threshold when at least count[i]
    qualify (all of them, possibly more than count), else the top min(count, candidates).
    conf [n, W] float32, -inf off the candidates (compared in float32, as the references)."""
    high = candidates & (conf > threshold)
    count = on_device(count, conf)
    enough = high.sum(-1) >= count                                          # [n]
    return torch.where(enough[:, None], high, topk_mask(conf, count))


def eos_early_stop(batch: StepBatch, commit: torch.Tensor, tokens: torch.Tensor,
                   eos_ids: tuple[int, ...]) -> torch.Tensor:
    """[n] bool: this step committed an EOS and no [MASK] precedes the block's first EOS (the
    reference's `(cur_x[0, prompt_length:eos_pos] != mask_id).all()`: earlier blocks are full)."""
    after = torch.where(commit, tokens, batch.tokens)                       # [n, W]
    region = batch.in_block & batch.valid
    is_eos = torch.isin(after, on_device(eos_ids, after)) & region
    pos = torch.arange(after.shape[1], device=after.device)
    first = torch.where(is_eos, pos, after.shape[1]).min(-1).values         # [n]
    masked_before = ((after == batch.mask_id) & region & (pos < first[:, None])).any(-1)
    return (commit & is_eos).any(-1) & ~masked_before


@dataclass(frozen=True)
class LLaDA2Params(StrategyParams):
    threshold: float = 0.95       # commit every [MASK] with p > threshold (2.0: never)
    minimal_topk: int = 1         # caps the steps per block at max_tokens // minimal_topk
    eos_early_stop: bool = False  # end the request at the step that completes an EOS

    def __post_init__(self) -> None:
        check_number("threshold", self.threshold)
        check_count("minimal_topk", self.minimal_topk, 1)


class LLaDA2(Strategy):
    name = "llada2"
    params_cls = LLaDA2Params
    masked_rows_only = True

    def default_block_length(self, max_tokens: int) -> int:
        return self.spec.default_block_length   # blocks are aligned to 0: never capped

    def check_steps(self, steps: int | None, max_tokens: int) -> None:
        if max_tokens // self.params.minimal_topk == 0:
            raise ValueError(
                f"decoding_params.minimal_topk ({self.params.minimal_topk}) exceeds max_tokens "
                f"({max_tokens}): llada2 runs min(steps, max_tokens // minimal_topk) steps per "
                "block, which would be 0; give minimal_topk <= max_tokens")

    def block_steps(self, state: BlockState) -> int:
        """Steps per block: min(steps, gen_length // minimal_topk) (reference's first line)."""
        steps = state.steps or LLADA2_DEFAULT_STEPS
        if state.max_tokens > 0:
            steps = min(steps, state.max_tokens // self.params.minimal_topk)
        return steps

    def start_block(self, state: BlockState, num_masked: int) -> None:
        start_schedule(state, num_masked, self.block_steps(state))

    def block_done(self, state: BlockState, num_masked: int) -> bool:
        return num_masked == 0 or state.step >= len(state.extra.schedule)

    def decide(self, batch: StepBatch) -> Decision:
        candidates = batch.candidates
        tokens, conf = propose_scored(batch, candidates, torch.float32)
        conf = conf.masked_fill(~candidates, float("-inf"))
        commit = threshold_or_top(conf, candidates, self.params.threshold,
                                  schedule_counts(batch))
        stop = None
        if self.params.eos_early_stop and self.spec.eos_token_ids:
            stop = eos_early_stop(batch, commit, tokens, self.spec.eos_token_ids)
        return Decision(commit=commit, tokens=tokens, stop=stop)


@dataclass(frozen=True)
class LLaDA2EditParams(StrategyParams):
    threshold: float = 0.95          # mask-to-token: commit every [MASK] with p > threshold
    editing_threshold: float = 0.9   # token-to-token: overwrite a filled slot if p > this
    max_post_steps: int = 16         # forwards allowed to start with no [MASK] in the block
    num_to_transfer: int = 1         # top-k fallback when too few [MASK]s pass threshold
    eos_early_stop: bool = False     # False: every block is generated

    def __post_init__(self) -> None:
        check_number("threshold", self.threshold)
        check_number("editing_threshold", self.editing_threshold)
        check_count("max_post_steps", self.max_post_steps, 0)
        check_count("num_to_transfer", self.num_to_transfer, 1)


@dataclass
class EditState:
    """Per-block state of `llada2_edit`."""

    post_steps: int = 0     # forwards started (or about to start) with no [MASK] in the block
    done: bool = False      # the reference leaves the block's loop before the next forward


class LLaDA2Edit(Strategy):
    name = "llada2_edit"
    params_cls = LLaDA2EditParams

    def default_block_length(self, max_tokens: int) -> int:
        return self.spec.default_block_length

    def check_steps(self, steps: int | None, max_tokens: int) -> None:
        """`steps` is dead in LLaDA2.1's `generate`: any value is accepted and ignored."""

    @property
    def eos_ends_request(self) -> bool:
        return self.params.eos_early_stop

    def start_block(self, state: BlockState, num_masked: int) -> None:
        state.extra = EditState()

    def block_done(self, state: BlockState, num_masked: int) -> bool:
        return state.extra.done

    def decide(self, batch: StepBatch) -> Decision:
        p = self.params
        candidates = batch.candidates                                      # [n, W]
        filled = batch.in_block & batch.is_gen & batch.valid & ~batch.masked
        tokens, conf = propose_scored(batch, candidates | filled, torch.float32)
        count = torch.full((conf.shape[0],), p.num_to_transfer, dtype=torch.long)
        commit = threshold_or_top(conf.masked_fill(~candidates, float("-inf")), candidates,
                                  p.threshold, count)
        replace = filled & (conf > p.editing_threshold) & (tokens != batch.tokens)
        return Decision(commit=commit, tokens=tokens, replace=replace)

    def absorb(self, batch: StepBatch, decision: Decision) -> None:
        candidates = batch.host.candidates
        started_empty = (~candidates.any(-1)).tolist()
        edited = decision.replace.any(-1).tolist()
        left = (candidates.sum(-1) - decision.commit.sum(-1)).tolist()
        for st, empty, edit, masks in zip(batch.states, started_empty, edited, left):
            self._advance(st.extra, empty and not edit, masks)

    def _advance(self, ex: EditState, settled: bool, masks_left: int) -> None:
        """The reference's loop control after a forward: `break` when it started with no [MASK]
        and edited nothing; else the next iteration counts a post step if it starts with no
        [MASK] and leaves before its forward once post_steps > max_post_steps."""
        if settled:
            ex.done = True
        elif masks_left == 0:
            ex.post_steps += 1
            ex.done = ex.post_steps > self.params.max_post_steps
