"""Token proposals shared by strategies: greedy/temperature candidates and their confidences.

Everything here runs on the logits' device and never reads a value back to the host. The one
place where the host and a device differ is `Rows`: the rows a decision reads the vocabulary at
are gathered compactly on the CPU (a boolean index costs nothing there) and read all at once,
masked, anywhere else (counting them would make the host wait for the device).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

_DENSE = contextvars.ContextVar("cover_vllm_dense_rows", default=False)


@contextlib.contextmanager
def dense_rows():
    """Within this block `Rows` reads every row on the CPU too, as it does on a GPU: the
    parity tests run the device path on the host with it (tests/test_device_decisions.py)."""
    token = _DENSE.set(True)
    try:
        yield
    finally:
        _DENSE.reset(token)


class Rows:
    """The view rows, [n, W] bool, at which a decision reads the vocabulary.

    `take` gives those rows of an [n, W, ...] tensor as [N, ...] and `put` lays [N, ...] values
    back out as [n, W, ...] with `fill` elsewhere. On the CPU N is the number of rows in the mask
    (row-major order, as `t[mask]`); on any other device N = n * W (every row, no host sync), and
    values outside the mask are discarded by `put`. Either way a row's value never depends on the
    others, so both give the same bits on the rows that matter.
    """

    def __init__(self, mask: torch.Tensor, within: "Rows | None" = None):
        """With `within` (a Rows whose mask covers this one's), `take` reads tensors that
        `within.take` already gathered."""
        self.mask, self.nested = mask, within is not None
        self.compact = mask.device.type == "cpu" and not _DENSE.get()
        self.index = None
        if self.compact:           # index_select: 1.6x faster on CPU than boolean indexing
            self.index = mask.flatten().nonzero().squeeze(1)
            if within is not None:                  # the same rows' places in within's order
                self.index = (within.mask.flatten().cumsum(0) - 1).index_select(0, self.index)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        flat = t if self.nested else t.reshape(-1, *t.shape[2:])
        return flat.index_select(0, self.index) if self.compact else flat

    def put(self, values: torch.Tensor, fill) -> torch.Tensor:
        shape = (*self.mask.shape, *values.shape[1:])
        if self.compact:
            out = torch.full(shape, fill, dtype=values.dtype, device=values.device)
            out[self.mask] = values
            return out
        if values.dim() == 1:                   # no view of the mask
            return self._laid_out(values, fill)
        mask = self.mask.reshape(*self.mask.shape, *([1] * (values.dim() - 1)))
        return torch.where(mask, values.reshape(shape), torch.tensor(fill, dtype=values.dtype,
                                                                    device=values.device))

    def gather(self, table: torch.Tensor, index: torch.Tensor, fill,
               keep: torch.Tensor | None = None) -> torch.Tensor:
        """`put(table.gather(-1, take(index)[:, None])[:, 0], fill)`: the entry of `table`
        [N, V] (rows already taken) at each row's `index` [n, W], laid out as [n, W]; with
        `keep` ([n, W] bool within the mask) `fill` outside `keep` too. Off the CPU two views
        (and with `keep` a `where`) fewer: the index seen as [N, 1], the result as [n, W]."""
        assert not self.nested, "Rows.gather reads [n, W] indices: gather_taken for nested rows"
        if self.compact:
            out = self.gather_taken(table, self.take(index), fill)
            return out if keep is None else torch.where(keep, out, fill)
        return self._laid_out(table.gather(-1, index.reshape(-1, 1)), fill, keep)

    def gather_taken(self, table: torch.Tensor, index: torch.Tensor, fill) -> torch.Tensor:
        """`gather` with `index` [N] already taken (for nested rows: through `within` and this
        one), one view fewer than `put` of a gathered column off the CPU."""
        if self.compact:
            return self.put(table.gather(-1, index[:, None])[:, 0], fill)
        return self._laid_out(table.gather(-1, index.view(-1, 1)), fill)

    def _laid_out(self, picked: torch.Tensor, fill,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
        """[N] or [N, 1] values of every row (off the CPU) as [n, W], `fill` outside the mask
        (or outside `keep`)."""
        return torch.where(self.mask if keep is None else keep, picked.view(self.mask.shape),
                           torch.tensor(fill, dtype=picked.dtype, device=picked.device))


def as_rows(rows: torch.Tensor | Rows | None) -> Rows | None:
    """A [n, W] bool mask as `Rows` (Rows and None pass through)."""
    return rows if rows is None or isinstance(rows, Rows) else Rows(rows)


def on_device(values, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a list or a CPU tensor) as a tensor on `like`'s device: the host-to-device
    direction, which never makes the host wait."""
    if isinstance(values, torch.Tensor):
        return values.to(device=like.device, dtype=dtype or values.dtype)
    return torch.tensor(values, dtype=dtype, device=like.device)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """logits [n, W, V]; per-row top_k [n] (-1 off) and top_p [n] (1.0 off), host tensors ->
    filtered logits (on the logits' device)."""
    out = logits
    if bool((top_k > 0).any()):
        vocab = logits.shape[-1]
        k = on_device(torch.where(top_k > 0, top_k, vocab).clamp(max=vocab), logits)
        kth = logits.sort(dim=-1, descending=True).values.gather(
            -1, (k - 1)[:, None, None].expand(*logits.shape[:2], 1))
        out = out.masked_fill(out < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = out.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        p = on_device(top_p, logits)
        drop_sorted = (cum - sorted_logits.softmax(-1)) > p[:, None, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def take_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [n, W, V] at rows [n, W] bool -> [N, V] (`Rows(rows).take(logits)`)."""
    return Rows(rows).take(logits)


GREEDY_CHUNK = 128       # vocabulary columns per chunk of the CPU argmax


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, first index on ties (as `argmax`): `max(dim)`'s indices, the
    same tokens 2.7x (fp32) to 4.7x (bf16) faster on CPU than `argmax` (measured at
    [320, 16384]).

    On the CPU, for a contiguous tensor whose vocabulary splits into chunks of GREEDY_CHUNK,
    two steps instead: the vectorised `amax` of every chunk, then `max(dim)` over the chunk
    maxima (the first chunk holding the row's maximum) and within that chunk. The same index
    bit for bit (first on ties; a NaN, like `max`, wins and the first one is returned),
    5.6x faster than one `max(dim)` over [264, 16384] fp32 (0.65 against 3.64 ms, one
    thread): `max(dim)` with indices runs a scalar loop on the CPU, `amax` a vectorised one.
    Elsewhere (a GPU: one kernel is cheaper than five) `max(dim)` as before."""
    vocab = logits.shape[-1]
    if logits.device.type != "cpu" or not logits.is_contiguous() or vocab % GREEDY_CHUNK \
            or vocab == GREEDY_CHUNK or logits.numel() == 0:
        return logits.max(dim=-1).indices
    lead = logits.shape[:-1]
    chunks = logits.view(*lead, vocab // GREEDY_CHUNK, GREEDY_CHUNK)
    first = chunks.amax(-1).max(dim=-1).indices                        # [...] chunk index
    inside = chunks.gather(-2, first[..., None, None].expand(*lead, 1, GREEDY_CHUNK))
    return first * GREEDY_CHUNK + inside.squeeze(-2).max(dim=-1).indices


def greedy_max(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`greedy(probs)`, `probs.amax(-1)`): off the CPU one `max(dim)` gives both (its values
    are amax's, bit for bit), one device op fewer in COVER's check (issue #42). On the CPU the
    faster two-step `greedy` and a vectorised `amax`, as before."""
    if probs.device.type == "cpu":
        return greedy(probs), probs.amax(-1)
    values, indices = probs.max(dim=-1)
    return indices, values


def hot_rows(temperature: torch.Tensor) -> list[int]:
    """Requests that sample (temperature > 0), from the host copy of their temperatures."""
    return (temperature > 0).nonzero().flatten().tolist()


def _rand(shape, dtype: torch.dtype, generator: torch.Generator | None,
          like: torch.Tensor) -> torch.Tensor:
    return torch.rand(shape, dtype=dtype, generator=generator, device=like.device)


def gumbel_candidates(logits: torch.Tensor, temperature: torch.Tensor,
                      generators: list[torch.Generator | None], lengths: list[int],
                      rows: Rows | None = None) -> torch.Tensor:
    """argmax of LLaDA's float64 Gumbel-max perturbation exp(l) / (-log u)^T; greedy rows at T=0.

    logits [n, W, V] -> tokens [n, W]. Noise for request i covers only its own `lengths[i]` view
    rows and comes from its own generator (on the logits' device), so batching never changes a
    request's draws. With `rows` the greedy argmax is taken only there (0 elsewhere).
    """
    tokens = greedy(logits) if rows is None else rows.put(greedy(rows.take(logits)), 0)
    for i in hot_rows(temperature):
        row = logits[i, : lengths[i]].double()
        u = _rand(row.shape, torch.float64, generators[i], row)
        noisy = row.exp() / (-torch.log(u)) ** float(temperature[i])
        tokens[i, : lengths[i]] = greedy(noisy)
    return tokens


def sample_candidates(logits: torch.Tensor, temperature: torch.Tensor,
                      generators: list[torch.Generator | None], lengths: list[int]) -> torch.Tensor:
    """Dream-style sampling: softmax(logits / T) multinomial per row; argmax where T = 0."""
    tokens = greedy(logits)
    for i in hot_rows(temperature):
        probs = torch.softmax(logits[i, : lengths[i]].float() / float(temperature[i]), dim=-1)
        tokens[i, : lengths[i]] = torch.multinomial(probs, 1, generator=generators[i]).squeeze(-1)
    return tokens


def uniform(length: int, generator: torch.Generator | None, like: torch.Tensor) -> torch.Tensor:
    """[length] float32 uniform draws from a request's own generator, on `like`'s device."""
    return _rand((length,), torch.float32, generator, like)


@dataclass(frozen=True)
class MaskColumn:
    """The model's [MASK] logit at every view row, which `StepBatch.logits` holds at -inf so that
    [MASK] is never proposed (else a block could stay stuck). The official decoders' softmax runs
    over the whole vocabulary, [MASK] included, so a confidence puts it back: left out, on a
    random bf16 llada-50m it moved float64 confidences by ~7e-5 of their value and flipped a
    2.2e-11 near-tie deciding which position is revealed (issue #48)."""

    token_id: int
    logits: torch.Tensor        # [n, W] float32, the [MASK] column before the -inf

    def restore(self, logits: torch.Tensor, dtype: torch.dtype,
                rows: Rows | None = None) -> torch.Tensor:
        """A copy of `logits` ([n, W, V], or [N, V] = `rows.take` of them) in `dtype` with the
        [MASK] column written back: the rows the official softmax reads, bit for bit."""
        assert rows is None or not rows.nested, "the column is [n, W]: rows of the view"
        out = logits.to(dtype, copy=True)
        column = self.logits if rows is None else rows.take(self.logits)
        out.select(-1, self.token_id).copy_(column)
        return out


def softmax_probs(logits: torch.Tensor, dtype: torch.dtype, mask: MaskColumn | None,
                  rows: Rows | None = None) -> torch.Tensor:
    """softmax over the vocabulary in `dtype`, over the official row when `mask` is given."""
    x = logits.to(dtype) if mask is None else mask.restore(logits, dtype, rows)
    return torch.softmax(x, dim=-1)


def token_prob(logits: torch.Tensor, tokens: torch.Tensor,
               dtype: torch.dtype = torch.float32, rows: Rows | torch.Tensor | None = None,
               picked: torch.Tensor | None = None, mask: MaskColumn | None = None) -> torch.Tensor:
    """softmax(logits)[tokens] computed in `dtype`: [n, W, V], [n, W] -> [n, W].

    With `rows` only those rows count (0 elsewhere): a full-vocabulary softmax is the costliest
    part of a decision, and a row's value never depends on the others. `picked` is
    `rows.take(logits)` when the caller already has it. With `mask` (the batch's
    `mask_column`) the softmax includes the [MASK] logit, as the official decoders' does; it
    costs one copy of the rows read (none extra in float64, where the cast copies anyway).
    """
    if rows is None:
        return softmax_probs(logits, dtype, mask).gather(-1, tokens[..., None]).squeeze(-1)
    rows = as_rows(rows)
    if picked is None:
        picked = rows.take(logits)                                          # [N, V]
    return rows.gather(softmax_probs(picked, dtype, mask, rows), tokens, 0.0)


def topk_mask(scores: torch.Tensor, k: torch.Tensor | int, *,
              never_inf: bool = False) -> torch.Tensor:
    """Per row, True at the k[i] highest scores (non-finite entries are never chosen); ties go
    to the lower position. scores [n, W]; k [n] (on any device: a host tensor is copied) or one
    int for every row. `never_inf`: the caller knows no score is +inf (probabilities, or their
    negatives, with -inf for "none"), so `scores > -inf` is `finite(scores)` (NaN included) in
    one op instead of two.

    Seven ops for the batch (six with `never_inf`): the stable descending order, its inverse
    permutation (each position's rank: an argsort of a permutation), and `finite` (issue #42)."""
    ranks = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    within = ranks < (k if isinstance(k, int) else on_device(k, scores)[:, None])
    return within & (scores > float("-inf") if never_inf else finite(scores))


def top1_or_at_least(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """`topk_mask(scores, 1) | (scores >= threshold)` of scores that are never +inf (see
    `topk_mask`'s `never_inf`), [n, W] -> [n, W] bool, in four device ops instead of eight
    (issue #42): `max(dim)` finds each row's first highest score (ties to the lower position,
    as the stable sort), and its place is set to whether that score is finite. A NaN row
    maximum is not finite, and neither chooses it: `topk_mask` ranks NaN first and drops it.
    Rows of no column have no maximum (`max` would raise): nothing is chosen."""
    if scores.shape[-1] == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    top, at = scores.max(dim=-1, keepdim=True)                            # [n, 1] each
    return (scores >= threshold).scatter_(-1, at, top > float("-inf"))


def finite(x: torch.Tensor) -> torch.Tensor:
    """`torch.isfinite(x)` of a floating tensor in two ops instead of four: |±inf| is inf and
    NaN fails the comparison."""
    return x.abs() < float("inf")
