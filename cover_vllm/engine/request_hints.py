"""RequestHints: log lines an engine says once, when a request is accepted but will run slower
than it could (the answer is the same either way).

* `kv_cache="none"` with a prompt of LONG_PROMPT_TOKENS or more: every forward recomputes the
  whole prompt; `prefix` / `dual` reuse its K/V (llada-50m, a 2,000-token prompt, 64 tokens:
  319 s with none, 27 s prefix, 22 s dual).
* A COVER request on an engine that planned no scratch slots (its default decoding verifies no
  seeds, worker/memory.py `wants_scratch`, or its budget is too small for them): its seeds are
  written the slow way (attention/layout.py), the same tokens.
"""

from __future__ import annotations

from cover_vllm.logger import init_logger

logger = init_logger(__name__)

LONG_PROMPT_TOKENS = 1000


class RequestHints:
    """One engine's hints, each said at most once."""

    def __init__(self, scratch_slots: int, paged: bool = True):
        self.scratch_slots = scratch_slots   # the cache's scratch (worker/memory.py MemoryPlan)
        self.paged = paged                   # False: the model keeps its own pools (rings)
        self.said: set[str] = set()

    def check(self, strategy, kv_cache: str, prompt_len: int) -> None:
        """Log what applies to a request decoded by `strategy` with cache mode `kv_cache`."""
        if kv_cache == "none" and prompt_len >= LONG_PROMPT_TOKENS and self.paged:
            self._once("long_prompt", "a %d-token prompt with kv_cache='none' is recomputed in "
                       "every forward; kv_cache='prefix' or 'dual' (per request, or the engine's "
                       "--kv-cache) reuse its K/V and are many times faster on long prompts",
                       prompt_len)
        if getattr(strategy, "verifies_seeds", False) and self.paged and not self.scratch_slots:
            self._once("no_scratch", "decoding=%r: the KV cache has no scratch slots (the "
                       "engine's default decoding verifies no seeds, or 1/8 of its KV budget "
                       "holds fewer than 16), so its seeds' K/V are written the slow way (same "
                       "tokens); start the engine with decoding=%r for the fast path",
                       strategy.name, strategy.name)

    def _once(self, key: str, message: str, *args) -> None:
        if key not in self.said:
            self.said.add(key)
            logger.info(message, *args)
