"""The runner's scoring pass: lays ScoreItems' sequences on the flat token axis (after the
generation windows) and, after the shared forward, reduces their rows on the model's device.

Only what the estimator needs leaves the device: per request the [T] cross-entropy totals, the
greedy check's (row, token) and, for a one-token continuation, its top-k. The head runs on the
scored rows only (each masked position's predictor row), a bounded number of rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cover_vllm.attention import SeqLayout
from cover_vllm.scoring.items import ScoreItem, ScoreResult

LOGIT_BYTES_PER_CHUNK = 1 << 28     # full-vocabulary fp32 rows computed at once (256 MiB)


@dataclass
class ScoreLayout:
    """Where each item's sequences start on the flat token axis."""

    items: list[ScoreItem]
    starts: list[list[int]] = field(default_factory=list)   # per item, per sequence


def lay_out_scores(items: list[ScoreItem], seqs: list[SeqLayout], ids: list[torch.Tensor],
                   positions: list[torch.Tensor], offset: int) -> tuple[ScoreLayout, int]:
    """Append every item's sequences to the forward's layout lists from flat token `offset`;
    returns their layout and the offset after them."""
    lay = ScoreLayout(items)
    for item in items:
        starts = []
        for s in item.seqs:
            n = int(s.input_ids.numel())
            seqs.append(SeqLayout(s.window_start, n, s.key_slots, [],
                                  causal_block=item.causal_block))
            ids.append(s.input_ids)
            positions.append(torch.arange(s.window_start, s.window_start + n))
            starts.append(offset)
            offset += n
        lay.starts.append(starts)
    return lay, offset


def _flat(starts: list[int], seq: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return torch.tensor(starts, dtype=torch.long)[seq] + row


def _guided(model, hidden: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None,
            scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of flat rows `cond`; with cfg (uncond rows given) u + (s + 1) * (c - u)."""
    logits = model.compute_logits(hidden.index_select(0, cond)).float()
    if uncond is None:
        return logits
    u = model.compute_logits(hidden.index_select(0, uncond)).float()
    return u + (scale[:, None] + 1.0) * (logits - u)


class _Targets:
    """Every item's cross-entropy rows, concatenated, on the device."""

    def __init__(self, lay: ScoreLayout, device: torch.device):
        cond, uncond, target, ratio, dest, scale, sizes = [], [], [], [], [], [], []
        base = 0
        for item, starts in zip(lay.items, lay.starts):
            sizes.append(item.num_tokens)
            ce = item.cross_entropy
            if ce is not None:
                flat = _flat(starts, ce.seq, ce.row)
                cond.append(flat)
                uncond.append(flat if ce.uncond_seq is None else _flat(starts, ce.uncond_seq,
                                                                       ce.row))
                target.append(ce.target)
                ratio.append(ce.ratio)
                dest.append(base + ce.token_index)
                scale.append(torch.full((flat.numel(),), item.cfg_scale))
            base += item.num_tokens
        self.sizes, self.total = sizes, base
        self.any = bool(cond)
        if not self.any:
            return
        def to(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts).to(device)

        self.cond, self.uncond, self.target = to(cond), to(uncond), to(target)
        self.ratio, self.dest, self.scale = to(ratio), to(dest), to(scale)
        self.guided = bool((self.scale > 0).any())


def _accumulator(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def score_forward(model, hidden: torch.Tensor, lay: ScoreLayout, fetch) -> list[ScoreResult]:
    """Reduce the scored rows of `hidden` [T, hidden] to each item's ScoreResult, brought to the
    host by `fetch` (HostTransfer.fetch: one copy for all of them)."""
    device = hidden.device
    t = _Targets(lay, device)
    totals = torch.zeros(t.total, dtype=_accumulator(device), device=device)
    if t.any:
        vocab = model.spec.vocab_size
        chunk = max(1, LOGIT_BYTES_PER_CHUNK // (4 * vocab))
        for s in range(0, int(t.cond.numel()), chunk):
            part = slice(s, s + chunk)
            logits = _guided(model, hidden, t.cond[part], t.uncond[part] if t.guided else None,
                             t.scale[part])
            ce = F.cross_entropy(logits, t.target[part], reduction="none") / t.ratio[part]
            totals.index_add_(0, t.dest[part], ce.to(totals.dtype))
    picks, tops = _greedy_picks(model, hidden, lay), _top_logprobs(model, hidden, lay)
    keys = list(tops)
    totals, picks, *flat = fetch([totals, picks, *(t for k in keys for t in tops[k])])
    host = totals.split(t.sizes)
    picks = None if picks is None else picks.tolist()
    tops = {k: (flat[2 * j].tolist(), flat[2 * j + 1].tolist()) for j, k in enumerate(keys)}
    results, g = [], 0
    for i, item in enumerate(lay.items):
        pick = None
        if item.greedy is not None:
            pick, g = tuple(picks[g]), g + 1
        results.append(ScoreResult(host[i], pick, tops.get(i)))
    return results


def _greedy_picks(model, hidden: torch.Tensor, lay: ScoreLayout) -> torch.Tensor | None:
    """[n, 2] long on the device: (row index, token) of each greedy item's most confident
    still-masked position (fp32 softmax of the argmax; the first row on ties, as torch.sort's
    first index in the official check)."""
    picks = []
    for item, starts in zip(lay.items, lay.starts):
        g = item.greedy
        if g is None:
            continue
        rows = g.rows.to(hidden.device)
        cond = rows + starts[g.seq]
        uncond = None if g.uncond_seq is None else rows + starts[g.uncond_seq]
        scale = torch.full((rows.numel(),), item.cfg_scale, device=hidden.device)
        logits = _guided(model, hidden, cond, uncond, scale)
        conf, token = torch.softmax(logits, dim=-1).max(dim=-1)
        row = torch.argmax(conf)
        picks.append(torch.stack((row, token[row])))
    return torch.stack(picks) if picks else None


def _top_logprobs(model, hidden: torch.Tensor, lay: ScoreLayout) -> dict:
    """Item index -> (ids, log-probs) of the k most likely tokens at a one-token
    continuation's position (its first copy's row: every copy masks that one token), on the
    device."""
    tops = {}
    for i, (item, starts) in enumerate(zip(lay.items, lay.starts)):
        ce = item.cross_entropy
        if not item.top_logprobs or ce is None:
            continue
        cond = _flat(starts, ce.seq[:1], ce.row[:1]).to(hidden.device)
        uncond = None if ce.uncond_seq is None else _flat(starts, ce.uncond_seq[:1],
                                                          ce.row[:1]).to(hidden.device)
        scale = torch.full((1,), item.cfg_scale, device=hidden.device)
        logp = torch.log_softmax(_guided(model, hidden, cond, uncond, scale), dim=-1)[0]
        values, ids = logp.topk(item.top_logprobs)
        tops[i] = (ids, values)
    return tops
