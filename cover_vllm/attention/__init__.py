"""Attention backends behind one registry: `sdpa` (fast) and `reference` (slow oracle)."""

from __future__ import annotations

from cover_vllm.attention.base import AttentionBackend, AttentionMetadata, SeqLayout
from cover_vllm.attention.layout import build_metadata

BACKENDS = {
    "sdpa": ("cover_vllm.attention.sdpa", "SDPABackend"),
    "reference": ("cover_vllm.attention.reference", "ReferenceBackend"),
}


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}; choose one of {sorted(BACKENDS)}")
    import importlib

    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


__all__ = ["AttentionBackend", "AttentionMetadata", "SeqLayout", "build_metadata", "get_backend"]
