"""Decoding strategies behind one registry: look a name up, build its typed params.

`STRATEGIES` are the masked-diffusion decoders (strategies/base.py `Strategy`: commit tokens into
[MASK] slots); `CANVAS_DECODERS` the uniform-state ones (strategies/canvas.py `CanvasDecoder`:
a model without [MASK] re-draws whole canvases). `strategy_class` finds either.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from typing import Any

from cover_vllm.strategies.base import (BlockState, CanvasRows, Decision, StepBatch, Strategy,
                                        StrategyParams, decide_now)

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
CANVAS_DECODERS = {
    "diffusion_gemma": ("cover_vllm.strategies.diffusion_gemma", "DiffusionGemmaDecoder"),
}
# Nemotron-Labs-Diffusion's own decodings, run by engine/nemotron_runner.py (not Strategies)
CAUSAL_DECODERS = {
    "nemotron": ("cover_vllm.strategies.nemotron", "Nemotron"),
    "ar": ("cover_vllm.strategies.nemotron", "AR"),
    "linear_spec": ("cover_vllm.strategies.nemotron", "LinearSpec"),
}
DECODERS = {**STRATEGIES, **CANVAS_DECODERS, **CAUSAL_DECODERS}     # every `decoding` name


def strategy_class(name: str) -> type:
    """The Strategy (masked) or CanvasDecoder (uniform-state) class named `name`."""
    if not isinstance(name, str) or name not in DECODERS:
        raise ValueError(f"decoding={name!r} is not a known strategy; valid: {sorted(DECODERS)}")
    module, cls = DECODERS[name]
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
    hints = typing.get_type_hints(cls)
    for key, value in given.items():
        _check_type(f"decoding_params.{key}", value, hints[key], name)
    return cls(**given)


_TYPE_NAMES = {bool: "a bool", int: "an integer", float: "a number", str: "a string",
               type(None): "null"}


def _check_type(what: str, value: Any, hint: Any, strategy: str) -> None:
    """ValueError naming `what` and the expected type unless `value` fits `hint` (a float field
    takes an int; bools are never numbers)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else (hint,)
    for option in options:
        if typing.get_origin(option) is typing.Literal:
            if value in typing.get_args(option):
                return
        elif option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        elif isinstance(value, option) and (option is bool or not isinstance(value, bool)):
            return
    expected = " or ".join(
        " | ".join(map(repr, typing.get_args(o))) if typing.get_origin(o) is typing.Literal
        else _TYPE_NAMES.get(o, getattr(o, "__name__", str(o))) for o in options)
    raise ValueError(f"{what} must be {expected} (decoding={strategy!r}), got "
                     f"{type(value).__name__} {value!r}")


__all__ = ["BlockState", "CANVAS_DECODERS", "CAUSAL_DECODERS", "CanvasRows", "DECODERS", "Decision", "STRATEGIES", "StepBatch", "Strategy",
           "StrategyParams", "decide_now", "make_params", "strategy_class"]
