"""Text inputs checked as Unicode the tokenizer can take: one rule for every prompt, message
content and tokenizer call, offline (ValueError naming the field) and on the server (a 400
naming `prompt` / `messages.N.content`).

A Python str may hold lone UTF-16 surrogates (JSON's "\\ud800", or `"\\ud800"` in Python) that
no UTF-8 text can carry; the Rust tokenizers then fail with a TypeError deep inside. They are
refused here, with the position. NUL and other control characters are valid Unicode and pass.
"""

from __future__ import annotations

from typing import Any


def check_text(text: Any, field: str = "prompt") -> str:
    """`text` when it is a str that encodes as UTF-8; ValueError naming `field` otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(f"{field} is not valid Unicode text: a lone UTF-16 surrogate "
                         f"U+{ord(bad):04X} at character {exc.start} (surrogates come only "
                         "in pairs, as one character outside the BMP)") from None
    return text
