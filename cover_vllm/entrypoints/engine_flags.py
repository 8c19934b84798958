"""Command-line flags generated from EngineConfig's fields: each engine option is defined once.

`add_engine_flags(parser)` adds `--page-size`, `--dtype`, ... with the field's default, choices
and help; `engine_kwargs(args)` reads them back as EngineConfig keywords. A subcommand that
runs several engines (eval, bench) adds only the flags its spec carries (`names`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable

from cover_vllm.config import EngineConfig
from cover_vllm.entrypoints.cli_types import positive_float, positive_int

_PARSERS = {"str": str, "int": int, "positive_int": positive_int, "float": float,
            "positive_float": positive_float}


def engine_options() -> list[dataclasses.Field]:
    """The EngineConfig fields that are options (every field with a help text)."""
    return [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


def flag_names(option: dataclasses.Field) -> tuple[str, ...]:
    return option.metadata["flags"] or ("--" + option.name.replace("_", "-"),)


def add_engine_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None,
                     **defaults: Any) -> None:
    """One flag per engine option (only `names` when given); `defaults` overrides a field's
    default for this subcommand. The flag's dest is the field name."""
    wanted = None if names is None else set(names)
    options = [o for o in engine_options() if wanted is None or o.name in wanted]
    unknown = (wanted or set()) - {o.name for o in options}
    assert not unknown, f"not engine options: {sorted(unknown)}"
    for option in options:
        meta = option.metadata
        if meta["kind"] == "bool":          # --flag / --no-flag (default: the field's)
            parser.add_argument(*flag_names(option), dest=option.name,
                                action=argparse.BooleanOptionalAction,
                                default=defaults.get(option.name, option.default),
                                help=meta["help"])
            continue
        parser.add_argument(*flag_names(option), dest=option.name,
                            type=_PARSERS[meta["kind"]], choices=meta["choices"],
                            default=defaults.get(option.name, option.default), help=meta["help"])


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options present in `args`, as EngineConfig / LLM keywords."""
    return {o.name: getattr(args, o.name) for o in engine_options() if hasattr(args, o.name)}
