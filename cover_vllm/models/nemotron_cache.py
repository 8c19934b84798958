"""The KV cache of Nemotron-Labs-Diffusion's decodings and their batched forward: every running
request owns a slot of a per-layer [slots, Hkv, capacity, d] buffer and a length; one forward
runs a piece of tokens for each of several requests, each piece in its own attention mode.

A piece (`Piece`) is a request's new tokens at positions length + index, in one of the model's
two modes (models/nemotron.py): `causal=False` (diffusion: the piece sees every cached key and
all of itself) or `causal=True` (causal inside the piece), and `write=True` keeps its K/V at
length + index (the length then grows by the piece). A request's length can be cut back
(`truncate`, self-speculation's crop): the slots past it are simply overwritten later.

Pieces of different lengths are padded to the longest (padded queries see one key and are
dropped; padded keys are hidden), so every request of a step shares one GEMM per weight. Every
piece's K/V go to its slot's positions length + index, written or not (a piece that is not
`write` leaves its length alone, so they are scratch there, overwritten later; a request's
capacity holds a spare block for it), and then each layer reads a piece's keys, cached and
new, by one gather of its positions [0, length + size) from the joint K/V tensor: a layer's
attention is a write, a gather and one fused SDPA call, about nine ops however many pieces
(issue #50; attention/base.py does the same for the engine's windows). A batch in which no
piece has a cache or writes (likelihood scoring) attends over its fresh K/V alone.

Under tensor parallelism (#50) the driver's `PagedSlots` keeps all the bookkeeping; each step's
`PiecesCall` carries what the other ranks need to run the same forward statelessly (the pieces,
every piece's length and page ids), and a rank runs it over its own KV shard (`run_call`): the
same page ids, its own kv heads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cover_vllm.host_transfer import to_device
from cover_vllm.layers.base import kv_halves
from cover_vllm.layers.kv_layout import LayerKV, gather_kv, heads_first, window_kv
from cover_vllm.layers.yarn import positions_below, yarn_ropes


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
    """Standalone storage: per layer K and V side by side [slots * capacity, 2 Hkv, d] (a
    `LayerKV`; slot s holds positions at s * capacity + p) with a length per slot; grows on
    demand. The engine's runner uses `PagedSlots` instead (the engine's own pool); tests and
    tools use this one."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.shape = (2 * num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.layers: list[LayerKV] = []
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

    @property
    def page_size(self) -> int:
        return self.capacity

    def page_list(self, slot: int) -> list[int]:
        """The slot as one page of `capacity` positions (`PieceAttention`)."""
        return [slot]

    def _grow(self, capacity: int, slots: int) -> None:
        old, old_cap = self.num_slots, self.capacity
        for i in range(self.num_layers):
            new = torch.zeros(slots * capacity, *self.shape, dtype=self.dtype, device=self.device)
            if i < len(self.layers):
                new.view(slots, capacity, *self.shape)[:old, :old_cap] = \
                    self.layers[i].joint.view(old, old_cap, *self.shape)
                self.layers[i] = LayerKV(new)
            else:
                self.layers.append(LayerKV(new))
        self.free += list(range(slots - 1, old - 1, -1))
        self.lengths.update({s: 0 for s in range(old, slots)})
        self.num_slots, self.capacity = slots, capacity


class PagedSlots:
    """The runner's storage: pages of the engine's own paged pool (the engine's KVCache and
    PagePool), so these requests and the engine's share one KV budget and admission is by free
    pages. A slot is a request's pages; position p lives at cache slot
    pages[p // page_size] * page_size + p % page_size."""

    def __init__(self, cache, pool, page_size: int):
        # per layer (K, V) [slots, Hkv, d]: halves of one joint tensor (a LayerKV) when the
        # cache has them, so one op writes both and one gather reads both
        self.layers = getattr(cache, "layers", None) or list(zip(cache.k, cache.v))
        self.pool, self.page_size = pool, page_size
        self.device = self.layers[0][0].device
        self.lengths: dict[int, int] = {}
        self.cached: dict[int, int] = {}            # positions found in the prefix cache
        self.pages: dict[int, list[int]] = {}
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
        slot, self._next = self._next, self._next + 1
        self.cached[slot] = len(hits) * self.page_size
        self.pages[slot], self.lengths[slot] = hits + fresh, 0
        return slot

    def release(self, slot: int) -> None:
        self.pool.free(self.pages.pop(slot))
        del self.lengths[slot], self.cached[slot]

    def index(self, slot: int, keys: list[bytes]) -> None:
        """Record that `slot`'s first len(keys) pages hold the K/V those keys name."""
        for page, key in zip(self.pages[slot], keys):
            self.pool.index(page, key)

    def truncate(self, slot: int, length: int) -> None:
        assert 0 <= length <= self.lengths[slot]
        self.lengths[slot] = length

    def page_list(self, slot: int) -> list[int]:
        """The slot's pages, in position order (`PieceAttention`)."""
        return self.pages[slot]


@dataclass
class PiecesCall:
    """One batched forward as a tensor-parallel rank receives it: no slot of its own to track."""

    pieces: list[Piece]
    lengths: dict[int, int]            # slot -> its cached length before the forward
    pages: dict[int, list[int]]        # slot -> its page ids (empty: it reads and writes none)


def pieces_call(cache, pieces: list[Piece]) -> PiecesCall:
    """What the other ranks need to repeat `run_pieces(model, cache, pieces)` on their shards.
    Pages exist on every rank only for `PagedSlots` (the engine's pool); a standalone cache's
    pieces may neither read nor write (the likelihood's scratch)."""
    lengths = {p.slot: cache.lengths[p.slot] for p in pieces}
    pages = getattr(cache, "pages", None)
    if pages is None:
        if any(p.write or lengths[p.slot] for p in pieces):
            raise ValueError("under tensor parallelism a forward that reads or writes K/V must "
                             "use the engine's paged pool (PagedSlots), which every rank holds")
        return PiecesCall(pieces, lengths, {slot: [] for slot in lengths})
    return PiecesCall(pieces, lengths, {slot: pages[slot] for slot in lengths})


class PageView:
    """A rank's stand-in for the driver's `PagedSlots` during one `PiecesCall`: the rank's own
    K/V shard, the lengths and page lists the call names (changes are dropped with it)."""

    def __init__(self, cache, page_size: int, call: PiecesCall):
        self.layers = getattr(cache, "layers", None) or list(zip(cache.k, cache.v))
        self.page_size, self.device = page_size, self.layers[0][0].device
        self.lengths, self.pages = dict(call.lengths), call.pages

    def page_list(self, slot: int) -> list[int]:
        return self.pages[slot]


def run_call(model, cache, page_size: int, call: PiecesCall) -> None:
    """A non-driver rank's share of a batched forward: its K/V writes and its part of every
    all-reduce. No logits (only the driver's are used; the LM head needs no collective)."""
    run_pieces(model, PageView(cache, page_size, call), call.pieces, logits=False)


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
    """The AttentionFn of one batched forward over `pieces` (see the module docstring).

    Built once per step: the pieces' positions, cache slots and mask reach the device in one
    copy (`to_device`) and a few ops, and each layer then costs the same whatever the batch."""

    def __init__(self, cache: SlotCache, pieces: list[Piece]):
        self.cache, self.b = cache, len(pieces)
        sizes = [len(p.tokens) for p in pieces]
        lens = [cache.lengths[p.slot] for p in pieces]
        self.n = n = max(sizes)                                       # padded piece length
        # scoring: nothing cached, nothing kept; the keys are the fresh K/V themselves
        self.fresh_only = not any(lens) and not any(p.write for p in pieces)
        self.num_keys = n if self.fresh_only else max(map(sum, zip(lens, sizes)))
        self.padded = any(size < n for size in sizes)
        rows, at = [], []            # every real row [b * n] and where it goes [b * num_keys]
        for i, (p, length, size) in enumerate(zip(pieces, lens, sizes)):
            assert self.fresh_only or length + size <= \
                len(cache.page_list(p.slot)) * cache.page_size, "a piece past its slot's room"
            rows += range(i * n, i * n + size)
            at += range(i * self.num_keys + length, i * self.num_keys + length + size)
        span = -(-self.num_keys // cache.page_size)                   # pages a piece may span
        pages = [(cache.page_list(p.slot) + [0] * span)[:span] for p in pieces]
        host = [torch.tensor(pages, dtype=torch.long).view(self.b, span),
                torch.tensor([lens, sizes], dtype=torch.long),
                torch.tensor(rows, dtype=torch.long), torch.tensor(at, dtype=torch.long),
                torch.tensor([p.causal for p in pieces])]
        pages, ls, rows, at, causal = to_device(host, cache.device)
        self._index(pages, at)
        self._positions = (ls[0][:, None] + torch.arange(n, device=cache.device)).reshape(-1)
        self.allowed = _piece_mask(ls[0], ls[1], causal, n, self.num_keys)
        self.write_rows = rows if self.padded else None               # None: every row

    def _index(self, pages: torch.Tensor, at: torch.Tensor) -> None:
        """`read_index` [b * num_keys]: each piece's cache slot of positions 0 .. num_keys - 1
        (past its pages: a slot of page 0, hidden by the mask); `write_at` [real rows]: the
        slots of the pieces' positions length + index."""
        if self.fresh_only:
            self.read_index = self.write_at = None
            return
        page_size = self.cache.page_size
        pos = torch.arange(self.num_keys, device=pages.device)
        self.read_index = (pages[:, pos // page_size] * page_size + pos % page_size).reshape(-1)
        self.write_at = self.read_index.index_select(0, at)

    def positions(self) -> torch.Tensor:
        """[b * n] absolute positions (padding: the piece's next ones, harmless)."""
        return self._positions

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor | None = None) -> torch.Tensor:
        b, n = self.b, self.n
        kv = k if v is None else None
        if self.fresh_only:
            keys, values = window_kv(kv, k, v, torch.Size((b, n)))
        else:
            pair = self.cache.layers[layer]
            self._write(pair, kv, k, v)
            keys, values = gather_kv(pair, self.read_index.view(b, -1), self.read_index)
        o = F.scaled_dot_product_attention(heads_first(q, b, n), keys, values,
                                           attn_mask=self.allowed,
                                           enable_gqa=q.shape[1] != keys.shape[1])
        return o.transpose(1, 2).reshape(b * n, -1)                   # [b * n, H * d]

    def _write(self, pair, kv: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None):
        """Every real row's fresh K/V to its slot: one op for side-by-side K/V into a joint
        cache (two more to drop padded rows)."""
        joint = getattr(pair, "joint", None)
        if kv is not None and joint is None:
            k, v = kv_halves(kv)
        targets = [(joint, kv)] if joint is not None and kv is not None else zip(pair, (k, v))
        for cache, fresh in targets:
            rows = fresh if self.write_rows is None else fresh.index_select(0, self.write_rows)
            cache.index_copy_(0, self.write_at, rows)


def _piece_mask(lens: torch.Tensor, sizes: torch.Tensor, causal: torch.Tensor, n: int,
                num_keys: int) -> torch.Tensor:
    """[b, 1, n, num_keys] bool: query j of piece i sees its cached keys (< lens[i]) and its own
    new ones (lens[i] + 0 .. sizes[i] - 1; the earlier ones only when causal); a padded query
    sees key 0 (always a real position), so no row is empty."""
    query = torch.arange(n, device=lens.device)[None, :, None]                   # [1, n, 1]
    key = torch.arange(num_keys, device=lens.device)[None, None, :]              # [1, 1, K]
    rel = key - lens[:, None, None]                         # [b, 1, K] index inside the piece
    new = (rel >= 0) & (rel < sizes[:, None, None]) & (~causal[:, None, None] | (rel <= query))
    real = query < sizes[:, None, None]                                          # [b, n, 1]
    return torch.where(real, (rel < 0) | new, key == 0)[:, None]


class PieceLogits(list):
    """run_pieces' result: per piece its `logits_rows` logits [rows, V] (fp32), views of `flat`
    [R, V], every piece's rows end to end, which the batched decisions read in one pass
    (strategies/nemotron_decide.py)."""

    def __init__(self, flat: torch.Tensor, sizes: list[int]):
        super().__init__(flat.split(sizes))
        self.flat = flat


def run_pieces(model, cache: SlotCache, pieces: list[Piece],
               logits: bool = True) -> PieceLogits | None:
    """One batched forward of `pieces`; per piece its `logits_rows` logits [rows, V] (fp32),
    None without `logits`. Written pieces advance their slot's length."""
    attn = PieceAttention(cache, pieces)
    n = attn.n
    ids = torch.tensor([t for p in pieces for t in p.tokens + [0] * (n - len(p.tokens))])
    ids = ids.to(cache.device)
    adapter = getattr(model, "draft_adapter", None)
    if adapter is not None:
        adapter.set_rows(_adapter_rows(pieces, n, cache.device))
    last = max(cache.lengths[p.slot] + len(p.tokens) for p in pieces)
    try:
        with positions_below(yarn_ropes(model), last - 1):
            hidden = model.forward_tokens(model.embed(ids), attn.positions(), attn)
    finally:
        if adapter is not None:
            adapter.set_rows(None)
    for p in pieces:
        if p.write:
            cache.lengths[p.slot] += len(p.tokens)
    if not logits:
        return None
    want = torch.tensor([i * n + r for i, p in enumerate(pieces) for r in p.logits_rows],
                        dtype=torch.long, device=cache.device)
    out = model.compute_logits(hidden.index_select(0, want))
    return PieceLogits(out.float(), [len(p.logits_rows) for p in pieces])


def _adapter_rows(pieces: list[Piece], n: int, device) -> torch.Tensor | None:
    """[b * n] bool: rows of pieces that run the draft adapter (None when none does)."""
    if not any(p.adapter for p in pieces):
        return None
    flags = torch.tensor([p.adapter for p in pieces], device=device)
    return flags[:, None].expand(len(pieces), n).reshape(-1)

