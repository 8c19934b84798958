"""Hugging Face Hub repo ids as models: a snapshot of only the files the engine reads.

`download_snapshot(repo_id, revision, cache_dir)` runs `huggingface_hub.snapshot_download`
restricted to `MODEL_FILES` (config, generation config, safetensors and their index, tokenizer
and chat-template files: no `.bin` weights, no README, no checkpoint code), into the usual cache
(HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) or `cache_dir` (vLLM's
`download_dir`), and returns the snapshot directory. The first call downloads (one progress bar
over the files, byte bars on a terminal); a later one asks the hub for the revision's commit and
finds every file already cached. huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE
once, at import; they are read here at every call, so a variable set after `import cover_vllm`
counts. HF_TOKEN is huggingface_hub's to read (it does so per request).

With HF_HUB_OFFLINE=1 nothing is requested: the revision comes from the cache, or a ValueError
names the repo and the variable. Every hub failure (no such repo or revision, the hub out of
reach with nothing cached) is a ValueError naming the repo id.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cover_vllm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors",
               "*.safetensors.index.json", *TOKENIZER_FILES)
# AutoTokenizer may read config.json to pick the tokenizer class
TOKENIZER_REPO_FILES = ("config.json", *TOKENIZER_FILES)

# "org/name" as the hub spells it: word characters, '.' and '-', neither part starting with
# '.' or '-' (so "./dir" and "../dir" stay paths)
_REPO_ID = re.compile(r"^[A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*$")
_TRUE = {"1", "on", "yes", "true"}


def looks_like_repo_id(name: str) -> bool:
    """True for `org/name` (one slash, hub characters, no `..`)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and len(name) <= 96


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """The cache huggingface_hub uses, from the environment as it is now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache")), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def download_snapshot(repo_id: str, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None,
                      patterns: tuple[str, ...] = MODEL_FILES) -> Path:
    """The local snapshot of `repo_id` at `revision` (default: the repo's main branch) holding
    the files matching `patterns`; downloads what the cache lacks unless HF_HUB_OFFLINE."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError,  # 0.23+ exports them
                                       LocalEntryNotFoundError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    cache = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    offline, endpoint = hub_offline(), hub_endpoint()
    what = repo_id if revision is None else f"{repo_id} (revision {revision!r})"
    if not offline:
        logger.info("model %s from %s (cache %s; only config, safetensors and tokenizer "
                    "files)", what, endpoint, cache)
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(cache),
                                 endpoint=endpoint, allow_patterns=list(patterns),
                                 local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        if offline:
            raise ValueError(
                f"model {what} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 "
                "forbids downloading it: unset HF_HUB_OFFLINE to download it once, or pass a "
                "local checkpoint directory") from None
        raise ValueError(f"cannot download {what} from {endpoint} ({_cause(exc)}), and it is "
                         f"not in the cache {cache}; check the network or HF_ENDPOINT, or set "
                         "HF_HUB_OFFLINE=1 to use the cache only") from None
    except RevisionNotFoundError:
        raise ValueError(f"revision={revision!r} does not exist in {repo_id} on {endpoint}; "
                         "give a branch, tag or commit of that repo") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise ValueError(f"model={repo_id!r} is neither a local directory nor a repo on "
                         f"{endpoint} this token can read (a private or gated repo needs "
                         "HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise ValueError(f"downloading {what} from {endpoint} failed: {exc}") from None
    return Path(path)


def _cause(exc: BaseException) -> str:
    """The innermost reason of a hub error chain (e.g. the refused connection), one line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = str(exc).splitlines()
    return type(exc).__name__ + (f": {lines[0][:160]}" if lines else "")
