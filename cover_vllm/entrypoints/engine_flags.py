"""Command-line flags generated from EngineConfig's fields: each engine option is defined once.

`add_engine_flags(parser)` adds `--page-size`, `--dtype`, ... with the field's default, choices
and help; `engine_kwargs(args)` reads them back as EngineConfig keywords. A subcommand that
runs several engines (eval, bench) adds only the flags its spec carries (`names`).

A command that takes every option (generate, serve) also accepts vLLM's flags that mean nothing
here (`add_vllm_only_flags`: `--swap-space 4`, `--enable-lora`; hidden from --help,
vllm_args.py): given, they reach EngineConfig.from_options, which accepts a value asking for
what the engine does anyway and refuses any other with the reason, instead of argparse's bare
"unrecognized arguments".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from typing import Any, Iterable

from cover_vllm.config import EngineConfig
from cover_vllm.vllm_args import VLLM_ONLY
from cover_vllm.entrypoints.cli_types import positive_float, positive_int

MODEL_HELP = ("built-in name (cover-tiny, llada-50m, ...), local checkpoint directory, or "
              "Hugging Face repo id org/name (downloaded once into the Hugging Face cache; "
              "HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE apply)")
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


def _value(text: str) -> Any:
    """A vLLM-only flag's value: JSON when it parses (4, 0.5, null, {...}), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class _VllmOnly(argparse.Action):
    """Collects a vLLM-only flag into `args.vllm_only` ({name: value}); a switch (nargs=0)
    stores its `const` (True, or False for the --no- form)."""

    def __init__(self, *args: Any, name: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.name = name

    def __call__(self, parser, namespace, values, option_string=None):
        given = dict(getattr(namespace, self.dest, None) or {})
        given[self.name] = self.const if self.nargs == 0 else values
        setattr(namespace, self.dest, given)


def add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that mean nothing here (vllm_args.py), hidden from --help, for a command
    that takes every engine option; a flag the command already has is left alone. Call it
    after the command's own flags."""
    for name, entry in VLLM_ONLY.items():
        flag = "--" + name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        common = dict(dest="vllm_only", default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                      action=functools.partial(_VllmOnly, name=name))
        if entry.switch:
            parser.add_argument(flag, nargs=0, const=True, **common)
            parser.add_argument("--no-" + flag[2:], nargs=0, const=False, **common)
        else:
            parser.add_argument(flag, type=_value, **common)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options present in `args`, as EngineConfig / LLM keywords."""
    options = {o.name: getattr(args, o.name) for o in engine_options() if hasattr(args, o.name)}
    return {**options, **getattr(args, "vllm_only", {})}
