"""Tokenizer loading from a local checkpoint directory and chat-template encoding.

Owns only text <-> ids at the edges of the engine; model facts (mask, EOS ids) live in ModelSpec.
Nothing is downloaded here (a hub repo id was fetched by models/hub.py before): `transformers`
is asked for local files only.

A checkpoint whose tokenizer is a plain `PreTrainedTokenizerFast` over tokenizer.json (no custom
class, no decode clean-up; cover-tiny, and what examples/train_cover_tiny.py writes) loads as a
`LocalTokenizer` on the `tokenizers` library and jinja2 directly: importing `transformers` alone
takes 1.5-4 s here, longer than loading the whole model. It gives the same ids and text as the
Hugging Face class for everything the engine calls (tests/test_model_loading.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from cover_vllm.text_input import check_text

if TYPE_CHECKING:
    from cover_vllm.chat import ChatTemplateOptions

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


_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


def _token_text(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class LocalTokenizer:
    """tokenizer.json + tokenizer_config.json without `transformers` (see the module docstring).

    Implements the part of the Hugging Face tokenizer API the engine, server and tasks use:
    `encode`, `decode`, `__call__`, `apply_chat_template`, `convert_tokens_to_ids`, `get_vocab`,
    `backend_tokenizer`, the special token strings and ids, `chat_template`, `name_or_path`.
    """

    def __init__(self, path: Path, config: dict):
        from tokenizers import Tokenizer

        self.name_or_path = str(path)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        template = path / "chat_template.jinja"
        self.chat_template = config.get("chat_template") or (
            template.read_text() if template.is_file() else None)
        for attr in _SPECIAL_ATTRS:
            setattr(self, attr, _token_text(config.get(attr)))
        self.additional_special_tokens = [_token_text(t) for t in
                                          config.get("additional_special_tokens", [])]
        names = [getattr(self, a) for a in _SPECIAL_ATTRS] + self.additional_special_tokens
        self.all_special_ids = sorted({i for i in map(self._tok.token_to_id, filter(None, names))
                                       if i is not None})
        self._template = None

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_token_id") and name[:-3] in _SPECIAL_ATTRS:
            token = self.__dict__.get(name[:-3])
            return None if token is None else self._tok.token_to_id(token)
        raise AttributeError(name)

    @property
    def backend_tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` underneath (Hugging Face's name for it)."""
        return self._tok

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(check_text(text, "text"),
                                add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False,
                            chat_template: str | None = None,
                            **kwargs: Any) -> str | list[int] | dict[str, list[int]]:
        """Renders the template (`chat_template` if given, else the tokenizer's) as Hugging
        Face does (sandboxed jinja2, trim/lstrip blocks, special tokens and `raise_exception` in
        scope); ids without added special tokens, as a list, or with `return_dict` as
        `__call__` gives them (transformers 5's default: pass return_dict=False there for the
        list)."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError(f"tokenizer {self.name_or_path!r} has no chat template")
        if self._template is None or self._template[0] != source:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = (source, env.from_string(source))
        specials = {a: getattr(self, a) for a in _SPECIAL_ATTRS}
        text = self._template[1].render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     **specials, **kwargs)
        if not tokenize:
            return text
        return self(text, add_special_tokens=False) if return_dict else self.encode(
            text, add_special_tokens=False)


def _plain_fast_config(path: Path) -> dict | None:
    """tokenizer_config.json when it describes a plain PreTrainedTokenizerFast that
    `LocalTokenizer` reproduces exactly, else None."""
    config_path = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    plain = (config.get("tokenizer_class") == "PreTrainedTokenizerFast"
             and "auto_map" not in config and config.get("clean_up_tokenization_spaces") is False
             and not config.get("add_bos_token") and not config.get("add_eos_token"))
    return config if plain else None


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """A tokenizer from `model_dir` (local files only): a `LocalTokenizer` for plain fast
    tokenizers, else the Hugging Face class.

    Checkpoints whose tokenizer_config.json names a custom class (Dream's `DreamTokenizer`) load
    through the generic fast tokenizer from tokenizer.json unless `trust_remote_code` is set.
    """
    path = Path(model_dir).expanduser()
    if not has_tokenizer(path):
        raise _missing_files_error(path)
    config = _plain_fast_config(path)
    if config is not None:
        return LocalTokenizer(path, config)
    return hf_tokenizer(path, trust_remote_code)


def hf_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    """The Hugging Face class for the tokenizer in `path` (local files only): what
    `load_tokenizer` returns when `LocalTokenizer` does not apply."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs = {"local_files_only": True, **_extra_special_tokens(path)}
    if (path / "tokenizer.json").is_file() and not trust_remote_code and _names_custom_class(path):
        # tokenizer.json is self-contained; the custom class is not executed.
        return PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, **kwargs)


def _extra_special_tokens(path: Path) -> dict[str, list[str]]:
    """tokenizer_config.json's `additional_special_tokens` under transformers 5's name.

    transformers 5 renamed the key to `extra_special_tokens`, and 5.0 through 5.17 (5.18 fixed
    it) drop the old one when the file also holds the new one, which transformers 4.5x writes
    as `{}`: the tokens (cover-tiny's chat roles) stop being special, so they leave
    `all_special_ids` (structured outputs blank those) and `skip_special_tokens` keeps them."""
    import transformers

    config_path = path / "tokenizer_config.json"
    if int(transformers.__version__.split(".")[0]) < 5 or not config_path.is_file():
        return {}
    config = json.loads(config_path.read_text())
    tokens = config.get("additional_special_tokens")
    if not tokens or config.get("extra_special_tokens"):
        return {}
    return {"extra_special_tokens": [_token_text(t) for t in tokens]}


def apply_chat_template(tokenizer: Any, messages: Sequence[dict[str, str]],
                        options: ChatTemplateOptions | None = None) -> list[int]:
    """Prompt ids for `messages` ([{"role": ..., "content": ...}, ...]) under `options`
    (cover_vllm/chat.py; default: the tokenizer's template followed by the assistant turn's
    opening, add_generation_prompt=True)."""
    from cover_vllm.chat import ChatTemplateOptions

    options = options or ChatTemplateOptions()
    if not (options.chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat "
                         "template (tokenizer_config.json 'chat_template' or chat_template.jinja);"
                         " pass prompt token ids or plain text instead, or give chat_template")
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m
                               for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    kwargs = dict(options.chat_template_kwargs or {})
    if options.chat_template is not None:
        kwargs["chat_template"] = options.chat_template
    if options.continue_final_message:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=False,
                                             tokenize=False, **kwargs)
        return tokenizer.encode(_up_to_final_message(text, messages[-1]["content"]),
                                add_special_tokens=False)
    ids = tokenizer.apply_chat_template(list(messages),
                                        add_generation_prompt=options.add_generation_prompt,
                                        tokenize=True, **kwargs)
    if hasattr(ids, "keys"):   # transformers 5 returns a BatchEncoding by default (4.x: ids)
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _up_to_final_message(text: str, final: str) -> str:
    """The rendered conversation cut right after the last message's content (what
    continue_final_message continues), whitespace around the content ignored."""
    for content in (final, final.strip()):
        at = text.rfind(content) if content else -1
        if at >= 0:
            return text[: at + len(content)]
    raise ValueError("continue_final_message: the last message's content does not appear in "
                     "the rendered chat template, so there is no point to continue from")
