"""ModelRunner: turns a SchedulerOutput into one batched paged forward and the views' logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.attention import AttentionBackend, SeqLayout, build_metadata
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.worker.kv_cache import KVCache


@dataclass
class ModelRunnerOutput:
    logits: list[torch.Tensor]    # per work item: [view_len, V] float32, row i predicts view pos i


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, cache: KVCache):
        self.model, self.backend, self.cache = model, backend, cache
        self.shift = model.spec.logit_shift

    def _layout(self, out: SchedulerOutput):
        seqs, ids, positions, rows = [], [], [], []
        offset = 0
        for item in out.items:
            n, w0 = item.window_len, item.window_start
            view = torch.arange(item.view_start, item.view_end)
            pred = (view - self.shift).clamp(min=0) - w0            # predictor rows, window-relative
            for c, canvas in enumerate(item.canvases):
                seqs.append(SeqLayout(w0, n, canvas.key_slots, item.override if c == 0 else []))
                ids.append(canvas.input_ids)
                positions.append(torch.arange(w0, w0 + n))
                rows.append(pred + offset)
                offset += n
        return seqs, torch.cat(ids), torch.cat(positions), rows

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        seqs, ids, positions, rows = self._layout(out)
        meta = build_metadata(seqs)
        cache, backend = self.cache, self.backend

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return backend.forward(q, k, v, cache.layer(layer), meta)

        hidden = self.model.forward_tokens(self.model.embed(ids), positions, attn)
        logits = self.model.compute_logits(hidden[torch.cat(rows)]).float()
        per_canvas = list(logits.split([r.numel() for r in rows]))
        results = []
        for item in out.items:
            cond = per_canvas.pop(0)
            if len(item.canvases) == 2:
                uncond = per_canvas.pop(0)
                cond = uncond + (item.cfg_scale + 1.0) * (cond - uncond)
            results.append(cond)
        return ModelRunnerOutput(results)
