"""vLLM's per-request logits processors on a diffusion canvas: the penalties, `min_tokens` and
`min_p`, applied to a step's view logits before any decoder reads them (engine/decide.py).

Only the rows of requests that set one of them are touched (none: nothing runs, so every
default path is bit-identical). Per-request facts (token counts, which view rows are early,
which ids a request may not end on yet) are built on the host, where the canvas lives, and
cross to the logits' device in one host-to-device copy each; the arithmetic runs there,
vectorised over the requests, rows and vocabulary, and never reads a value back.

What each means on a canvas (vLLM defines them for a left-to-right output; here the output is
the canvas's generation slots, some still [MASK]):

* counts: `output` counts each token id over the generation slots that currently show a token
  (not [MASK]), the request's EOS ids and stop_token_ids excepted (a canvas pads its tail with
  EOS where a left-to-right output holds one); `prompt` marks the prompt's ids.
* `repetition_penalty` r (CTRL / Hugging Face / vLLM): a token in the prompt or the output has
  its logit divided by r when positive, multiplied by r otherwise.
* `frequency_penalty` f and `presence_penalty` p (OpenAI / vLLM): logit -= f * output count
  + p * (output count > 0).
* `min_tokens` k: at generation slots 0 .. k-1 (canvas position - prompt length) the EOS ids
  (unless ignore_eos) and stop_token_ids get -inf, so the output cannot end before k tokens.
* `min_p` m: a token whose probability is below m times the most likely token's is dropped
  (-inf); under temperature T > 0 the probabilities are those of logits / T, as in vLLM.

The same penalties apply at every row of the request's view, a position's own current token
included (a canvas has no "before"). `logprobs` report the logits before these processors
(vLLM's default, raw logprobs): `process_logits` returns those rows untouched.
"""

from __future__ import annotations

import math

import torch

from cover_vllm.sampling_fields import processes_logits
from cover_vllm.strategies.sampling import on_device


def process_logits(logits: torch.Tensor, reqs: list, view_starts: list[int]
                   ) -> dict[int, torch.Tensor]:
    """Apply the processors in place to logits [n, W, V] (request i's view starts at canvas
    position view_starts[i]); returns {row: its logits before processing} for the processed
    requests that asked for logprobs."""
    rows = [i for i, r in enumerate(reqs) if processes_logits(r.params)]
    if not rows:
        return {}
    picked = [reqs[i] for i in rows]
    with torch.inference_mode():               # the runner's logits are inference tensors
        raw = {i: logits[i].clone() for i in rows if reqs[i].params.logprobs is not None}
        index = on_device(rows, logits, torch.long)
        sub = logits.index_select(0, index).float()                       # [m, W, V]
        sub = _penalise(sub, picked)
        sub = _min_tokens(sub, picked, [view_starts[i] for i in rows])
        sub = _min_p(sub, picked)
        logits.index_copy_(0, index, sub.to(logits.dtype))
    return raw


def _stop_ids(req) -> list[int]:
    eos = [] if req.params.ignore_eos else list(req.strategy.spec.eos_token_ids)
    return eos + list(req.params.stop_token_ids)


def _counts(req, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The host's ([V] output counts, [V] bool prompt presence) of one request (module doc)."""
    gen = req.canvas[req.prompt_len:req.gen_end]
    keep = gen != req.mask_id
    for t in _stop_ids(req):
        keep &= gen != t
    shown = gen[keep]
    output = torch.bincount(shown[shown < vocab], minlength=vocab)[:vocab]
    prompt = req.canvas[:req.prompt_len]
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    in_prompt[prompt[prompt < vocab]] = True
    return output, in_prompt


def _penalise(sub: torch.Tensor, reqs: list) -> torch.Tensor:
    params = [r.params for r in reqs]
    if all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
           and p.frequency_penalty == 0.0 for p in params):
        return sub
    vocab = sub.shape[-1]
    output, in_prompt = map(torch.stack, zip(*(_counts(r, vocab) for r in reqs)))
    output = on_device(output, sub, torch.float32)[:, None, :]                 # [m, 1, V]
    seen = on_device(in_prompt, sub)[:, None, :] | (output > 0)
    rep, freq, pres = (on_device([getattr(p, name) for p in params], sub, torch.float32)
                       [:, None, None] for name in ("repetition_penalty", "frequency_penalty",
                                                    "presence_penalty"))
    scaled = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, scaled, sub)
    return sub - freq * output - pres * (output > 0).float()


def _min_tokens(sub: torch.Tensor, reqs: list, view_starts: list[int]) -> torch.Tensor:
    if all(r.params.min_tokens == 0 for r in reqs):
        return sub
    m, width, vocab = sub.shape
    early = torch.zeros(m, width, dtype=torch.bool)
    banned = torch.zeros(m, vocab, dtype=torch.bool)
    for i, (req, start) in enumerate(zip(reqs, view_starts)):
        slot = torch.arange(start, start + width) - req.prompt_len     # generation slot
        early[i] = (slot >= 0) & (slot < req.params.min_tokens)
        ids = [t for t in _stop_ids(req) if 0 <= t < vocab]
        banned[i, ids] = True
    ban = on_device(early, sub)[:, :, None] & on_device(banned, sub)[:, None, :]
    return sub.masked_fill(ban, float("-inf"))


def _min_p(sub: torch.Tensor, reqs: list) -> torch.Tensor:
    params = [r.params for r in reqs]
    if all(p.min_p == 0.0 for p in params):
        return sub
    # log of the bar relative to the top token, in logit units (-inf: off)
    bars = [(p.temperature if p.temperature > 0 else 1.0) * math.log(p.min_p)
            if p.min_p > 0 else float("-inf") for p in params]
    bar = on_device(bars, sub, torch.float32)[:, None, None]
    top = sub.max(dim=-1, keepdim=True).values
    return sub.masked_fill(sub < top + bar, float("-inf"))
