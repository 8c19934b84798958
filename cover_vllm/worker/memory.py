"""The memory budget: weights first, the KV pool from what is left, checked before anything is
allocated; and the process memory readings (/proc VmHWM) benchmarks and tests report.

On CPU every tensor-parallel rank shares the host's memory, so the weights of all ranks (the
sharded parts once, the replicated parts once per rank) plus the whole KV pool must fit in
`memory_utilization` x MemTotal. On a GPU each rank has its own device: its shard plus its
1/N of the pool must fit in `memory_utilization` x the device's memory. (`gpu_memory_utilization`,
vLLM's name, is the same fraction: EngineConfig.memory_fraction.)

The KV budget is the user's `kv_cache_memory_bytes` when given; otherwise room for
`max_num_seqs` canvases of the model's max length, capped at 2 GiB and at the larger of twice
the weights and 256 MiB (`default_kv_budget`), lowered to what the memory leaves after the
weights. The budget holds everything the cache allocates: pages, rings and COVER's scratch
slots (worker/kv_cache.py `KVLayout.plan`). If the weights plus one canvas of `canvas_tokens` cannot fit,
`plan_memory` raises ValueError with the numbers before a byte is allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from cover_vllm.config import EngineConfig
from cover_vllm.models.spec import ModelSpec

GiB = 1 << 30
DEFAULT_CANVAS_TOKENS = 1024      # "a request" for the budget check and the startup line
DEFAULT_KV_FLOOR_BYTES = 256 << 20    # a default pool may stay this size above twice the weights


def host_memory_bytes() -> int:
    """MemTotal of this host (from /proc/meminfo; sysconf elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _status_kib(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The process's peak resident memory (VmHWM: anonymous and mapped file pages alike)."""
    return _status_kib("VmHWM", pid) * 1024


def rss_bytes(pid: int | str = "self") -> int:
    return _status_kib("VmRSS", pid) * 1024


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int          # parameters of every rank (sharded once, replicated x ranks)
    kv_bytes: int              # the whole KV allocation (all ranks): pages + rings + scratch
    num_pages: int
    page_size: int             # tokens per page
    canvas_tokens: int         # the "default length" canvases are counted in
    capacity_bytes: int        # memory_utilization x host (CPU) or device memory
    kv_bytes_per_token: int    # of the paged layers
    num_rings: int = 0         # per-sequence sliding-layer rings (worker/kv_cache.py KVLayout)
    ring_len: int = 0          # slots of one ring
    budget_bytes: int = 0      # the KV budget pages, rings and scratch were planned from
                               # (every rank plans it the same way: the engine hands it on as
                               # kv_cache_memory_bytes)
    scratch_slots: int = 0     # behind the pages: COVER's seeds' fresh K/V (worker/kv_cache.py),
                               # inside the budget

    @property
    def scratch_bytes(self) -> int:
        """The scratch slots' K and V (all ranks), part of `kv_bytes`."""
        return self.scratch_slots * self.kv_bytes_per_token

    @property
    def page_bytes(self) -> int:
        """The pages' (and rings') K and V (all ranks): `kv_bytes` less the scratch."""
        return self.kv_bytes - self.scratch_bytes

    @property
    def canvases(self) -> int:
        pages_per_canvas = -(-self.canvas_tokens // self.page_size)
        fits = self.num_pages // pages_per_canvas
        return min(fits, self.num_rings) if self.ring_len else fits

    def startup_line(self) -> str:
        rings = (f" + {self.num_rings} sliding-window rings of {self.ring_len} slots"
                 if self.ring_len else "")
        scratch = (f" + {self.scratch_slots} scratch slots ({_size(self.scratch_bytes)})"
                   if self.scratch_slots else "")
        return (f"memory: weights {self.weight_bytes / GiB:.2f} GiB, KV cache "
                f"{_size(self.kv_bytes)} of a {_size(self.budget_bytes)} budget = "
                f"{self.num_pages} pages of {self.page_size} tokens{rings} "
                f"({_size(self.page_bytes)}){scratch}, fits {self.canvases} canvases of "
                f"{self.canvas_tokens} tokens (memory {self.capacity_bytes / GiB:.2f} GiB)")


def _size(nbytes: int) -> str:
    """GiB from 1 GiB up, MiB below."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.1f} MiB"


def weight_bytes(model: torch.nn.Module, world_size: int,
                 device: str = "cpu") -> tuple[int, int]:
    """(bytes of one rank, bytes of all ranks) of a meta model split over `world_size` ranks
    on `device` (a quantized Linear's buffers count as its weight, and a W8A8 kernel's own
    copy of them as what it keeps: models/quantization.py `kernel_extra_bytes`)."""
    from cover_vllm.distributed.tensor_parallel import param_slices
    from cover_vllm.models.quantization import kernel_extra_bytes, quantized_tensors

    named = [*model.named_parameters(), *quantized_tensors(model)]
    if world_size == 1:
        total = sum(p.numel() * p.element_size() for _, p in named)
        total += kernel_extra_bytes(model, device)
        return total, total
    sliced = param_slices(model, 0, world_size)
    extra = kernel_extra_bytes(model, device, sliced)
    sharded = replicated = 0                      # sharded: one rank's share of the split
    for name, p in named:
        nbytes = p.numel() * p.element_size()
        sl = sliced.get(name)
        # a quantized weight's buffers share its name, and a per-channel scale [n] of an
        # input-column split is whole on every rank (it has no dim `sl.dim`)
        if sl is not None and not sl.zero and p.dim() > sl.dim:
            sharded += nbytes * sl.size // sl.full    # 1/N, or a copied kv head
        else:
            replicated += nbytes
    per_rank = sharded + replicated + extra
    return per_rank, per_rank * world_size


def _is_quantized(model: torch.nn.Module) -> bool:
    from cover_vllm.models.quantization import quantized_tensors

    return next(quantized_tensors(model), None) is not None


def _capacity(config: EngineConfig) -> tuple[int, bool]:
    """(usable bytes, shared by all ranks?) for the configured device."""
    if str(config.device).startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        return int(config.memory_fraction * total), False
    return int(config.memory_fraction * host_memory_bytes()), True


def wants_scratch(decoding: str | None) -> bool:
    """Whether the engine's default decoding verifies seeds (strategies/base.py
    `verifies_seeds`: COVER), so that its cache gets scratch slots. A request that asks for
    COVER on an engine without them writes its seeds the slow way: the same tokens."""
    from cover_vllm.strategies import strategy_class

    return decoding is not None and getattr(strategy_class(decoding), "verifies_seeds", False)


def default_kv_budget(config: EngineConfig, layout, dtype: torch.dtype, max_model_len: int,
                      weights: int) -> int:
    """The KV budget when the user gives none: room for `max_num_seqs` canvases of
    `max_model_len` (each with its ring, where the model has rings), at most 2 GiB and at most
    the larger of twice the weights and DEFAULT_KV_FLOOR_BYTES (a small model gets a pool that
    fits it, not 2 GiB)."""
    full = config.kv_budget_bytes(layout.bytes_per_token(dtype), max_model_len,
                                  layout.ring_bytes(dtype))
    return min(full, max(2 * weights, DEFAULT_KV_FLOOR_BYTES))


def plan_memory(config: EngineConfig, spec: ModelSpec, model: torch.nn.Module) -> MemoryPlan:
    """Size the KV pool for `model` (the unsharded meta model in its final dtype): the budget
    (the user's `kv_cache_memory_bytes`, else `default_kv_budget` lowered to what the memory
    left after the weights allows) holds the pages, rings and scratch slots together."""
    from cover_vllm.worker.kv_cache import KVLayout, check_kv_budget

    n = config.tensor_parallel_size
    dtype = next(model.parameters()).dtype
    layout = KVLayout.of(model)
    per_token = layout.bytes_per_token(dtype)
    ring_bytes = layout.ring_bytes(dtype)
    page_bytes = per_token * config.page_size
    per_rank, all_ranks = weight_bytes(model, n, str(config.device))
    capacity, shared = _capacity(config)
    weights = all_ranks if shared else per_rank
    share = 1 if shared else n                   # a device holds 1/n of the pool
    canvas = min(spec.max_model_len, DEFAULT_CANVAS_TOKENS)
    canvas_bytes = -(-canvas // config.page_size) * page_bytes + ring_bytes
    left = capacity - weights
    where = ("host memory" if shared else "device memory")
    if weights + canvas_bytes // share > capacity:
        raise ValueError(
            f"{spec.family} weights need {weights / GiB:.2f} GiB and one {canvas}-token canvas "
            f"{canvas_bytes / share / GiB:.2f} GiB of KV cache, but {config.memory_option} "
            f"of the {where} allows {capacity / GiB:.2f} GiB; use "
            + ("a smaller dtype (bfloat16), " if dtype == torch.float32 else "")
            + ("" if _is_quantized(model) else "quantization (quantization='w8a8', 'int8' "
               "or 'int4'), ")
            + "more tensor-parallel ranks, or raise memory_utilization")
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
        if weights + budget // share > capacity:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} ({budget / GiB:.2f} GiB) plus the weights "
                f"({weights / GiB:.2f} GiB) exceed {config.memory_option}"
                f" of the {where} ({capacity / GiB:.2f} GiB); at most {left * share} bytes fit")
    else:
        budget = min(default_kv_budget(config, layout, dtype, spec.max_model_len, all_ranks),
                     left * share)
    kv = layout.plan(budget, config.page_size, dtype, config.max_num_seqs, canvas,
                     wants_scratch(config.decoding))
    kv_bytes = kv.num_pages * page_bytes + kv.num_rings * ring_bytes + kv.num_scratch * per_token
    plan = MemoryPlan(weights, kv_bytes, kv.num_pages, config.page_size, canvas, capacity,
                      per_token, kv.num_rings, layout.ring_len, budget, kv.num_scratch)
    check_kv_budget(config.kv_cache_memory_bytes, plan, spec.max_model_len)   # budget 10: no page
    return plan
