"""Built-in model names: the shipped `cover-tiny` checkpoint and weightless configs for benchmarks.

`resolve_model(name_or_dir)` turns what a user passes as `model=` into a config dict and, when
weights exist, the directory holding them. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUILTIN_DIRS = {"cover-tiny": ASSETS / "cover-tiny"}


def _builtin_configs() -> dict[str, dict[str, Any]]:
    from cover_vllm.models.registry import builtin_shapes  # each family's weightless shapes

    return builtin_shapes()


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    config: dict[str, Any]
    path: Path | None          # None: a weightless built-in config (load_format="dummy" only)

    def max_new_tokens(self) -> int | None:
        """The generation length the checkpoint declares (`max_new_tokens` in
        generation_config.json, as Hugging Face writes it), or None when it declares none."""
        file = self.path / "generation_config.json" if self.path is not None else None
        if file is None or not file.is_file():
            return None
        try:
            value = json.loads(file.read_text()).get("max_new_tokens")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"{file} is not a JSON object: {exc}") from None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{file}: max_new_tokens must be a positive int, got {value!r}")
        return value


def resolve_model(model: str | Path) -> ResolvedModel:
    name = str(model)
    if name in BUILTIN_DIRS:
        path = BUILTIN_DIRS[name]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"built-in model {name!r} is not installed at {path}")
        return ResolvedModel(name, json.loads((path / "config.json").read_text()), path)
    configs = _builtin_configs()
    if name in configs:
        return ResolvedModel(name, dict(configs[name]), None)
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return ResolvedModel(name, json.loads((path / "config.json").read_text()), path)
    raise FileNotFoundError(
        f"model={name!r} is neither a built-in name ({sorted([*BUILTIN_DIRS, *configs])}) nor a "
        "local directory with config.json (nothing is downloaded: pass a local checkpoint dir)")


def resolve_model_dir(model: str | Path) -> Path:
    """The weights directory of `model`; raises for weightless built-in configs."""
    resolved = resolve_model(model)
    if resolved.path is None:
        raise ValueError(f"built-in config {resolved.name!r} has no weights; "
                         "use load_format='dummy'")
    return resolved.path
