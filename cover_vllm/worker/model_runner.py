"""ModelRunner: turns a SchedulerOutput into one batched paged forward and the views' logits.

The flat token axis holds every canvas window (cond, then uncond for cfg) item by item, then the
items' extra query rows (attention/base.py), laid out by worker/batch_layout.py. Embedding edits are applied right after
`model.embed`; extra rows' logits come back raw, per item. Everything the forward returns stays
on the model's device (the strategies decide there, engine/decide.py), except the attention mass
the host's refresh policy reads: one small copy, in steps where an item asked for it.
"""

from __future__ import annotations

import time
import torch

from cover_vllm.attention import AttentionBackend, build_metadata
from cover_vllm.attention.layout import move_to
from cover_vllm.host_transfer import HostTransfer
from cover_vllm.layers.base import kv_halves
from cover_vllm.layers.yarn import positions_below, yarn_ropes
from cover_vllm.scheduler.output import SchedulerOutput, WorkItem
from cover_vllm.step_plan import ModelRunnerOutput
from cover_vllm.worker.batch_layout import Layout, lay_out, stat_rows
from cover_vllm.worker.canvas_runner import CanvasRunner
from cover_vllm.worker.cuda_graphs import GraphRunner
from cover_vllm.worker.embed_edits import apply_embed_edits
from cover_vllm.worker.graph_backends import CaptureBackend
from cover_vllm.worker.kv_cache import KVCache
from cover_vllm.worker.logit_rows import read_rows, spread_rows
from cover_vllm.worker.scoring import score_forward
from cover_vllm.worker.step_stats import attention_in_mass, key_drift, select_flat


class _Stats:
    """Collects attention in-mass (and, when a strategy reads it, key drift) on one layer during
    the forward (on the model's device, where the strategies read them)."""

    def __init__(self, layer: int, host_real: torch.Tensor,
                 rows: tuple[torch.Tensor, torch.Tensor], num_tokens: int | None,
                 device: torch.device):
        """`rows`: `select_flat`'s (index, real) of each sequence's still-masked view rows, on
        the device (moved with the step's one copy); `host_real`: real on the host."""
        self.layer, self.any_rows = layer, bool(host_real.any())
        self.index, self.real = rows
        # [T] key drift; None when no item's strategy reads it (the refresh gate's mass only)
        self.drift = None if num_tokens is None else torch.zeros(num_tokens, device=device)
        self.attn_in: torch.Tensor | None = None     # [B, Kmax]; None: no masked row


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, cache: KVCache,
                 canvas: CanvasRunner | None = None, capture: CaptureBackend | None = None):
        self.model, self.backend, self.cache = model, backend, cache
        self.canvas = canvas        # uniform-state canvases (worker/canvas_runner.py)
        self.shift = model.spec.logit_shift
        self.masked_logits = True   # the LM head only on rows a decision reads (logit_rows.py)
        self.device = cache.k[0].device         # the model's: every tensor it sees is built here
        self.transfer = HostTransfer()          # counts the copies to the host (benchmarks)
        pad_slot = getattr(cache, "pad_slot", None)
        # rotations told the step's largest position (layers/yarn.py `positions_below`)
        self.bounded_ropes = yarn_ropes(model)
        # CUDA graphs of the forward (worker/cuda_graphs.py); None: always eager
        self.graphs = (None if capture is None or pad_slot is None else
                       GraphRunner(self._forward, capture, pad_slot, self.device))

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Lay the batch out on the host, move it to the model's device once, run the forward
        there, and return the logits (and statistics) the strategies read, on that device."""
        if out.canvas_items:            # a uniform-state model's step: its own pass
            return self.canvas.execute(out.canvas_items)
        start = time.perf_counter()
        device = self.device
        copies, moved = self.transfer.copies, self.transfer.bytes
        lay = lay_out(out, self.shift)
        host_ids, host_positions = torch.cat(lay.ids), torch.cat(lay.positions)
        scratch = getattr(self.cache, "scratch", None)
        measured = any(item.want_stats or item.want_mass for item in out.items)
        graph = (None if self.graphs is None or measured or lay.edits else
                 self.graphs.prepare(lay.seqs, host_ids, host_positions, scratch))
        extra_rows = [r for r in lay.extra_rows if r is not None]
        host_rows = torch.cat(lay.rows + extra_rows) if out.items else None
        keep = self._read_rows(out, lay, host_ids, extra_rows)   # None: every view row
        if keep is not None:
            host_rows, keep = host_rows[keep], keep.nonzero().flatten().to(device)
        selected = ()          # the statistics' rows (select_flat), built on the host
        if measured:
            selected = select_flat(stat_rows(lay, host_ids, self.model.spec.mask_token_id),
                                   [s.window_len for s in lay.seqs[:len(lay.rows)]])
        if graph is None:                               # eager: one copy to the device
            meta, (ids, positions, logit_rows, *moved_rows) = move_to(
                device, build_metadata(lay.seqs, "cpu", scratch), host_ids, host_positions,
                host_rows, *selected)
        else:                                           # the graph's inputs are in place
            logit_rows = None if host_rows is None else host_rows.to(device)
        prepare_s = time.perf_counter() - start
        stats = None
        if measured:
            drift = any(item.want_stats for item in out.items)
            stats = _Stats(self.model.dims.num_layers - 1, selected[1], tuple(moved_rows),
                           ids.numel() if drift else None, device)
        if graph is not None:
            hidden = graph()
        else:
            embeds = self.model.embed(ids)
            if lay.edits:
                edits = [(flat.to(device), edit) for flat, edit in lay.edits]
                embeds = apply_embed_edits(self.model.embed, embeds, edits)
            with positions_below(self.bounded_ropes, host_positions):
                hidden = self.model.forward_tokens(embeds, positions,
                                                   self._attention(meta, stats))
        scores = None if lay.scores is None else score_forward(self.model, hidden, lay.scores,
                                                               self.transfer.fetch)
        if not out.items:                          # a scoring-only forward
            return ModelRunnerOutput([], prepare_s=prepare_s, scores=scores,
                                     host_copies=self.transfer.copies - copies,
                                     host_bytes=self.transfer.bytes - moved)
        logits = self.model.compute_logits(hidden.index_select(0, logit_rows))
        sizes = [r.numel() for r in lay.rows + extra_rows]
        if keep is not None:
            logits = spread_rows(logits, keep, sum(sizes))
        if any(valid is not None for valid in lay.row_valid):
            logits, sizes = self._full_views(logits, lay)
        per_canvas = list(logits.float().split(sizes))
        results = []
        for item in out.items:
            cond = per_canvas.pop(0)
            if len(item.canvases) == 2:
                uncond = per_canvas.pop(0)
                cond = uncond + (item.cfg_scale + 1.0) * (cond - uncond)
            results.append(cond)
        extra_logits = None
        if extra_rows:                             # what is left: the extra rows, item order
            extra_logits = [None if r is None else per_canvas.pop(0) for r in lay.extra_rows]
        if stats is None:
            return ModelRunnerOutput(results, prepare_s=prepare_s, extra_logits=extra_logits,
                                     scores=scores, host_copies=self.transfer.copies - copies,
                                     host_bytes=self.transfer.bytes - moved)
        drift, attn_in, columns = self._split_stats(out, stats)
        mass, columns = _cached_mass(out, self.transfer.fetch(columns))
        return ModelRunnerOutput(results, drift, attn_in, prepare_s=prepare_s,
                                 extra_logits=extra_logits, cached_mass=mass,
                                 column_mass=columns, scores=scores,
                                 host_copies=self.transfer.copies - copies,
                                 host_bytes=self.transfer.bytes - moved)

    def _read_rows(self, out: SchedulerOutput, lay: Layout, ids: torch.Tensor,
                   extra_rows: list[torch.Tensor]) -> torch.Tensor | None:
        """[rows] bool: the logit rows the LM head computes (worker/logit_rows.py), extra rows
        always; None: all of them (`masked_logits` off, not the CPU, sparse windows)."""
        if not (self.masked_logits and out.items and self.device.type == "cpu") or \
                any(valid is not None for valid in lay.row_valid):
            return None
        keep = read_rows(out.items, lay.rows, ids, self.model.spec.mask_token_id, self.shift)
        if keep is None or not extra_rows:
            return keep
        return torch.cat([keep] + [torch.ones(r.numel(), dtype=torch.bool) for r in extra_rows])

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The forward a CUDA graph captures: the eager one, without statistics or edits."""
        return self.model.forward_tokens(self.model.embed(ids), positions,
                                         self._attention(meta, None))

    def _attention(self, meta, stats: _Stats | None):
        """The AttentionFn of one forward: the paged backend over this runner's cache, which
        also records the statistics on their layer."""
        cache, backend = self.cache, self.backend

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor | None = None) -> torch.Tensor:
            if stats is None or layer != stats.layer:
                return backend.forward(q, k, v, cache.layer(layer), meta)
            if stats.drift is not None:
                old = cache.k[layer].index_select(0, meta.write_slots)
            o, keys = backend.forward(q, k, v, cache.layer(layer), meta, return_keys=True)
            if stats.drift is not None:
                fresh_k = k if v is not None else kv_halves(k)[0]    # v None: k is K and V
                written = fresh_k.index_select(0, meta.write_index)
                stats.drift.index_copy_(0, meta.write_index, key_drift(written, old))
            if stats.any_rows:                 # else no row is still masked: no mass to measure
                stats.attn_in = attention_in_mass(q, keys, meta, stats.index, stats.real)
            return o

        return attn

    def _full_views(self, logits: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, list[int]]:
        """Sparse windows compute logits only on their rows: lay every canvas's whole view back
        to back in one [sum view_len + extra rows, V] tensor, zero rows where a view position has
        no row, so the strategies read the views as slices of it (engine/decide.py stacks
        adjacent equal slices without copying). Returns it and the per-piece row counts."""
        sizes, dest, offset = [], [], 0
        for rows, valid in zip(lay.rows, lay.row_valid):
            n = rows.numel() if valid is None else valid.numel()
            span = torch.arange(offset, offset + n)
            dest.append(span if valid is None else span[valid])
            sizes.append(n)
            offset += n
        for rows in lay.extra_rows:
            if rows is not None:
                dest.append(torch.arange(offset, offset + rows.numel()))
                sizes.append(rows.numel())
                offset += rows.numel()
        dest = torch.cat(dest)
        missing = torch.ones(offset, dtype=torch.bool)
        missing[dest] = False
        full = logits.new_empty(offset, logits.shape[-1])
        full.index_copy_(0, dest.to(self.device), logits)
        full.index_fill_(0, missing.nonzero().flatten().to(self.device), 0.0)
        return full, sizes

    @staticmethod
    def _view_values(item: WorkItem, values: torch.Tensor) -> torch.Tensor:
        """Per-window-row values [window_len] -> per view position [view_len] (0 where a
        sparse window has no row)."""
        if item.window_positions is None:
            return values[item.view_start - item.window_start:item.view_end - item.window_start]
        out = values.new_zeros(item.view_end - item.view_start)
        pos = item.window_positions                               # host
        rows = ((pos >= item.view_start) & (pos < item.view_end)).nonzero().flatten()
        dest = (pos[rows] - item.view_start).to(values.device)
        return out.index_copy_(0, dest, values.index_select(0, rows.to(values.device)))

    @staticmethod
    def _split_stats(out: SchedulerOutput, stats: _Stats):
        """Per item: drift and in-mass over its view (items whose strategy reads them), and the
        masked rows' attention per key column [L] (items measured at all, while a masked row
        is left), all on the model's device; a few split ops for the whole batch, however many
        items (issue #42)."""
        n = len(out.items)
        drift, attn_in, columns = [None] * n, [None] * n, [None] * n
        drift_spans, view_spans, column_spans = [], [], []
        offset, seq, k_max = 0, 0, None if stats.attn_in is None else stats.attn_in.shape[1]
        for i, item in enumerate(out.items):
            ws, w = item.window_start, item.window_len
            if item.want_stats:
                if item.window_positions is None:       # the view's rows of the window
                    lo = min(max(item.view_start - ws, 0), w)
                    drift_spans.append((i, offset + lo,
                                        offset + min(max(item.view_end - ws, lo), w)))
                else:                                   # the whole sparse window
                    drift_spans.append((i, offset, offset + w))
                base = 0 if k_max is None else seq * k_max
                view_spans.append((i, base + item.view_start, base + item.view_end))
            if (item.want_stats or item.want_mass) and k_max is not None:
                column_spans.append((i, seq * k_max,
                                     seq * k_max + item.canvases[0].key_slots.numel()))
            offset += w * len(item.canvases)
            seq += len(item.canvases)
        for (i, _, _), piece in zip(drift_spans, _pieces(stats.drift, drift_spans)):
            item = out.items[i]
            drift[i] = piece if item.window_positions is None else ModelRunner._view_values(
                item, piece)
        if stats.attn_in is None:
            lengths = [end - start for _, start, end in view_spans]
            zeros = stats.drift.new_zeros(sum(lengths)).split(lengths) if lengths else []
            for (i, _, _), piece in zip(view_spans, zeros):
                attn_in[i] = piece
            return drift, attn_in, columns
        flat = stats.attn_in.reshape(-1)                          # [B * Kmax]
        for (i, _, _), piece in zip(view_spans, _pieces(flat, view_spans)):
            attn_in[i] = piece
        for (i, _, _), piece in zip(column_spans, _pieces(flat, column_spans)):
            columns[i] = piece
        return drift, attn_in, columns


def _pieces(flat: torch.Tensor | None, spans: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The slices [start, end) of a 1-D tensor at (item, start, end) spans (ascending, disjoint),
    cut by one split op."""
    if not spans:
        return []
    sizes, pos = [], 0
    for _, start, end in spans:
        sizes += [start - pos, end - start]
        pos = end
    sizes.append(flat.numel() - pos)
    return list(flat.split(sizes))[1::2]


def _cached_mass(out: SchedulerOutput, columns: list[torch.Tensor | None]):
    """Per item, from its host column masses [L]: the share of the still-masked view rows'
    attention on keys outside the view (None: no such row), and the columns (None likewise)."""
    mass = []
    for item, column in zip(out.items, columns):
        total = 0.0 if column is None else float(column.sum())
        if total > 0:                            # the rows' mass sums to their count
            mass.append(1.0 - float(column[item.view_start:item.view_end].sum()) / total)
        else:
            mass.append(None)
    return mass, [c if m is not None else None for c, m in zip(columns, mass)]
