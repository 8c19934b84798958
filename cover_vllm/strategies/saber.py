"""`saber`: threshold reveals + backtracking remasks (zhaoyMa/Saber `generate_with_saber`, Dream).

LLaDA rules (decoding.py `generate_with_saber`, ALGORITHMS.md §2.2): the view is every generation
slot up to the current block end. Each step scores every view slot by p(argmax) (float32 softmax);
the threshold τ is the mean, over slots ever revealed, of the probability each had at its most
recent reveal (1 before any); every [MASK] slot with p > τ is revealed, or the top n if fewer
qualify. Unless no [MASK] is left in the view (then the block, or the request, is done), the
max(n // 2, ⌈r / 8⌉) filled slots (at most r − 1, r = max(n, revealed)) whose p dropped most since
the previous forward are remasked: backtracking may reach earlier blocks, so a block is done only
when its whole prefix is filled.

Dream rules (Dream/generation_utils.py `DreamGenerationMixin._sample`; chosen by
`ModelSpec.saber_dream`, not by family name): τ is the mean of the confidences slots had at their
*first* reveal; the top-2 fallback is the same (n); unless nothing is masked, the
max(1, min(⌈u / 8⌉, u − 1)) filled slots (u = revealed this step, only when more than one slot is
filled) with the lowest probability of their current token are remasked. `eos_penalty` adds
eos_penalty · log(1 − t + eps) to the pad logit of masked slots, t from linspace(1, eps, steps + 1).

Both references have no blocks by default (one block of max_tokens) and count one forward per
step, so NFE is the model-call count (Saber-Dream *reports* one less: its last call is uncounted).
With a shorter block_length the Dream rules run per block over the same prefix view (the Dream
reference has no blocks). Per-slot confidences are kept across blocks as rows of the instance's
`SaberRows` table (strategies/saber_rows.py): one gather and one scatter a step for the batch.

Canvas accounting: a slot revealed and revoked by the same step never reaches the canvas, so it is
neither committed nor counted in RequestMetrics.remasks (which counts visible tokens turned back
into [MASK], as for every strategy); every other revoke is a Decision.remask.

KV cache: the view starts at the first generation slot, and the scheduler's window always covers
the view, so under `prefix` and `dual` every slot Saber can reveal or remask is recomputed in every
forward; only the prompt (and, with `dual`, the still-masked suffix) comes from the block's
refresh. No cached K/V of a revisable slot is ever treated as frozen.

Known departures of the LLaDA rules (unreachable with n = 2 and blocks of >= 2 slots): when fewer
than n [MASK] slots remain, the reference's top-n also "transfers" n − left slots picked among −inf
ties by torch.topk (prompt, filled or beyond-block slots); here only the masked ones are revealed.
Filled slots whose delta is not finite rank last for remasking, and the count is capped by the
filled slots (the reference ties them with prompt and masked slots and could remask the prompt).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies.base import BlockState, Decision, StepBatch, Strategy, StrategyParams
from cover_vllm.strategies.dream import dream_candidates
from cover_vllm.strategies.llada import propose
from cover_vllm.strategies.saber_rows import DREAM_FIELDS, LLADA_FIELDS, SaberRows, thresholds
from cover_vllm.strategies.sampling import on_device, token_prob, topk_mask

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SaberParams(StrategyParams):
    n: int = 2                  # reveal >= n per step (top-n fallback); LLaDA remask floor n // 2
    eps: float = 1e-3           # Dream port: last value of its time grid (only used by eos_penalty)
    eos_penalty: float = 0.0    # Dream port: pad logit += eos_penalty * log(1 - t + eps)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"decoding_params.n must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"decoding_params.eps must be in [0, 1), got {self.eps}")
        if not math.isfinite(self.eos_penalty):
            raise ValueError(f"decoding_params.eos_penalty must be finite, got {self.eos_penalty}")


def _up_to_block_end(batch: StepBatch) -> torch.Tensor:
    """[n, W] bool: valid generation slots at or before the last slot of the current block."""
    reach = batch.in_block.flip(-1).cumsum(-1).flip(-1) > 0
    return reach & batch.valid & batch.is_gen


def _reveal(conf: torch.Tensor, unfilled: torch.Tensor, tau: torch.Tensor,
            n: int) -> torch.Tensor:
    """[n, W] bool: unfilled slots with conf > τ (a host tensor [n]); where fewer than n
    qualify, the top n instead."""
    conf = conf.masked_fill(~unfilled, NEG_INF)
    above = unfilled & (conf > on_device(tau, conf)[:, None])
    top = topk_mask(conf, n)
    return torch.where((above.sum(-1) < n)[:, None], top, above)


@dataclass
class SaberState:
    """Per-block state of Saber (its per-slot confidences: a row of `Saber.memory_rows`, the
    handle in BlockState.memory["rows"])."""

    prefix_masked: int = 0  # [MASK]s left up to the block end after the last decision


class Saber(Strategy):
    name = "saber"
    revises_done_blocks = True        # backtracking reaches every slot up to the block end
    params_cls = SaberParams

    def __init__(self, params: SaberParams, spec: ModelSpec):
        super().__init__(params, spec)
        if params.eos_penalty and not spec.saber_dream:
            raise ValueError("decoding_params.eos_penalty only applies to Saber's Dream decoder; "
                             "generate_with_saber (this model's rules) has no EOS penalty")
        # every request's per-slot confidences: rows of one table (the persistent batch's slice)
        self.memory_rows = SaberRows(DREAM_FIELDS if spec.saber_dream else LLADA_FIELDS)

    def default_block_length(self, max_tokens: int) -> int:
        return max_tokens          # both references default to one block (block = gen length)

    def default_steps(self, max_tokens: int) -> int:
        return 512                 # only sizes the Dream port's time grid (its default steps)

    def check_steps(self, steps: int | None, max_tokens: int) -> None:
        """Any positive `steps` is fine: it sizes the time grid, not the number of steps."""

    def view_start(self, block_start: int, prompt_len: int) -> int:
        return prompt_len          # every generation slot up to the block end can be revised

    def start_block(self, state: BlockState, num_masked: int) -> None:
        state.extra = SaberState()

    def block_done(self, state: BlockState, num_masked: int) -> bool:
        """Done when no [MASK] is left anywhere up to the block end (remasks reach back)."""
        return num_masked == 0 and state.extra.prefix_masked == 0

    def decide(self, batch: StepBatch) -> Decision:
        prefix = _up_to_block_end(batch)
        unfilled = batch.masked & prefix
        host = batch.host
        rows = self.memory_rows.handles(batch.states, host.lengths)
        recall = lambda name: self.memory_rows.read(rows, name, host.valid)  # noqa: E731
        if self.spec.saber_dream:
            tokens, reveal, revoke, memory = self._dream_step(batch, prefix, unfilled, recall)
        else:
            tokens, reveal, revoke, memory = self._llada_step(batch, prefix, unfilled, recall)
        return Decision(commit=reveal & ~revoke, tokens=tokens, remask=revoke & ~reveal,
                        state=memory)

    def absorb(self, batch: StepBatch, decision: Decision) -> None:
        """Keep the slots' confidences; count the [MASK]s left up to the block end (a slot
        revealed and revoked by one step stays masked: not a commit)."""
        host = batch.host
        rows = self.memory_rows.handles(batch.states, host.lengths)
        self.memory_rows.write(rows, decision.state, host.valid)
        unfilled = host.masked & _up_to_block_end(host)
        left = (unfilled & ~decision.commit) | decision.remask
        for st, m in zip(batch.states, left.sum(-1).tolist()):
            st.extra.prefix_masked = int(m)

    # ---- generate_with_saber (LLaDA) -----------------------------------------------------------
    def _llada_step(self, batch: StepBatch, prefix: torch.Tensor, unfilled: torch.Tensor,
                    recall):
        n = self.params.n
        tokens, logits = propose(batch)
        conf = token_prob(logits, tokens, torch.float32, mask=batch.mask_column)   # [n, W]
        conf = conf.masked_fill(~prefix, NEG_INF)
        last = on_device(recall("last_conf"), conf)                    # conf in the last step
        delta = conf - last
        delta = torch.where(torch.isfinite(delta), delta, float("inf"))
        latest = recall("reveal_conf")                             # conf at the latest reveal
        reveal = _reveal(conf, unfilled, thresholds(latest), n)
        latest = torch.where(reveal, conf, on_device(latest, conf))
        memory = {"last_conf": conf, "reveal_conf": latest}
        r = reveal.sum(-1).clamp(min=n)
        count = torch.minimum(torch.maximum(torch.full_like(r, n // 2), (r + 7) // 8), r - 1)
        count = count.masked_fill(~(unfilled & ~reveal).any(-1), 0)   # prefix full: no remask
        filled = (prefix & ~batch.masked) | reveal
        # lowest delta first; slots whose delta is not finite rank last but stay eligible
        score = torch.where(delta < float("inf"), -delta.double(), -2.0).masked_fill(~filled,
                                                                                   NEG_INF)
        return tokens, reveal, topk_mask(score, count), memory

    # ---- Saber's Dream decoder -----------------------------------------------------------------
    def _dream_step(self, batch: StepBatch, prefix: torch.Tensor, unfilled: torch.Tensor,
                    recall):
        n = self.params.n
        tokens, probs = dream_candidates(self._penalised(batch, unfilled))
        conf = probs.gather(-1, tokens[..., None]).squeeze(-1).masked_fill(~unfilled, NEG_INF)
        first = recall("first_conf")                               # conf at the first reveal
        reveal = _reveal(conf, unfilled, thresholds(first), n)
        first = on_device(first, conf)
        first = torch.where(reveal & (first == NEG_INF), conf, first)
        u = reveal.sum(-1)
        count = torch.clamp(torch.minimum(-(-u // 8), u - 1), min=1)
        filled = (prefix & ~batch.masked) | reveal
        count = count.masked_fill(~(unfilled & ~reveal).any(-1) | (filled.sum(-1) <= 1), 0)
        current = torch.where(reveal, tokens, batch.tokens)
        own = token_prob(batch.logits, current, torch.float32,        # p(current token),
                         mask=batch.mask_column)                  # no penalty
        return (tokens, reveal, topk_mask((-own).masked_fill(~filled, NEG_INF), count),
                {"first_conf": first})

    def _penalised(self, batch: StepBatch, unfilled: torch.Tensor) -> StepBatch:
        """The batch with Dream's EOS penalty on the pad logit of masked slots (a no-op at 0)."""
        if not self.params.eos_penalty:
            return batch
        eps, shifts, shift = self.params.eps, {}, []
        for st in batch.states:              # one shift per distinct (grid, step) of the batch
            key = (st.block_steps, min(st.memory.get("steps", 0), st.block_steps))
            if key not in shifts:
                t = torch.linspace(1, eps, key[0] + 1)[key[1]]     # float32, as the reference
                shifts[key] = (self.params.eos_penalty * torch.log(1 - t + eps)).item()
            shift.append(shifts[key])
            st.memory["steps"] = st.memory.get("steps", 0) + 1
        logits = batch.logits.clone()
        pad = self.spec.pad_token_id
        logits[..., pad] += on_device(shift, logits, torch.float32)[:, None] * unfilled
        return dataclasses.replace(batch, logits=logits)
