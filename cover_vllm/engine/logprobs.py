"""Token log-probabilities (SamplingParams.logprobs): captured from a forward's logits for the
tokens a decision writes (`logprob_rows` on the logits' device, right after each strategy's
`decide`; `attach_logprobs` on the host once they arrive), kept per canvas position by the
Request (the last write wins), and turned into vLLM's per-token {token id: Logprob} dicts for the
output (`LogprobBuilder`, used by the output processor).

Only requests that ask for logprobs pay anything: the log_softmax runs over the rows of the
positions written in that step (on the CPU; a GPU reads the view's rows and keeps those), never
over more than the view.
"""

from __future__ import annotations

import math

import torch

from cover_vllm.outputs import Logprob
from cover_vllm.scheduler.request import KeptLogprobs
from cover_vllm.step_plan import RowDecision, TokenLogprobs
from cover_vllm.strategies.sampling import Rows


def logprob_rows(logits: torch.Tensor, written: torch.Tensor, tokens: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the logits' device, for the view rows `written` [W] bool: the written token and the
    top k, as ids [W, 1 + k] and log-probabilities [W, 1 + k] float32, and the written token's
    rank [W] (0 on rows not written).

    logits [W, V]: the request's view rows as its strategy saw them (row i predicts view
    position i; [MASK] already at -inf), before any temperature or top-k / top-p filter. The rank
    is vLLM's: 1 + the number of other tokens at least as likely (ties count against it).
    """
    rows = Rows(written[None])
    with torch.inference_mode():                 # the runner's logits are inference tensors
        lp = rows.take(logits[None]).float().log_softmax(-1)              # [N, V]
        chosen = rows.take(tokens[None])                                   # [N]
        values = lp.gather(1, chosen[:, None])                             # [N, 1]
        ranks = (lp >= values).sum(-1)                                     # [N]
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)                        # [N, k] each
        ids = torch.cat([chosen[:, None], top.indices], 1)
        logprobs = torch.cat([values, top.values], 1)
    return tuple(t[0] for t in (rows.put(ids, 0), rows.put(logprobs, 0.0), rows.put(ranks, 0)))


def attach_logprobs(decision: RowDecision, rows: tuple[torch.Tensor, ...]) -> None:
    """Set `decision.logprobs` for the positions it writes (commit | replace) from the host
    copy of `logprob_rows`' result for that decision."""
    ids, logprobs, ranks = rows
    written = decision.commit if decision.replace is None else decision.commit | decision.replace
    positions = written.nonzero().flatten()                              # [N]
    decision.logprobs = TokenLogprobs(
        positions=positions, token_ids=ids.index_select(0, positions),
        logprobs=logprobs.index_select(0, positions), ranks=ranks.index_select(0, positions))


class LogprobBuilder:
    """Per-token {token id: Logprob} dicts from kept entries; a token's text is decoded once
    (vLLM's decoded_token: `tokenizer.decode([id])`) and cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def entry(self, token_id: int, kept: KeptLogprobs | None) -> dict[int, Logprob]:
        """The chosen token first, then the top k in rank order (a top token equal to the
        chosen one is not repeated)."""
        if kept is None:       # never written by a decision (cannot happen for FINAL tokens)
            return {token_id: Logprob(-math.inf, None, self.token_text(token_id))}
        ids, values, rank = kept
        out = {ids[0]: Logprob(values[0], rank, self.token_text(ids[0]))}
        for r, (t, v) in enumerate(zip(ids[1:], values[1:]), start=1):
            if t not in out:
                out[t] = Logprob(v, r, self.token_text(t))
        return out

    def extend(self, built: list[dict[int, Logprob]], kept: dict[int, KeptLogprobs],
               first: int, token_ids: list[int]) -> list[dict[int, Logprob]]:
        """Build the dicts of `token_ids` (generated tokens from canvas position `first`) past
        the `built` ones (FINAL positions never change, so each is built once); a copy of the
        first len(token_ids)."""
        for i in range(len(built), len(token_ids)):
            built.append(self.entry(token_ids[i], kept.get(first + i)))
        return built[: len(token_ids)]
