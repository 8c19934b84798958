"""What an Engine settles once, at start, and per request: whether prompt blocks are shared
(prefix caching), its tokenizer, the trust_remote_code log line, and each request's random
stream (on the device where decisions are made)."""

from __future__ import annotations

import functools

import torch

from cover_vllm.config import EngineConfig
from cover_vllm.logger import init_logger
from cover_vllm.models.spec import ModelSpec

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
