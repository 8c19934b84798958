"""Content keys of automatic prefix caching for block-causal models (vLLM's
`enable_prefix_caching`).

On a block-causal canvas (blocks of B aligned to position 0) the K/V of a position in block b
depend only on the tokens of blocks <= b, so a page lying inside the prompt's *full* blocks
holds the same K/V in every request whose prompt starts with the same tokens: its key hashes B,
the page index and every token its K/V depend on (up to the end of the block holding the page's
last position). Pages are keyed by a chain hash, so a key costs one page of tokens, not the whole
prefix. Full-attention models never share: their prompt K/V depend on the whole canvas.
"""

from __future__ import annotations

import hashlib

import torch


def page_keys(tokens: torch.Tensor, prompt_len: int, block: int, page_size: int) -> list[bytes]:
    """Keys of the pages inside the prompt's full blocks (pages [0, n) with n * page_size <=
    floor(prompt_len / B) * B), in page order. `tokens` [>= prompt_len] is the canvas."""
    full = prompt_len // block * block
    ids = tokens[:full].to(torch.int64).numpy()
    chain = hashlib.sha256(f"block={block};page={page_size}".encode()).digest()
    keys = []
    for page in range(full // page_size):
        start, end = page * page_size, (page + 1) * page_size
        chain = hashlib.sha256(chain + ids[start:end].tobytes()).digest()
        depends = -(-end // block) * block          # the end of the block of the last position
        keys.append(hashlib.sha256(chain + ids[end:depends].tobytes()).digest())
    return keys
