"""CanvasRunner: a uniform-state model's step (DiffusionGemma): the encoder writes what each
request has to encode, then one decoder forward denoises every canvas due a step.

Per step and CanvasItem: `encode_ids` (a prompt, or the canvas that just finished) go through
`model.encode_paged` in rounds of at most `KVLayout.encode_chunk` tokens per sequence (each
round one batched call), writing their K/V; then the canvases go through one batched
`model.decode_paged` against everything encoded. Full-attention layers keep every position in
the request's pages (`key_slots`); sliding-window layers keep each request in its ring
(slot = ring * ring_len + position mod ring_len: a ring holds window - 1 positions plus a chunk,
so a chunk never overwrites a key it or a later canvas reads).

Self-conditioning stays on the device: the decoder's logits are divided by each item's
temperature in place (the processed logits, what the sampler reads), and this runner keeps each
request's rows as the next step's `self_conditioning_logits`. Every tensor-parallel rank keeps
its own (the logits are replicated), so nothing crosses to the host or between ranks. The store
holds exactly the canvases of the last decoder call: a request whose canvas goes on has an item
every step, and one that finishes, starts a canvas or is aborted simply drops out of it.
"""

from __future__ import annotations

import time

import torch

from cover_vllm.models.diffusion_gemma_paged import DecodeBatch, EncodeBatch, KVTable, PagedKV
from cover_vllm.models.gemma4_config import SLIDING
from cover_vllm.scheduler.output import CanvasItem
from cover_vllm.step_plan import ModelRunnerOutput
from cover_vllm.worker.kv_cache import KVLayout


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """[C, V] rows -> [n, C, V]: a view when they are consecutive slices of one tensor (the
    usual case: the same canvases as the last step, in the same order), else a copy."""
    first = rows[0]
    step = first.numel()
    if all(r.is_contiguous() and r.shape == first.shape
           and r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and r.storage_offset() == first.storage_offset() + i * step
           for i, r in enumerate(rows)):
        return first.as_strided((len(rows), *first.shape), (step, *first.stride()),
                                first.storage_offset())
    return torch.stack(rows)


class CanvasRunner:
    def __init__(self, model: torch.nn.Module, kv: PagedKV, layout: KVLayout):
        self.model, self.kv, self.layout = model, kv, layout
        self.window, self.kinds = model.window, sorted(set(model.kinds))
        self.device = kv.k[0].device
        self._sc: dict[str, torch.Tensor] = {}    # request id -> [C, V] last processed logits
        self._prepare_s = 0.0

    @torch.inference_mode()
    def execute(self, items: list[CanvasItem]) -> ModelRunnerOutput:
        self._prepare_s = 0.0        # host time laying the calls out (the step's "prepare")
        pending = [(item, item.encode_start, item.encode_ids) for item in items
                   if item.encode_ids is not None]
        chunk = self.layout.encode_chunk
        while pending:                           # rounds of at most `chunk` tokens a sequence
            self._encode([(item, s, ids[:chunk]) for item, s, ids in pending])
            pending = [(item, s + chunk, ids[chunk:]) for item, s, ids in pending
                       if ids.numel() > chunk]
        logits, raw = self._decode(items)
        return ModelRunnerOutput([], prepare_s=self._prepare_s, canvas_logits=logits,
                                 canvas_raw=raw)

    # ---- where positions live ----------------------------------------------------------------
    def _slots(self, item: CanvasItem, positions: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == SLIDING:
            return item.ring * self.layout.ring_len + positions % self.layout.ring_len
        return item.key_slots[positions]

    def _table(self, spans: list[tuple[CanvasItem, int, int]], kind: str) -> KVTable:
        """Keys of each (item, first, end) span: positions first..end-1 (-1 pads)."""
        width = max(1, max(end - first for _, first, end in spans))
        slots = torch.zeros(len(spans), width, dtype=torch.long)
        positions = torch.full((len(spans), width), -1, dtype=torch.long)
        for i, (item, first, end) in enumerate(spans):
            pos = torch.arange(first, end)
            slots[i, :pos.numel()] = self._slots(item, pos, kind)
            positions[i, :pos.numel()] = pos
        return KVTable(slots.to(self.device), positions.to(self.device))

    def _first_key(self, start: int, kind: str) -> int:
        """The earliest position a chunk or canvas starting at `start` reads on `kind` layers."""
        return max(0, start - (self.window - 1)) if kind == SLIDING else 0

    # ---- the two calls -----------------------------------------------------------------------
    def _encode(self, chunks: list[tuple[CanvasItem, int, torch.Tensor]]) -> None:
        start = time.perf_counter()
        positions = [torch.arange(s, s + ids.numel()) for _, s, ids in chunks]
        write = {kind: torch.cat([self._slots(item, pos, kind)
                                  for (item, _, _), pos in zip(chunks, positions)])
                 for kind in self.kinds}
        keys = {kind: self._table([(item, self._first_key(s, kind), s + ids.numel())
                                   for item, s, ids in chunks], kind) for kind in self.kinds}
        batch = EncodeBatch(
            input_ids=torch.cat([ids for _, _, ids in chunks]).to(self.device),
            positions=torch.cat(positions).to(self.device),
            seq_lens=[int(ids.numel()) for _, _, ids in chunks],
            write_slots={k: v.to(self.device) for k, v in write.items()}, keys=keys)
        self._prepare_s += time.perf_counter() - start
        self.model.encode_paged(batch, self.kv)

    def _decode(self, items: list[CanvasItem]):
        """Per item: processed logits [C, V] (None: encode only) and raw ones (if wanted)."""
        out, out_raw = [None] * len(items), [None] * len(items)
        rows = [i for i, item in enumerate(items) if item.canvas_ids is not None]
        if not rows:
            self._sc = {}
            return out, out_raw
        start = time.perf_counter()
        dec = [items[i] for i in rows]
        c = dec[0].canvas_ids.numel()
        canvases = torch.stack([item.canvas_ids for item in dec]).to(self.device)
        positions = torch.stack([torch.arange(item.canvas_start, item.canvas_start + c)
                                 for item in dec]).to(self.device)
        keys = {kind: self._table([(item, self._first_key(item.canvas_start, kind),
                                    item.canvas_start) for item in dec], kind)
                for kind in self.kinds}
        fed = [j for j, item in enumerate(dec) if item.self_conditioning]
        sc = sc_rows = None
        if fed:
            sc = _stacked([self._sc[dec[j].request_id] for j in fed])
            if len(fed) < len(dec):
                sc_rows = torch.tensor(fed, dtype=torch.long, device=self.device)
        self._prepare_s += time.perf_counter() - start
        logits = self.model.decode_paged(DecodeBatch(canvases, positions, keys, sc, sc_rows),
                                         self.kv)                              # [B, C, V]
        raw = {j: logits[j].clone() for j, item in enumerate(dec) if item.want_logits}
        temps = torch.tensor([item.temperature for item in dec], dtype=torch.float32)
        logits.div_(temps.to(self.device)[:, None, None])          # processed, in place
        self._sc = {item.request_id: logits[j] for j, item in enumerate(dec)}
        for j, i in enumerate(rows):
            out[i], out_raw[i] = logits[j], raw.get(j)
        return out, out_raw
