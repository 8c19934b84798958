"""Tokenizer loading from a local checkpoint directory and chat-template encoding.

Owns only text <-> ids at the edges of the engine; model facts (mask, EOS ids) live in ModelSpec.
Nothing is downloaded: `transformers` is asked for local files only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

TOKENIZER_FILES = ("tokenizer.json",)
BPE_FILES = ("vocab.json", "merges.txt")


def has_tokenizer(model_dir: str | Path) -> bool:
    """True when `model_dir` holds tokenizer.json, or both vocab.json and merges.txt."""
    path = Path(model_dir).expanduser()
    return (path / "tokenizer.json").is_file() or all((path / n).is_file() for n in BPE_FILES)


def _missing_files_error(path: Path) -> FileNotFoundError:
    present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    missing = [n for n in (*TOKENIZER_FILES, *BPE_FILES) if n not in present]
    return FileNotFoundError(
        f"no tokenizer in {str(path)!r}: it needs 'tokenizer.json', or both 'vocab.json' and "
        f"'merges.txt' (missing: {missing}; found: {present or 'nothing'})")


def _names_custom_class(path: Path) -> bool:
    """True when tokenizer_config.json points at tokenizer code shipped with the checkpoint."""
    config_path = path / "tokenizer_config.json"
    if not config_path.is_file():
        return False
    return "AutoTokenizer" in json.loads(config_path.read_text()).get("auto_map", {})


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer from `model_dir` (local files only).

    Checkpoints whose tokenizer_config.json names a custom class (Dream's `DreamTokenizer`) load
    through the generic fast tokenizer from tokenizer.json unless `trust_remote_code` is set.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(model_dir).expanduser()
    if not has_tokenizer(path):
        raise _missing_files_error(path)
    if (path / "tokenizer.json").is_file() and not trust_remote_code and _names_custom_class(path):
        # tokenizer.json is self-contained; the custom class is not executed.
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                         trust_remote_code=trust_remote_code)


def apply_chat_template(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Prompt ids for `messages` ([{"role": ..., "content": ...}, ...]) followed by the assistant
    turn's opening (add_generation_prompt=True)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat "
                         "template (tokenizer_config.json 'chat_template' or chat_template.jinja);"
                         " pass prompt token ids or plain text instead")
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m
                               for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):   # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
