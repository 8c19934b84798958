"""vLLM's SamplingParams fields beyond the diffusion core: the checks of the ones this engine
implements and the table of the ones it refuses, each with the reason (shared by SamplingParams
and the server's request bodies, so offline and online refuse alike).

Implemented (cover_vllm/engine/logits_processors.py applies the first five to the logits every
decoder reads; the output processor the last three):
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_p`, `min_tokens`,
`skip_special_tokens`, `include_stop_str_in_output`, `detokenize`; and `prompt_logprobs`
(LLM.generate scores the prompt tokens after generating: llm.py).
Refused unless at vLLM's default (a value asking for what the engine does anyway is accepted):
`REFUSED` below. `guided_decoding` is vLLM's older name of `structured_outputs` (SamplingParams
moves it there).
"""

from __future__ import annotations

import math
from typing import Any

from cover_vllm.outputs import MAX_LOGPROBS
from cover_vllm.vllm_args import VllmOnly

_BIAS = ("per-token biases are not applied: constrain the output with structured_outputs "
         "(choice, regex, grammar) instead")
REFUSED: dict[str, VllmOnly] = {
    "best_of": VllmOnly("there is no best-of ranking: a masked diffusion output has no "
                        "left-to-right log-probability to rank by; use n", (None, 1)),
    "bad_words": VllmOnly("banned word sequences need a left-to-right prefix to match; use "
                          "structured_outputs (regex, grammar) to exclude text", (None, [], ())),
    "spaces_between_special_tokens": VllmOnly(
        "special tokens are decoded by the tokenizer's own rule (tokenizer.json)", (True,)),
    "logits_processors": VllmOnly(
        "per-request Python callables would run once per row on the host; decisions run "
        "vectorised on the logits' device (use min_p, min_tokens, the penalties or "
        "structured_outputs)", (None, [], ())),
    "truncate_prompt_tokens": VllmOnly("prompts are never truncated: a prompt that does not "
                                       "fit with max_tokens is refused with the numbers",
                                       (None,)),
    "output_kind": VllmOnly("LLM.generate returns each request's cumulative, final output "
                            "(the server streams deltas itself)",
                            (None, 0, 2, "cumulative", "final_only", "CUMULATIVE",
                             "FINAL_ONLY")),
    "logit_bias": VllmOnly(_BIAS, (None, {})),
    "allowed_token_ids": VllmOnly(_BIAS, (None, [], ())),
    "extra_args": VllmOnly("no custom sampler reads them: every knob of a decoder is in "
                           "decoding_params", (None, {})),
    "flat_logprobs": VllmOnly("logprobs come as vLLM's default list of {token id: Logprob} "
                              "dicts", (False,)),
    "logprob_token_ids": VllmOnly("logprobs report the chosen token and the top k; score "
                                  "chosen continuations with LLM.loglikelihood", (None, [], ())),
    "prompt_logprob_token_ids": VllmOnly("prompt_logprobs report each prompt token and the "
                                         "top k", (None, [], ())),
    "prompt_logprob_start": VllmOnly("prompt_logprobs score every prompt token after the "
                                     "first", (None, 0, 1)),
    "stream_interval": VllmOnly("the server streams each block's final text as the block "
                                "ends: a diffusion canvas has no per-token stream", (None, 1)),
    "thinking_token_budget": VllmOnly("no reasoning parser splits a canvas into thinking and "
                                      "answer", (None,)),
    "repetition_detection": VllmOnly("a canvas is decoded in parallel, not extended token by "
                                     "token, so there is no growing tail to watch; use "
                                     "repetition_penalty", (None,)),
    "trace_decode_token_ids": VllmOnly("forced decoding is not offered (score a fixed "
                                       "continuation with LLM.loglikelihood)", (None, [], ())),
    "routed_experts_prompt_start": VllmOnly("routing data is not returned", (0,)),
}
PENALTY_RANGE = (-2.0, 2.0)          # OpenAI's and vLLM's range of presence / frequency


def refusal(name: str, value: Any, owner: str = "SamplingParams.") -> str | None:
    """The ValueError message for a refused field at `value` (None: accepted)."""
    entry = REFUSED[name]
    if entry.accepts(_plain(value)):
        return None
    return f"{owner}{name}={value!r} is not supported: {entry.describe()}"


def _plain(value: Any) -> Any:
    """An enum member (vLLM's RequestOutputKind) as its value / name, for `accepts`."""
    if hasattr(value, "value") and hasattr(value, "name"):
        return value.name if isinstance(value.value, int) and value.name else value.value
    return value


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        raise ValueError(f"{owner}{name} must be a finite number, got {value!r}")
    return float(value)


def check_processing_fields(p: Any, owner: str = "SamplingParams.") -> None:
    """ValueError naming the field for a penalty, min_p or min_tokens out of range (vLLM's
    ranges) and a non-bool switch; `p` is a SamplingParams."""
    low, high = PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        if not low <= _number(owner, name, getattr(p, name)) <= high:
            raise ValueError(f"{owner}{name} must be in [{low}, {high}], got "
                             f"{getattr(p, name)}")
    if _number(owner, "repetition_penalty", p.repetition_penalty) <= 0:
        raise ValueError(f"{owner}repetition_penalty must be > 0 (1.0: off), got "
                         f"{p.repetition_penalty}")
    if not 0.0 <= _number(owner, "min_p", p.min_p) <= 1.0:
        raise ValueError(f"{owner}min_p must be in [0, 1] (0: off), got {p.min_p}")
    most = p.max_tokens if p.max_tokens is not None else p.min_tokens   # None: max length
    if isinstance(p.min_tokens, bool) or not isinstance(p.min_tokens, int) or not (
            0 <= p.min_tokens <= most):
        raise ValueError(f"{owner}min_tokens must be an int from 0 to max_tokens "
                         f"({p.max_tokens}), got {p.min_tokens!r}")
    for name in ("skip_special_tokens", "include_stop_str_in_output", "detokenize"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{owner}{name} must be a bool (True or False), got "
                             f"{getattr(p, name)!r}")
    k = p.prompt_logprobs
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                          or not 0 <= k <= MAX_LOGPROBS):
        raise ValueError(f"{owner}prompt_logprobs must be None (off) or an int from 0 to "
                         f"{MAX_LOGPROBS}, got {p.prompt_logprobs!r}")
    if not p.detokenize and p.stop:
        raise ValueError(f"{owner}stop strings need detokenize=True (they are matched in the "
                         "text); use stop_token_ids")


def check_refused_fields(p: Any, owner: str = "SamplingParams.") -> None:
    """One ValueError naming every refused field `p` sets away from vLLM's default."""
    problems = [m for m in (refusal(name, getattr(p, name), owner) for name in REFUSED) if m]
    if problems:
        raise ValueError("; ".join(problems))


def processes_logits(p: Any) -> bool:
    """Whether a request's logits go through the logits processors (any of them is on)."""
    return (p.min_tokens > 0 or p.min_p > 0.0 or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
