"""The KV cache of Nemotron-Labs-Diffusion's decodings and their batched forward: every running
request owns a slot of a per-layer [slots, Hkv, capacity, d] buffer and a length; one forward
runs a piece of tokens for each of several requests, each piece in its own attention mode.

A piece (`Piece`) is a request's new tokens at positions length + index, in one of the model's
two modes (models/nemotron.py): `causal=False` (diffusion: the piece sees every cached key and
all of itself) or `causal=True` (causal inside the piece), and `write=True` stores its K/V at
length + index (the length then grows by the piece). A request's length can be cut back
(`truncate`, self-speculation's crop): the slots past it are simply overwritten later.

Pieces of different lengths are padded to the longest (padded queries see only themselves and
are dropped; padded keys are hidden), so every request of a step shares one GEMM per weight.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from cover_vllm.layers.base import kv_halves


@dataclass
class Piece:
    """One request's part of a batched forward."""

    slot: int                      # the request's cache slot
    tokens: list[int]              # new tokens, at positions length + index
    causal: bool                   # causal inside the piece (else bidirectional)
    write: bool                    # store its K/V (and advance the request's length)
    logits_rows: list[int]         # which of its rows' logits to return
    adapter: bool = False          # run the draft adapter (LoRA) on these rows


class SlotCache:
    """Standalone storage: per-layer K and V [slots * capacity, Hkv, d] (slot s holds
    positions at s * capacity + p) with a length per slot; grows on demand. The engine's runner
    uses `PagedSlots` instead (the engine's own pool); tests and tools use this one."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.shape = (num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lengths: dict[int, int] = {}
        self.free: list[int] = []
        self.num_slots = self.capacity = 0

    def allocate(self, capacity: int) -> int:
        """A free slot whose rows hold at least `capacity` positions (length 0)."""
        if capacity > self.capacity or not self.free:
            self._grow(max(capacity, self.capacity), self.num_slots + (not self.free))
        slot = self.free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.free.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of `slot` (self-speculation's crop)."""
        assert 0 <= length <= self.lengths[slot]
        self.lengths[slot] = length

    def table(self, slot: int) -> torch.Tensor:
        """[capacity] flat index of each position of `slot`."""
        return slot * self.capacity + torch.arange(self.capacity, device=self.device)

    def _grow(self, capacity: int, slots: int) -> None:
        old, old_cap = self.num_slots, self.capacity
        for layers in (self.k, self.v):
            for i in range(self.num_layers):
                new = torch.zeros(slots * capacity, *self.shape, dtype=self.dtype,
                                  device=self.device)
                if i < len(layers):
                    new.view(slots, capacity, *self.shape)[:old, :old_cap] = \
                        layers[i].view(old, old_cap, *self.shape)
                    layers[i] = new
                else:
                    layers.append(new)
        self.free += list(range(slots - 1, old - 1, -1))
        self.lengths.update({s: 0 for s in range(old, slots)})
        self.num_slots, self.capacity = slots, capacity


class PagedSlots:
    """The runner's storage: pages of the engine's own paged pool (the engine's KVCache and
    PagePool), so these requests and the engine's share one KV budget and admission is by free
    pages. A slot is a request's pages; position p lives at cache slot
    pages[p // page_size] * page_size + p % page_size."""

    def __init__(self, cache, pool, page_size: int):
        self.k, self.v = cache.k, cache.v          # per layer [slots, Hkv, d] (views)
        self.pool, self.page_size = pool, page_size
        self.device = self.k[0].device
        self.lengths: dict[int, int] = {}
        self.cached: dict[int, int] = {}            # positions found in the prefix cache
        self.pages: dict[int, list[int]] = {}
        self.tables: dict[int, torch.Tensor] = {}
        self._next = 0

    def pages_for(self, capacity: int) -> int:
        return -(-capacity // self.page_size)

    def allocate(self, capacity: int, keys: list[bytes] = ()) -> int | None:
        """A slot of at least `capacity` positions, or None while the pool lacks the pages.
        `keys`: content keys of its first pages (`causal_page_keys`); the longest run the pool
        holds is shared (`cached[slot]` positions whose K/V are already there)."""
        hits = self.pool.lookup(list(keys)) if keys else []
        fresh = self.pool.allocate(self.pages_for(capacity) - len(hits))
        if fresh is None:
            self.pool.free(hits)
            return None
        pages = hits + fresh
        slot, self._next = self._next, self._next + 1
        self.cached[slot] = len(hits) * self.page_size
        pos = torch.arange(len(pages) * self.page_size)
        base = torch.tensor(pages, dtype=torch.long)[pos // self.page_size] * self.page_size
        self.tables[slot] = (base + pos % self.page_size).to(self.device)
        self.pages[slot], self.lengths[slot] = pages, 0
        return slot

    def release(self, slot: int) -> None:
        self.pool.free(self.pages.pop(slot))
        del self.tables[slot], self.lengths[slot], self.cached[slot]

    def index(self, slot: int, keys: list[bytes]) -> None:
        """Record that `slot`'s first len(keys) pages hold the K/V those keys name."""
        for page, key in zip(self.pages[slot], keys):
            self.pool.index(page, key)


    def truncate(self, slot: int, length: int) -> None:
        assert 0 <= length <= self.lengths[slot]
        self.lengths[slot] = length

    def table(self, slot: int) -> torch.Tensor:
        return self.tables[slot]


def causal_page_keys(prompt: list[int], page_size: int) -> list[bytes]:
    """Content keys of a causally prefilled prompt's full pages, leaving its last token out
    (it is always run: its logit is needed). A causal K/V depends on the tokens up to it only,
    so page i's key chains the tokens of pages 0..i; the namespace keeps them apart from the
    block-causal keys (scheduler/prefix_cache.py), whose K/V are computed differently."""
    ids = torch.tensor(prompt[:len(prompt) - 1], dtype=torch.int64).numpy()
    chain = hashlib.sha256(f"causal;page={page_size}".encode()).digest()
    keys = []
    for page in range(len(ids) // page_size):
        chain = hashlib.sha256(chain + ids[page * page_size:(page + 1) * page_size]
                               .tobytes()).digest()
        keys.append(chain)
    return keys


class PieceAttention:
    """The AttentionFn of one batched forward over `pieces` (see the module docstring)."""

    def __init__(self, cache: SlotCache, pieces: list[Piece]):
        dev = cache.device
        self.cache, self.pieces = cache, pieces
        self.n = max(len(p.tokens) for p in pieces)                  # padded piece length
        lens = [cache.lengths[p.slot] for p in pieces]
        self.c = max(lens)                                            # cached keys read
        b, n, c = len(pieces), self.n, self.c
        # [b, c] flat cache index of each piece's cached positions (0 past its table: hidden)
        self.read_index = torch.zeros(b, c, dtype=torch.long, device=dev)
        for i, p in enumerate(pieces):
            table = cache.table(p.slot)[:c]
            self.read_index[i, :table.numel()] = table
        sizes = torch.tensor([len(p.tokens) for p in pieces], device=dev)
        cached = torch.arange(c, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
        q_idx = torch.arange(n, device=dev)
        new = (q_idx[None, None, :] < sizes[:, None, None]).expand(b, n, n).clone()
        causal = torch.tensor([p.causal for p in pieces], device=dev)
        new &= ~causal[:, None, None] | (q_idx[None, :, None] >= q_idx[None, None, :])
        new |= torch.eye(n, dtype=torch.bool, device=dev)[None]      # padded rows: themselves
        self.allowed = torch.cat([cached[:, None, :].expand(b, n, c), new], dim=2)[:, None]
        # cache writes: (slot, position) of every written token, its row in the [b * n] layout
        rows, at = [], []
        for i, (p, length) in enumerate(zip(pieces, lens)):
            if p.write:
                rows += [i * n + j for j in range(len(p.tokens))]
                at.append(cache.table(p.slot)[length:length + len(p.tokens)])
        self.write_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        self.write_at = torch.cat(at) if at else None       # [written] flat cache index

    def positions(self) -> torch.Tensor:
        """[b * n] absolute positions (padding: the piece's next ones, harmless)."""
        lens = torch.tensor([self.cache.lengths[p.slot] for p in self.pieces],
                            device=self.cache.device)
        return (lens[:, None] + torch.arange(self.n, device=self.cache.device)[None]).reshape(-1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor | None = None) -> torch.Tensor:
        if v is None:
            k, v = kv_halves(k)
        b, n, c = len(self.pieces), self.n, self.c
        flat = self.read_index.reshape(-1)
        ck = self.cache.k[layer].index_select(0, flat).view(b, c, *k.shape[1:]).transpose(1, 2)
        cv = self.cache.v[layer].index_select(0, flat).view(b, c, *v.shape[1:]).transpose(1, 2)
        k4 = torch.cat([ck, k.view(b, n, *k.shape[1:]).transpose(1, 2)], dim=2)
        v4 = torch.cat([cv, v.view(b, n, *v.shape[1:]).transpose(1, 2)], dim=2)
        q4 = q.view(b, n, *q.shape[1:]).transpose(1, 2)                  # [b, H, n, d]
        o = torch.nn.functional.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=self.allowed, enable_gqa=q.shape[1] != k.shape[1])
        if self.write_at is not None:
            self.cache.k[layer][self.write_at] = k.index_select(0, self.write_rows)
            self.cache.v[layer][self.write_at] = v.index_select(0, self.write_rows)
        return o.transpose(1, 2).reshape(b * n, -1)


class PieceLogits(list):
    """run_pieces' result: per piece its `logits_rows` logits [rows, V] (fp32), views of `flat`
    [R, V], every piece's rows end to end, which the batched decisions read in one pass
    (strategies/nemotron_decide.py)."""

    def __init__(self, flat: torch.Tensor, sizes: list[int]):
        super().__init__(flat.split(sizes))
        self.flat = flat


def run_pieces(model, cache: SlotCache, pieces: list[Piece]) -> PieceLogits:
    """One batched forward of `pieces`; per piece its `logits_rows` logits [rows, V] (fp32).
    Written pieces advance their slot's length."""
    attn = PieceAttention(cache, pieces)
    n = attn.n
    ids = torch.full((len(pieces), n), 0, dtype=torch.long)
    for i, p in enumerate(pieces):
        ids[i, :len(p.tokens)] = torch.tensor(p.tokens, dtype=torch.long)
    ids = ids.to(cache.device).reshape(-1)
    adapter = getattr(model, "draft_adapter", None)
    if adapter is not None:
        adapter.set_rows(_adapter_rows(pieces, n, cache.device))
    try:
        hidden = model.forward_tokens(model.embed(ids), attn.positions(), attn)
    finally:
        if adapter is not None:
            adapter.set_rows(None)
    want = [i * n + r for i, p in enumerate(pieces) for r in p.logits_rows]
    logits = model.compute_logits(hidden.index_select(0, torch.tensor(want, dtype=torch.long, device=cache.device)))
    for p in pieces:
        if p.write:
            cache.lengths[p.slot] += len(p.tokens)
    return PieceLogits(logits.float(), [len(p.logits_rows) for p in pieces])


def _adapter_rows(pieces: list[Piece], n: int, device) -> torch.Tensor | None:
    """[b * n] bool: rows of pieces that run the draft adapter (None when none does)."""
    if not any(p.adapter for p in pieces):
        return None
    flags = torch.tensor([p.adapter for p in pieces], device=device)
    return flags[:, None].expand(len(pieces), n).reshape(-1)

