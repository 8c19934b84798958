"""vLLM's prompt dicts (`vllm.inputs`): TokensPrompt and TextPrompt, which `LLM.generate` takes
beside plain strings and token-id lists. Only these keys are read: the models served here take
text only (no multi_modal_data)."""

from __future__ import annotations

from typing import TypedDict, Union


class TextPrompt(TypedDict):
    """A prompt as text (tokenized by the model's tokenizer)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids."""

    prompt_token_ids: list[int]


PromptType = Union[str, TextPrompt, TokensPrompt, list[int]]
