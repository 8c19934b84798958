"""SamplingParams: the per-request knobs of `LLM.generate` and the server, validated on creation;
StructuredOutputsParams: a request's output constraint (vLLM's names)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, is_dataclass
from typing import Any

from cover_vllm.cache_refresh import CacheRefresh, parse_cache_refresh
from cover_vllm.config import KV_CACHE_MODES
from cover_vllm.outputs import MAX_LOGPROBS
from cover_vllm.sampling_fields import check_processing_fields, check_refused_fields

MAX_N = 64            # most outputs per prompt (`n`), offline and on the server alike
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")



class FieldTypeError(TypeError, ValueError):
    """A field of the wrong type: a TypeError, and a ValueError like every other bad field
    (the server's 400; issue #52), so `except ValueError` catches it."""

def _check_int(name: str, value: Any, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")


def check_n(n: Any, owner: str = "") -> None:
    """`n` (outputs per prompt) is an int from 1 to MAX_N; `owner` prefixes the field name."""
    _check_int("n", n, allow_none=False)
    if not 1 <= n <= MAX_N:
        raise ValueError(
            f"{owner}n (outputs per prompt) must be an integer from 1 to {MAX_N}, got {n}: each "
            "output is its own canvas, queued and decoded as a request of its own, so n costs "
            f"n requests' memory and time at once; for more samples, call again (with a seed, "
            f"seed + {MAX_N} continues where the last call's outputs stopped)")


def _check_str_list(name: str, value: Any) -> list:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise TypeError(f"SamplingParams.{name} must be a non-empty string or a list of them")
    return list(items)


@dataclass
class StructuredOutputsParams:
    """The output must match one constraint (vLLM's `StructuredOutputsParams`): a JSON schema
    (`json`, a dict or its JSON text), any JSON value (`json_object=True`), a regular expression
    (`regex`), one of a list of strings (`choice`) or an EBNF grammar (`grammar`, xgrammar's
    GBNF dialect). `disable_any_whitespace` makes JSON compact (no optional whitespace).
    Decoding under a constraint: cover_vllm/structured_output/ and docs/architecture.md."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured_outputs.{name} is not supported by this engine's "
                                 f"grammar backend (xgrammar); use one of {list(STRUCTURED_KINDS)}")
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(STRUCTURED_KINDS)}"
                             f", got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError("structured_outputs.json must be a JSON schema (dict) or its JSON "
                            f"text, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise TypeError("structured_outputs.choice must be a non-empty list of "
                                "non-empty strings")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise TypeError("structured_outputs.json_object must be a bool")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be a bool")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_KINDS."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How one request is decoded.

    `max_tokens` (None: up to the model's max length after the prompt, as in vLLM)
    generation slots start as [MASK] and are split into semi-autoregressive blocks of
    `block_length` (None: the model's default, capped at max_tokens). `steps` is the total number of
    denoising steps for strategies with a fixed schedule (None: the strategy's default, e.g. one
    token per step for `low_confidence`). `decoding` overrides the engine's default strategy and
    `decoding_params` (a dict or the strategy's params dataclass) its knobs; `kv_cache` overrides
    the engine's cache mode for this request ("none" | "prefix" | "dual") and `cache_refresh` its
    refresh policy ("block" | "interval:N" | "adaptive"; cover_vllm/cache_refresh.py).

    `n` (1..MAX_N) outputs are generated per prompt, each on its own canvas (batched together);
    under a `seed` output i draws from seed + i (vLLM's rule), so output 0 equals the n=1 output.
    `logprobs` = k (0..MAX_LOGPROBS; None: off) returns, for every generated token, a dict
    {token id: Logprob} holding the chosen token and the k most likely tokens of the model's
    distribution at the step that committed it: log_softmax of that position's logits row in
    that forward, [MASK] excluded, before temperature / top-k / top-p. A token that a check
    later replaced, or remasked and committed again, reports its final commit. `stop_reason` in
    the output is the stop string or stop token id that ended it (None for EOS and length).
    `structured_outputs` constrains the output (StructuredOutputsParams; a dict of its fields is
    accepted too): every decoder commits only tokens the grammar allows after the committed
    prefix, and the request ends when the value is complete.

    vLLM's other fields (cover_vllm/sampling_fields.py): `repetition_penalty`,
    `frequency_penalty`, `presence_penalty`, `min_p` and `min_tokens` rewrite the logits every
    masked decoder reads (engine/logits_processors.py says what each means on a canvas);
    `skip_special_tokens`, `include_stop_str_in_output` and `detokenize` shape the output text;
    the rest construct at vLLM's defaults and any other value raises ValueError with the reason
    (`guided_decoding` is moved to `structured_outputs`). `decoding` and `decoding_params` are
    checked here against the strategy registry.
    """

    max_tokens: int = 64
    block_length: int | None = None
    steps: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    decoding: str | None = None
    decoding_params: Any = None
    kv_cache: str | None = None
    cache_refresh: str | CacheRefresh | None = None
    n: int = 1
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    # vLLM's fields (sampling_fields.py): logits processors, then the output's text
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # vLLM's fields accepted at their defaults only (sampling_fields.REFUSED says why)
    best_of: int | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    truncate_prompt_tokens: int | None = None
    output_kind: Any = None
    guided_decoding: Any = None
    logit_bias: Any = None
    allowed_token_ids: Any = None
    extra_args: Any = None
    flat_logprobs: bool = False
    logprob_token_ids: Any = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    stream_interval: int | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    trace_decode_token_ids: Any = None
    routed_experts_prompt_start: int = 0
    # vLLM's internal switches: any value, no effect here
    skip_clone: bool = False
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, allow_none=True)   # None: up to max length
        for name in ("block_length", "steps", "seed", "logprobs"):
            _check_int(name, getattr(self, name), allow_none=True)
        _check_int("top_k", self.top_k, allow_none=False)
        check_n(self.n, "SamplingParams.")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"SamplingParams.logprobs must be None (off) or an int from 0 "
                             f"(the chosen token only) to {MAX_LOGPROBS}, got {self.logprobs}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens must be > 0, got {self.max_tokens}")
        if self.block_length is not None and self.block_length <= 0:
            raise ValueError(f"SamplingParams.block_length must be > 0, got {self.block_length}")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"SamplingParams.steps must be > 0, got {self.steps}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a number, got "
                                f"{type(value).__name__}")
            if not math.isfinite(value):          # the server's rule (allow_inf_nan=False)
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {value}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be 0 or -1 (off) or >= 1, got "
                             f"{self.top_k}")
        if self.top_k == 0:                      # vLLM's default spelling of "off"
            self.top_k = -1
        self.stop = _check_str_list("stop", self.stop)
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError("SamplingParams.stop_token_ids must be a list of ints")
        self.stop_token_ids = list(ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError("SamplingParams.ignore_eos must be a bool")
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"SamplingParams.kv_cache={self.kv_cache!r}; choose one of "
                             f"{list(KV_CACHE_MODES)} or None")
        if self.cache_refresh is not None:
            try:
                parse_cache_refresh(self.cache_refresh)
            except ValueError as exc:
                raise ValueError(f"SamplingParams.{exc}") from None
        self._vllm_fields()
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise TypeError(f"SamplingParams.structured_outputs: {exc}") from None
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise TypeError("SamplingParams.structured_outputs must be StructuredOutputsParams, "
                            "a dict of its fields, or None")
        if self.decoding is not None and not isinstance(self.decoding, str):
            raise TypeError("SamplingParams.decoding must be a strategy name (str) or None")
        knobs = self.decoding_params
        if knobs is not None and not is_dataclass(knobs) and not (
                isinstance(knobs, dict) and all(isinstance(k, str) for k in knobs)):
            raise FieldTypeError("SamplingParams.decoding_params must be a dict of the decoder's "
                                     "knobs (or its params dataclass), got "
                                 f"{type(knobs).__name__}")
        self._check_decoding()

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's `SamplingParams.clone`)."""
        return copy.deepcopy(self)

    def _vllm_fields(self) -> None:
        """vLLM's extra fields: ranges, refusals, and guided_decoding moved to
        structured_outputs (its older name)."""
        check_processing_fields(self)
        check_refused_fields(self)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("SamplingParams: give structured_outputs or guided_decoding "
                                 "(its older name), not both")
            given = self.guided_decoding
            self.structured_outputs = given if isinstance(given, dict) else {
                k: getattr(given, k) for k in StructuredOutputsParams.__dataclass_fields__
                if getattr(given, k, None) is not None}
            self.guided_decoding = None

    def _check_decoding(self) -> None:
        """The decoder's name and knobs, checked now as the server checks them (ValueError /
        TypeError naming `decoding` and the valid names, or the knob); knobs given without a
        decoder are the engine's default decoder's: a name no decoder has is refused here, the
        rest are checked when the request is added."""
        from cover_vllm.strategies import DECODERS, make_params, strategy_class

        if self.decoding is None:
            if isinstance(self.decoding_params, dict):
                known = {f for name in DECODERS
                         for f in strategy_class(name).params_cls.__dataclass_fields__}
                unknown = sorted(set(self.decoding_params) - known)
                if unknown:
                    raise ValueError(f"SamplingParams.decoding_params {unknown}: no decoder has "
                                     f"such a knob; known knobs: {sorted(known)}")
            return

        make_params(self.decoding, self.decoding_params)
