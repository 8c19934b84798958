"""The `cover_vllm` logger: INFO lines (e.g. the engine's memory plan) to stderr, once.

`init_logger(__name__)` returns a child of the `cover_vllm` logger, which gets one stderr
handler the first time (unless the environment sets COVER_VLLM_CONFIGURE_LOGGING=0, for
applications that configure logging themselves). Records still propagate to the root logger.
"""

from __future__ import annotations

import logging
import os

ROOT = "cover_vllm"


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger(ROOT)
    if os.environ.get("COVER_VLLM_CONFIGURE_LOGGING", "1") != "0" and not any(
            getattr(h, "_cover_vllm", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler._cover_vllm = True
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    return logging.getLogger(name)
