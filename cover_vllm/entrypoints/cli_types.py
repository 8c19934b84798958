"""argparse value types shared by every `cover-vllm` subcommand (usage errors name the flag)."""

from __future__ import annotations

import argparse
import json

from cover_vllm.config import DTYPES


def csv(value: str) -> tuple[str, ...]:
    """'a, b' -> ('a', 'b'); an empty list is a usage error."""
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def dtypes(value: str) -> tuple[str, ...]:
    """'float32,bfloat16' -> ('float32', 'bfloat16'), each one of config.DTYPES."""
    names = csv(value)
    bad = [n for n in names if n not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r}; choose from {', '.join(DTYPES)}")
    return names


def ints(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in csv(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from exc


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def positive_ints(value: str) -> tuple[int, ...]:
    return tuple(positive_int(v) for v in csv(value))


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {x}")
    return x


def json_obj(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj
