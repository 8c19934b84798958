"""Request bodies of /v1/completions and /v1/chat/completions (pydantic) and their SamplingParams.

Models are strict (no "5" -> 5 coercion) and forbid unknown fields, so a typo such as `decodng`
is a 400 instead of a silently ignored knob. OpenAI's penalties and vLLM's `repetition_penalty`,
`min_p`, `min_tokens`, `skip_special_tokens` and `include_stop_str_in_output` map onto
SamplingParams' fields of the same names (checked there); fields the engine cannot honour
(best_of > 1, logit_bias, suffix) are accepted only at their neutral value, refused with the
reason from the table SamplingParams uses (sampling_fields.REFUSED). `echo` (with `logprobs`, the
prompt's per-token values: likelihood scoring, server/scoring.py) takes `max_tokens` 0. `n`,
completions' `logprobs` and chat's `logprobs` + `top_logprobs` map onto SamplingParams.n / .logprobs;
`return_token_ids` (vLLM's) adds the token ids to the response. OpenAI's `response_format` and
vLLM's `structured_outputs` map onto SamplingParams.structured_outputs (structured.py). Limits that
need the model (prompt + max_tokens <= max length) are checked in serving.py after tokenising.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from cover_vllm.cache_refresh import parse_cache_refresh
from cover_vllm.chat import CHAT_ROLES, ChatTemplateOptions, content_text
from cover_vllm.entrypoints.server.structured import (ResponseFormat, StructuredOutputsFields,
                                                      check_one_constraint, constraint,
                                                      constraint_field)
from cover_vllm.sampling_fields import refusal
from cover_vllm.sampling_params import MAX_LOGPROBS, SamplingParams, check_n
from cover_vllm.strategies import DECODERS

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 256
DEFAULT_COMPLETION_TOKENS = 16     # OpenAI's documented default for /v1/completions
DEFAULT_CHAT_TOKENS = 64           # SamplingParams' default
# OpenAI chat fields clients send by default that cannot change a diffusion answer: accepted and
# ignored, logged once per server (vLLM ignores them too); `user` is SamplingFields'
IGNORED_CHAT_FIELDS = ("store", "metadata", "service_tier", "reasoning_effort",
                       "parallel_tool_calls", "user", "prediction")
VLLM_SAMPLING_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
                        "min_tokens", "skip_special_tokens", "include_stop_str_in_output")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


def _neutral(value: Any, neutral: tuple, what: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{what} is not supported by this server (got {value!r})")
    return value


def _refused(name: str, value: Any) -> Any:
    """`value` when SamplingParams' table accepts it for `name`, else its refusal."""
    message = refusal(name, value, owner="")
    if message:
        raise ValueError(message)
    return value


class SamplingFields(_Strict):
    """Fields shared by both routes: OpenAI's sampling knobs plus the diffusion extras."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM's extra sampling fields (SamplingParams checks their ranges)
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # diffusion extras (extra_body= in the openai client)
    decoding: str | None = None
    block_length: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1)
    kv_cache: Literal["none", "prefix", "dual"] | None = None
    cache_refresh: str | None = None      # "block" | "interval:N" | "adaptive"
    decoding_params: dict[str, Any] | None = None
    return_token_ids: bool | None = None  # vLLM's: choices[].token_ids and prompt_token_ids
    # structured outputs: OpenAI's response_format or vLLM's structured_outputs (structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):     # vLLM's rule
            raise ValueError("stream_options can only be given with stream=true")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value):
        if value is not None:
            check_n(value)          # SamplingParams' own rule: 1 to MAX_N, with the reason
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        return _refused("logit_bias", value)

    @field_validator("cache_refresh")
    @classmethod
    def _cache_refresh(cls, value):
        if value is not None:
            parse_cache_refresh(value)        # ValueError naming the allowed forms -> 400
        return value

    @field_validator("decoding")
    @classmethod
    def _decoding(cls, value):
        if value is not None and value not in DECODERS:
            raise ValueError(f"unknown decoding strategy {value!r}; valid: {sorted(DECODERS)}")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value, info: ValidationInfo):
        check_one_constraint(info.data.get("response_format"), value)
        return value

    def constraint_field(self) -> str | None:
        """The field carrying the constraint (response_format / structured_outputs) or None."""
        return constraint_field(self.response_format, self.structured_outputs)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: alternatives per token (None: no logprobs)."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError/TypeError naming the field (mapped to a 400 by the caller)."""
        return SamplingParams(
            max_tokens=max_tokens, block_length=self.block_length, steps=self.steps,
            temperature=0.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            decoding=self.decoding, decoding_params=self.decoding_params, kv_cache=self.kv_cache,
            cache_refresh=self.cache_refresh, n=self.n or 1, logprobs=self.num_logprobs(),
            structured_outputs=constraint(self.response_format, self.structured_outputs),
            **self._vllm_fields())

    def _vllm_fields(self) -> dict[str, Any]:
        """The penalties and vLLM's extra fields that were sent (SamplingParams' defaults
        stand for the others)."""
        return {k: getattr(self, k) for k in VLLM_SAMPLING_FIELDS if getattr(self, k) is not None}


def _check_logprobs(value: int | None, name: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_prompt(value: Any) -> list[str | list[int]]:
    """A completion prompt as a list of strings / token-id lists (one engine request each)."""
    shape = ("prompt must be a non-empty string, a list of strings, a list of token ids or a "
             "list of token-id lists")
    if isinstance(value, str):
        prompts: list = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        prompts = value
    else:
        raise ValueError(shape)
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
    for p in prompts:
        if isinstance(p, list) and not all(_is_int(t) for t in p):
            raise ValueError(shape)
        if not p:
            raise ValueError("prompt is empty")
    return prompts


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(None, ge=0)     # 0: only with echo (score the prompt)
    echo: bool | None = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None
    # likelihood scoring with echo + logprobs (extra_body; server/scoring.py)
    continuation: str | list[int] | list[str | list[int]] | None = None
    mc_num: int | None = Field(None, ge=1)
    mc_batch_size: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        return normalize_prompt(value)

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value):
        return _refused("best_of", value)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value):
        return _check_logprobs(value, "logprobs")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value):
        return _neutral(value or None, (None,), "suffix")

    def max_new_tokens(self, model_default: int | None = None) -> int:
        """max_tokens, else the checkpoint's max_new_tokens, else OpenAI's default."""
        if self.max_tokens is not None:
            return self.max_tokens
        return model_default or DEFAULT_COMPLETION_TOKENS


class ChatMessage(_Strict):
    role: Literal[CHAT_ROLES]          # LLM.chat checks the same roles (cover_vllm/chat.py)
    content: Any
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        return content_text(value)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM's chat-template extras (cover_vllm/chat.py ChatTemplateOptions; the template itself
    # is the server's: `serve --chat-template`)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: accepted and ignored (IGNORED_CHAT_FIELDS)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = None
    # tools reach the chat template (the model sees them); the answer stays text
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value):
        if value not in (None, "none"):
            raise ValueError(
                f"tool_choice {value!r} is not supported: no tool-call parser reads calls out "
                "of the output, so only \"none\" is honoured (the tools still reach the chat "
                "template and the answer is text)")
        return value

    def ignored_fields(self) -> list[str]:
        """The IGNORED_CHAT_FIELDS this request sent."""
        return [k for k in IGNORED_CHAT_FIELDS if getattr(self, k) is not None]

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):          # OpenAI's rule
            raise ValueError("top_logprobs needs logprobs=true")
        return _check_logprobs(value, "top_logprobs")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self, model_default: int | None = None) -> int:
        """max_completion_tokens / max_tokens, else the checkpoint's max_new_tokens, else 64."""
        return (self.max_completion_tokens or self.max_tokens or model_default
                or DEFAULT_CHAT_TOKENS)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def template_options(self, chat_template: str | None) -> ChatTemplateOptions:
        """How this request's messages become its prompt, under the server's template
        (ValueError naming the field for a bad combination)."""
        kwargs = self.chat_template_kwargs
        if self.tools is not None:
            kwargs = {**(kwargs or {}), "tools": self.tools}
        return ChatTemplateOptions(chat_template, self.add_generation_prompt,
                                   self.continue_final_message, kwargs)
