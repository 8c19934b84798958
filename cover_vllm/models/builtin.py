"""What a user passes as `model=`: a built-in name (the shipped `cover-tiny` checkpoint,
weightless configs for benchmarks), a local checkpoint directory, or a Hugging Face repo id.

`resolve_model(model, revision, download_dir)` turns it into a config dict and, when weights
exist, the directory holding them; a repo id (`org/name`) is fetched once into the Hugging Face
cache (models/hub.py). `resolve_engine_model(config)` also places the tokenizer (`tokenizer`,
`tokenizer_revision`), and `local_config(config, resolved)` is the config the engine's other
processes (tensor-parallel ranks, data-parallel replicas) get: the resolved local directories in
place of hub ids, so only the driver ever talks to the hub.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cover_vllm.models.hub import TOKENIZER_REPO_FILES, download_snapshot, looks_like_repo_id

if TYPE_CHECKING:
    from cover_vllm.config import EngineConfig

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
    tokenizer_path: Path | None = None   # a separate tokenizer directory (`tokenizer=`)

    @property
    def tokenizer_dir(self) -> Path | None:
        """Where the tokenizer loads from: the `tokenizer` option's directory, else the
        model's (None for a weightless built-in shape)."""
        return self.tokenizer_path if self.tokenizer_path is not None else self.path

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json as a dict ({} when the checkpoint has none)."""
        file = self.path / "generation_config.json" if self.path is not None else None
        if file is None or not file.is_file():
            return {}
        try:
            config = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file} is not a JSON object: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{file} is not a JSON object")
        return config

    def max_new_tokens(self) -> int | None:
        """The generation length the checkpoint declares (`max_new_tokens` in
        generation_config.json, as Hugging Face writes it), or None when it declares none."""
        value = self.generation_config().get("max_new_tokens")
        file = self.path / "generation_config.json" if self.path is not None else None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{file}: max_new_tokens must be a positive int, got {value!r}")
        return value


def resolve_model(model: str | Path, revision: str | None = None,
                  download_dir: str | os.PathLike | None = None) -> ResolvedModel:
    """A built-in name, a local directory with config.json, or a hub repo id (`org/name`,
    fetched at `revision` into `download_dir` or the Hugging Face cache). `revision` and
    `download_dir` matter only for a repo id."""
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
    if _is_hub_id(name):
        path = download_snapshot(name, revision, download_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"hub repo {name!r} has no config.json: not a checkpoint the "
                             "engine can read")
    if (path / "config.json").is_file():
        return ResolvedModel(name, json.loads((path / "config.json").read_text()), path)
    raise FileNotFoundError(
        f"model={name!r} is neither a built-in name ({sorted([*BUILTIN_DIRS, *configs])}), a "
        "local directory with config.json, nor a Hugging Face repo id ('org/name')")


def _is_hub_id(model: str | os.PathLike) -> bool:
    name = str(model)
    return (name not in BUILTIN_DIRS and looks_like_repo_id(name)
            and not Path(name).expanduser().exists())


def resolve_tokenizer_dir(tokenizer: str | os.PathLike, revision: str | None = None,
                          download_dir: str | os.PathLike | None = None) -> Path:
    """The directory of the `tokenizer` option: a local directory, or a hub repo id whose
    tokenizer files are fetched (at `revision`) like a model's."""
    name = str(tokenizer)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if name in BUILTIN_DIRS:
        return BUILTIN_DIRS[name]
    if looks_like_repo_id(name):
        return download_snapshot(name, revision, download_dir, TOKENIZER_REPO_FILES)
    raise FileNotFoundError(f"tokenizer={name!r} is neither a local directory nor a Hugging "
                            "Face repo id ('org/name')")


def resolve_engine_model(config: "EngineConfig") -> ResolvedModel:
    """`config.model` resolved with its revision and download dir, and the tokenizer placed:
    `tokenizer` when given, else the model's own files; `tokenizer_revision` alone means the
    model repo's tokenizer at that revision (as in vLLM)."""
    resolved = resolve_model(config.model, config.revision, config.download_dir)
    source = config.tokenizer
    if source is None and config.tokenizer_revision is not None and _is_hub_id(config.model):
        source = config.model                      # the model's repo, another revision
    if source is None:
        return resolved
    path = resolve_tokenizer_dir(source, config.tokenizer_revision, config.download_dir)
    return replace(resolved, tokenizer_path=path)


def local_config(config: "EngineConfig", resolved: ResolvedModel) -> "EngineConfig":
    """`config` with the model and tokenizer as the local directories `resolved` holds (hub
    ids and revisions dropped): what tensor-parallel ranks and data-parallel replicas get, so
    the download happens once, in the driver."""
    changes: dict[str, Any] = {}
    if resolved.path is not None and _is_hub_id(config.model):
        changes.update(model=str(resolved.path), revision=None)
    if resolved.tokenizer_path is not None:
        changes.update(tokenizer=str(resolved.tokenizer_path), tokenizer_revision=None)
    return config.with_overrides(**changes) if changes else config


def resolve_model_dir(model: str | Path) -> Path:
    """The weights directory of `model`; raises for weightless built-in configs."""
    resolved = resolve_model(model)
    if resolved.path is None:
        raise ValueError(f"built-in config {resolved.name!r} has no weights; "
                         "use load_format='dummy'")
    return resolved.path
