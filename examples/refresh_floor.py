"""Can a cheaper second forward reach 60 % of `none`'s FLOPs on word? Two ways to forward fewer
rows than the stale block positions, measured on cover-tiny (docs/benchmarks.md, "word: why
60 % is out of reach").

    PYTHONPATH=. python examples/refresh_floor.py NUM [TASK]

After COVER's first (whole-canvas) forward drafts most of the block, `dual` + `adaptive`
re-forwards every block position whose token changed, because its cached K/V are still the
[MASK] version. This experiment patches the scheduler, the runner and the FLOP counter of this
commit to try two cheaper rules, each in a fresh LLM, one request at a time:

* `subset:X` — of the changed positions, forward only those holding share X of each still-masked
  row's attention on them (last layer, previous forward); the rest keep their stale K/V.
* `depth:D` — forward every changed position but keep its fresh K/V only at layers < D (a row
  that leaves the forward after layer D - 1's K/V projection); its FLOPs are counted as that.

Rows not forwarded (or forwarded shallowly) are excluded from COVER's seed candidates: their cache
does not hold their visible version. One JSON line per variant: accuracy %, NFE, refreshes and
MFLOP per generated token. One torch thread.
"""

from __future__ import annotations

import json
import sys

import torch

from cover_vllm import LLM
from cover_vllm.attention.correction import expand_kv_heads
from cover_vllm.eval import evaluate_one
from cover_vllm.engine import decide, engine
from cover_vllm.scheduler import scheduler
from cover_vllm.tasks import get_task
from cover_vllm.worker import model_runner

VARIANTS = ["adaptive", "subset:0.9", "subset:0.7", "depth:4", "depth:3", "depth:2", "depth:1"]


class Patch:
    """The rule under test and what the patched functions share during one forward."""

    rule: tuple[str, float] | None = None
    row_probs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # request -> (positions,
    last_probs: torch.Tensor | None = None                         # [Q, K] head-mean probs)
    shallow: tuple[torch.Tensor, torch.Tensor] | None = None       # (flat rows, cache slots)
    stat_positions: torch.Tensor | None = None     # positions of the rows last_probs holds


def _attention_in_mass(q, keys, meta, index, real):
    """The runner's statistic, also keeping each selected row's attention (batch of one)."""
    b, r_max = index.shape
    num_heads, head_dim = q.shape[1:]
    qs = q.index_select(0, index.flatten()).view(b, r_max, num_heads, head_dim)
    scores = torch.matmul(qs.transpose(1, 2).float(),
                          expand_kv_heads(keys, num_heads).permute(0, 2, 3, 1).float())
    probs = torch.softmax(scores * head_dim ** -0.5 + meta.key_bias(torch.float32), dim=-1)
    Patch.last_probs = probs.mean(1)[0][real[0]]                      # [masked rows, K]
    weight = real.to(probs.dtype) / num_heads
    return torch.matmul(weight.view(b, 1, 1, r_max), probs).sum(1)[:, 0]


def _stale_subset(req, start: int, masked: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:
    """`subset:X`: per still-masked row, the stale positions holding X of its mass on them."""
    seen = Patch.row_probs.get(req.request_id)
    if seen is None or not masked.any() or not stale.any():
        return stale
    rows_pos, probs = seen
    keep = torch.zeros_like(stale)
    cols = start + stale.nonzero().flatten()
    for pos in (start + masked.nonzero().flatten()).tolist():
        hit = (rows_pos == pos).nonzero().flatten()
        if hit.numel() == 0:
            return stale
        mass = probs[hit[0], cols]
        order = torch.argsort(mass, descending=True)
        share = torch.cumsum(mass[order], 0) / mass.sum().clamp(min=1e-30)
        keep[cols[order[:int((share < Patch.rule[1]).sum()) + 1]] - start] = True
    return keep


def install() -> None:
    """Patch this commit's scheduler, runner and FLOP counter with the rule in Patch.rule."""
    model_runner.attention_in_mass = _attention_in_mass
    sparse_window = scheduler.Scheduler._sparse_window

    def _sparse_window(self, req, seeds, outside):
        if Patch.rule is None or Patch.rule[0] != "subset" or outside:
            return sparse_window(self, req, seeds, outside)
        start, end = req.block
        block = req.canvas[start:end]
        masked = block == req.mask_id
        stale = _stale_subset(req, start, masked, ~masked & (block != req.kv_tokens[start:end]))
        pos = start + (masked | stale).nonzero().flatten()
        if seeds:
            pos = torch.cat((pos, torch.tensor(seeds, dtype=torch.long)))
        return torch.unique(torch.cat((pos, (pos - self.logit_shift).clamp(min=0))))

    work_item = scheduler.Scheduler._work_item

    def _work_item(self, req, plan):
        item = work_item(self, req, plan)
        item.shallow = None
        if Patch.rule and Patch.rule[0] == "depth" and item.window_positions is not None \
                and not item.is_refresh:
            start, end = req.block
            pos = item.window_positions
            tok = req.canvas[pos]
            stale = (pos >= start) & (pos < end) & (tok != req.mask_id) & (tok != req.kv_tokens[pos])
            for s, r in item.override:
                stale &= (pos != s) & (pos != r)
            item.shallow = pos[stale]
        return item

    layout = model_runner.ModelRunner._layout

    def _layout(self, out):
        lay = layout(self, out)
        item = out.items[0]
        Patch.stat_positions = item.positions()[lay.stat_rows[0]]
        shallow = getattr(item, "shallow", None)
        Patch.shallow = None
        if shallow is not None and shallow.numel():
            Patch.shallow = (torch.searchsorted(item.window_positions, shallow),
                             item.canvases[0].key_slots[shallow])
        return lay

    attention = model_runner.ModelRunner._attention

    def _attention(self, meta, stats):
        inner, cache = attention(self, meta, stats), self.cache

        def attn(layer, q, k, v):
            if Patch.shallow is not None and layer >= Patch.rule[1]:
                rows, slots = Patch.shallow                # keep their stale K/V from here on
                k, v = k.clone(), v.clone()
                k[rows], v[rows] = cache.k[layer][slots], cache.v[layer][slots]
            return inner(layer, q, k, v)
        return attn

    account = engine.Engine._account

    def _account(self, out, result):
        account(self, out, result)
        item = out.items[0]
        if Patch.last_probs is not None:
            Patch.row_probs[item.request_id] = (Patch.stat_positions, Patch.last_probs)
            Patch.last_probs = None
        shallow = getattr(item, "shallow", None)
        if shallow is not None and shallow.numel():
            fm, layers = self.flop_model, self.executor.model.dims.num_layers
            canvas = int(item.canvases[0].key_slots.numel())
            per_layer = (2 * fm.params_per_token + fm.attn_per_pair * canvas) / layers
            kv_proj = 4 * self.executor.model.dims.hidden_size * \
                self.executor.model.dims.num_kv_heads * self.executor.model.dims.head_dim
            cost = (Patch.rule[1] - 1) * per_layer + kv_proj
            self._requests[item.request_id].metrics.flops -= \
                (layers * per_layer - cost) * shallow.numel()

    batch = decide._batch

    def _batch(reqs, items, logits, *args, **kw):
        out = batch(reqs, items, logits, *args, **kw)
        for i, item in enumerate(items):           # a row not (fully) forwarded is no seed
            pos = torch.arange(item.view_start, item.view_end)
            if item.window_positions is not None:
                out.valid[i, :pos.numel()] &= torch.isin(pos, item.window_positions)
            shallow = getattr(item, "shallow", None)
            if shallow is not None:
                out.valid[i, :pos.numel()] &= ~torch.isin(pos, shallow)
        return out

    scheduler.Scheduler._sparse_window = _sparse_window
    scheduler.Scheduler._work_item = _work_item
    model_runner.ModelRunner._layout = _layout
    model_runner.ModelRunner._attention = _attention
    engine.Engine._account = _account
    decide._batch = _batch


def main(argv: list[str]) -> None:
    num = int(argv[0])
    task = get_task(argv[1] if len(argv) > 1 else "word")
    examples = task.eval_split(num)
    torch.set_num_threads(1)
    install()
    for variant in ["none"] + VARIANTS:
        kind, _, value = variant.partition(":")
        Patch.rule = (kind, float(value) if kind == "subset" else int(value)) if value else None
        Patch.row_probs = {}
        kv = "none" if variant == "none" else "dual"
        llm = LLM("cover-tiny", decoding="cover", kv_cache=kv, cache_refresh="adaptive",
                  max_num_seqs=1)
        row, _ = evaluate_one(llm, task, examples, "cover", None, None, False)
        print(json.dumps({"task": task.name, "variant": variant,
                          "acc": round(row.accuracy * 100, 2), "nfe": round(row.nfe, 3),
                          "refreshes": round(row.refreshes, 2),
                          "mflop_per_token": round(row.flops_per_token / 1e6, 3)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
