"""Decoding strategies behind one registry: look a name up, build its typed params."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from cover_vllm.strategies.base import (BlockState, Decision, StepBatch, Strategy,
                                        StrategyParams)

# name -> (module, class); imported on first use.
STRATEGIES = {
    "low_confidence": ("cover_vllm.strategies.llada", "LowConfidence"),
    "random": ("cover_vllm.strategies.llada", "RandomRemasking"),
    "threshold": ("cover_vllm.strategies.fastdllm", "Threshold"),
    "cover": ("cover_vllm.strategies.cover", "Cover"),
    "factor": ("cover_vllm.strategies.fastdllm", "Factor"),
    "maskgit_plus": ("cover_vllm.strategies.dream", "MaskGitPlus"),
    "topk_margin": ("cover_vllm.strategies.dream", "TopKMargin"),
    "entropy": ("cover_vllm.strategies.dream", "Entropy"),
    "saber": ("cover_vllm.strategies.saber", "Saber"),
    "wino": ("cover_vllm.strategies.wino", "Wino"),
    "asrd": ("cover_vllm.strategies.asrd", "ASRD"),
    "llada2": ("cover_vllm.strategies.llada2", "LLaDA2"),
    "llada2_edit": ("cover_vllm.strategies.llada2", "LLaDA2Edit"),
    "sdar": ("cover_vllm.strategies.sdar", "SDAR"),
}


def strategy_class(name: str) -> type[Strategy]:
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"decoding={name!r} is not a known strategy; valid: {sorted(STRATEGIES)}")
    module, cls = STRATEGIES[name]
    return getattr(importlib.import_module(module), cls)


def make_params(name: str, given: Any) -> StrategyParams:
    """Typed params for strategy `name` from None, a dict (server JSON) or the dataclass itself."""
    cls = strategy_class(name).params_cls
    if given is None:
        return cls()
    if isinstance(given, cls):
        return given
    if not isinstance(given, dict):
        raise TypeError(f"decoding_params for {name!r} must be a dict or {cls.__name__}, "
                        f"got {type(given).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ValueError(f"decoding_params {unknown} not valid for {name!r}; "
                         f"allowed: {sorted(fields)}")
    for key, value in given.items():
        if value is not None and not isinstance(value, (int, float, str, bool)):
            raise TypeError(f"decoding_params.{key} must be a number, string or bool")
        if isinstance(value, bool) != ("bool" in str(fields[key].type)) and value is not None:
            raise TypeError(f"decoding_params.{key} has the wrong type ({type(value).__name__})")
    return cls(**given)


__all__ = ["BlockState", "Decision", "STRATEGIES", "StepBatch", "Strategy", "StrategyParams",
           "make_params", "strategy_class"]
