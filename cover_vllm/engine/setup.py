"""What an Engine settles once, at start, and per request: whether prompt blocks are shared
(prefix caching), its tokenizer, the trust_remote_code log line, a request's prompt ids and
length check, and each request's random stream (on the device where decisions are made)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from cover_vllm.config import EngineConfig
from cover_vllm.engine.canvas_decide import check_canvas_length
from cover_vllm.logger import init_logger
from cover_vllm.models.spec import ModelSpec
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.text_input import check_text

logger = init_logger(__name__)


def prefix_caching(config: EngineConfig, spec: ModelSpec) -> bool:
    """`enable_prefix_caching` resolved: None means on exactly for block-causal models; asking
    for it on a full-attention model is an error (a prompt's K/V depend on the whole canvas
    there, so no two requests share them)."""
    block_causal = spec.attention.is_block_causal
    if config.enable_prefix_caching and not block_causal:
        raise ValueError("enable_prefix_caching=True needs a block-causal model (LLaDA2.x, "
                         f"SDAR); {spec.family!r} attends over the whole canvas, so its prompt "
                         "K/V are never shared")
    return block_causal if config.enable_prefix_caching is None else config.enable_prefix_caching


def load_tokenizer_if_any(path, required: bool = False):
    """The tokenizer in `path`, or None when it has none (an explicit `tokenizer=` must have
    one: FileNotFoundError listing what the directory holds)."""
    if path is None:
        return None
    from cover_vllm.tokenizer import has_tokenizer, load_tokenizer

    return load_tokenizer(path) if required or has_tokenizer(path) else None


def request_generator(device: torch.device, seed: int) -> torch.Generator | None:
    """A request's own random stream, on the device where its decisions are made (None on the
    shapes-only "meta" device, which draws no values)."""
    if device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed)


@functools.cache
def log_trust_remote_code(family: str) -> None:
    """Said once per process: vLLM users pass trust_remote_code=True out of habit."""
    logger.info("trust_remote_code=True accepted: cover_vllm implements the %s architecture "
                "itself and never runs code shipped with a checkpoint", family)


def prompt_ids(prompt, vocab_size: int, tokenize) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text, ids, {"prompt_token_ids": ids} or
    {"prompt": text} (TokensPrompt / TextPrompt);
    ValueError / TypeError naming what is wrong."""
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
        prompt = prompt["prompt"]           # a TextPrompt (cover_vllm/inputs.py)
        if not isinstance(prompt, str):
            raise TypeError("a TextPrompt's 'prompt' must be a string")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, tokenize(check_text(prompt, "prompt"))
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise ValueError("a dict prompt needs the key 'prompt_token_ids'")
        prompt = prompt["prompt_token_ids"]
    if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise TypeError("prompt must be a string, a list of token ids, or "
                        "{'prompt_token_ids': [int, ...]}")
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside [0, {vocab_size})")
    return None, list(prompt)


def with_max_tokens(spec: ModelSpec, prompt_len: int, params: SamplingParams) -> SamplingParams:
    """`params` with max_tokens=None (vLLM's "up to the model's length") made the room left
    after the prompt: whole blocks / canvases on block-causal and uniform-state models; 1 when
    there is none, so that check_length names the prompt."""
    if params.max_tokens is not None:
        return params
    kind, limit = spec.attention, spec.max_model_len
    if spec.uniform_state:
        block = spec.default_block_length
        room = (limit - prompt_len) // block * block
    else:
        block = (params.block_length or kind.block_size) if kind.is_block_causal else 1
        room = limit // block * block - prompt_len
    return dataclasses.replace(params, max_tokens=max(1, room))


def check_length(spec: ModelSpec, config: EngineConfig, prompt_len: int,
                 params: SamplingParams) -> None:
    """ValueError naming the field at fault when the canvas exceeds max_model_len: the prompt
    when it leaves no room for a single token, else max_tokens (a uniform-state model's
    canvases are whole: max_tokens rounds up to canvas_length)."""
    if spec.uniform_state:
        return check_canvas_length(spec, prompt_len, params.max_tokens)
    kind, limit = spec.attention, spec.max_model_len
    block = (params.block_length or kind.block_size) if kind.is_block_causal else 1
    room = limit // block * block - prompt_len   # block-causal: canvases end on a block
    whose = "the model's" if config.max_model_len is None else "the engine's"
    if room < 1:
        raise ValueError(f"prompt ({prompt_len} tokens) leaves no room for a generated token "
                         f"within {whose} max length max_model_len={limit}: shorten the prompt")
    if params.max_tokens > room:
        total = -(-(prompt_len + params.max_tokens) // block) * block
        raise ValueError(f"max_tokens ({params.max_tokens}) + prompt ({prompt_len} tokens) "
                         f"needs a {total}-token canvas, beyond {whose} max length "
                         f"max_model_len={limit}: give max_tokens <= {room}")
