"""Log-likelihood for Nemotron-Labs-Diffusion: exact and autoregressive.

The model is trained with an AR loss beside the diffusion loss (`ar_loss_weight`), and its
causal mode is a plain causal LM: log p(continuation | context) = sum over continuation tokens
of log p(x_j | context, x_<j), read from one causal forward of context + continuation (row i
predicts token i + 1). This is exact (no Monte-Carlo), so `mc_num` is not used; it is the
likelihood the model's own AR decoding (`decoding="ar"`) samples from. The masked-diffusion
estimator is not used for this family: its committed blocks are causal, so a bidirectional
masked estimate would score a distribution the model never decodes from.
"""

from __future__ import annotations

import torch

from cover_vllm.models.nemotron_cache import Piece
from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams, ScoreMetrics
from cover_vllm.scoring.prompts import check_pair, score_pair


@torch.no_grad()
def causal_loglikelihood(runner, requests: list, params: list[LoglikelihoodParams],
                         ids: list[str]) -> list[LoglikelihoodOutput]:
    """One LoglikelihoodOutput per request (see the module docstring), `max_num_seqs` a
    forward."""
    pairs = [check_scoring(runner, request, p) for request, p in zip(requests, params)]
    outputs = []
    step = runner.max_num_seqs
    for start in range(0, len(pairs), step):
        chunk = pairs[start:start + step]
        slots = [runner.scratch.allocate(1) for _ in chunk]      # nothing cached or written
        try:
            pieces = [Piece(s, c + x, True, False, list(range(len(c) - 1, len(c) + len(x) - 1)))
                      for s, (c, x) in zip(slots, chunk)]
            logits = runner.forward(runner.scratch, pieces)     # every rank under TP
        finally:
            for s in slots:
                runner.scratch.release(s)
        for i, ((c, x), rows) in enumerate(zip(chunk, logits)):
            outputs.append(_output(ids[start + i], c, x, rows, params[start + i]))
    return outputs


def check_scoring(runner, request, params: LoglikelihoodParams) -> tuple[list, list]:
    """(context, continuation) token ids of a request; ValueError naming what is wrong."""
    spec = runner.spec
    context, continuation = score_pair(request, runner.engine.tokenizer)
    check_pair(context, continuation, spec.vocab_size, spec.max_model_len)
    if not context:
        raise ValueError("context_token_ids is empty: the causal likelihood of the first "
                         "token needs at least one context token (e.g. BOS)")
    if params.logprobs is not None and params.logprobs < 0:
        raise ValueError("LoglikelihoodParams.logprobs must be >= 0")
    return context, continuation


def _output(rid: str, context: list[int], continuation: list[int], logits: torch.Tensor,
            params: LoglikelihoodParams) -> LoglikelihoodOutput:
    logp = torch.log_softmax(logits, -1)                       # [len(x), V]
    target = torch.tensor(continuation)
    token = logp.gather(-1, target[:, None])[:, 0]
    greedy = bool((logits.argmax(-1) == target).all())
    top = None
    if params.logprobs:
        values, index = logp.topk(min(params.logprobs, logp.shape[-1]), -1)
        top = [dict(zip(ix.tolist(), v.tolist())) for ix, v in zip(index, values)]
    metrics = ScoreMetrics(nfe=1, forward_tokens=len(context) + len(continuation))
    return LoglikelihoodOutput(rid, float(token.sum()), greedy, list(context),
                               list(continuation), token.tolist(), top, metrics)
