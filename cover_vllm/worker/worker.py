"""Worker: owns the model weights, the KV cache and the model runner on one device (one rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cover_vllm.attention import get_backend
from cover_vllm.config import EngineConfig
from cover_vllm.distributed.tensor_parallel import param_slices
from cover_vllm.layers.batch_invariant import invariant_context
from cover_vllm.layers.common import pack_projections, use_fast_norm
from cover_vllm.layers.rotary import reserve_rope_tables
from cover_vllm.models.builtin import ResolvedModel
from cover_vllm.models.loader import build_model, materialize, resolve_dtype, weight_source
from cover_vllm.models.nemotron_cache import run_pieces
from cover_vllm.models.nemotron_lora import load_draft_adapter
from cover_vllm.models.quantization import load_quantized, quantize_model
from cover_vllm.models.spec import ModelSpec
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.step_plan import ModelRunnerOutput
from cover_vllm.worker.allocator import keep_activations_on_heap, map_large_allocations
from cover_vllm.worker.canvas_runner import CanvasRunner
from cover_vllm.worker.cuda_graphs import capture_backend_for
from cover_vllm.worker.kv_cache import KVCache, KVLayout
from cover_vllm.worker.memory import (DEFAULT_CANVAS_TOKENS, default_kv_budget, peak_rss_bytes,
                                     wants_scratch, weight_bytes)
from cover_vllm.worker.model_runner import ModelRunner
from cover_vllm.worker.threads import apply_num_threads

if TYPE_CHECKING:
    from cover_vllm.distributed.tensor_parallel import TensorParallel


def rank_device(device: str, rank: int) -> str:
    """The device of tensor-parallel rank `rank`: "cuda" becomes "cuda:<rank mod visible>" (a
    Ray actor sees only its own GPU); any other device string is used as given."""
    if device != "cuda":
        return device
    return f"cuda:{rank % max(1, torch.cuda.device_count())}"


class Worker:
    """The model is built on the meta device, sharded there under `tp`, then given storage and
    filled from its weight source (models/loader.py), so a rank holds its shard and nothing more.

    With `tp` (tensor parallelism) the loaded model is sliced to this rank's shard and the
    cache holds only this rank's kv heads; the page count is the same on every rank (and as
    with tensor_parallel_size=1): the KV budget is for the whole model, split over the ranks."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, spec: ModelSpec,
                 tp: TensorParallel | None = None):
        apply_num_threads(config.num_threads, spec.hidden_size, config.tensor_parallel_size)
        device = rank_device(config.device, tp.rank if tp is not None else 0)
        dtype = resolve_dtype(config.dtype, spec, config.device)
        model = build_model(spec, dtype, "meta")                # no storage yet
        layout = KVLayout.of(model)                             # whole model, all kv heads
        budget = config.kv_cache_memory_bytes                   # the engine's plan, else its
        if budget is None:                                      # default (a Worker on its own)
            budget = default_kv_budget(config, layout, dtype, spec.max_model_len,
                                       weight_bytes(model, 1)[0])
        source = weight_source(resolved, model, config.load_format, config.seed)
        slices = None
        if tp is not None:
            slices = param_slices(model, tp.rank, tp.world_size)
            tp.shard(model)                                     # model.dims: local heads now
        quantize_model(model, config.quantization)              # a rank quantizes its shard
        if torch.device(device).type == "cpu":
            map_large_allocations()             # weights and load temporaries: their own pages
        materialize(model, device)                              # this rank's shard only
        load_quantized(model, source, slices, pack=True)        # = load_into if unquantized
        pack_projections(model)         # CPU bf16: oneDNN-blocked weights, same bits; quantized:
                                        # the kernel's layout
        use_fast_norm(model, config.fast_norm)          # default: the official norm order
        self.model = model.eval().requires_grad_(False)
        reserve_rope_tables(model, spec.max_model_len)         # off the CPU: angles tabulated
        plan = layout.plan(budget, config.page_size, dtype, config.max_num_seqs,
                           min(spec.max_model_len, DEFAULT_CANVAS_TOKENS),
                           wants_scratch(config.decoding))          # = the engine's MemoryPlan
        num_pages, num_rings = plan.num_pages, plan.num_rings
        self.tp, self.num_pages, self.slices = tp, num_pages, slices
        capture = None
        if layout.ring_len:             # per-layer pools, sliding layers in rings (DiffusionGemma)
            self.cache = model.allocate_kv(num_pages * config.page_size,
                                           num_rings * layout.ring_len)
            canvas = CanvasRunner(self.model, self.cache, layout)
        else:
            capture = capture_backend_for(config, device)       # None: eager (cuda_graphs.py)
            self.cache = KVCache(model.dims, num_pages, config.page_size, dtype, device,
                                 plan.num_scratch,
                                 pad_slot=capture is not None)
            canvas = None
        if torch.device(device).type == "cpu":  # after the weights and the KV cache, which keep
            keep_activations_on_heap()          # their own mappings (freed: back to the OS)
        self.runner = ModelRunner(self.model, get_backend(config.attention_backend), self.cache,
                                  canvas, capture)
        # batch_invariant: every forward under one mode (its measured kernel policies persist)
        self.invariant = invariant_context(config.batch_invariant, device)
        if config.batch_invariant:      # which rows reach the LM head depends on the batch
            self.runner.masked_logits = False

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with self.invariant:
            result = self.runner.execute_model(out)
        return result if self.tp is None else self.tp.reduce_stats(result)

    def run_pieces(self, cache, pieces: list) -> list[torch.Tensor]:
        """One batched forward of Nemotron's decodings (models/nemotron_cache.py) over `cache`
        (the runner's PagedSlots over this worker's pool, or a standalone SlotCache)."""
        return run_pieces(self.model, cache, pieces)

    def draft_adapter(self, model_dir):
        """The checkpoint's LoRA draft adapter on this worker's model (its shard under tensor
        parallelism), loaded once; None when the checkpoint has none."""
        return getattr(self.model, "draft_adapter", None) or load_draft_adapter(
            self.model, model_dir, self.slices)

    def peak_memory_bytes(self) -> list[int]:
        """Peak resident memory (VmHWM) of this process, as a one-rank list."""
        return [peak_rss_bytes()]

    def check_health(self) -> None:
        """In-process: nothing can die independently of the engine."""

    def shutdown(self) -> None:
        """Nothing to stop in-process (the executor protocol, executor/base.py)."""
