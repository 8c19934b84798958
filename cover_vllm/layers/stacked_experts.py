"""MoE experts stored stacked, as the checkpoint holds them: `gate_up_proj` [E, 2M, H] (per
expert rows 0..M-1 gate, M..2M-1 up) and `down_proj` [E, H, M] (DiffusionGemma / Gemma 4).

Expert e: down_proj[e] @ (act(gate) * up) with gate, up = split(gate_up_proj[e] @ x); the
caller's routing weights scale each output and the outputs are summed (accumulated in fp32).
One matmul per expert over the tokens routed to it.

Tensor parallel (`parallel_plan`): each expert is split like a dense MLP, its intermediate width
M sliced (gate_up along dim 1, its gate and up halves each 1/N; down along dim 2), left
unreduced, and the block's summed output is all-reduced once; the router outside is replicated.

Weight-only quantization (models/quantization.py calls these hooks, as for a module's Linears):
`quantize_stacked` turns both tensors into per-expert codes and scales (buffers
`{name}_qweight`, `{name}_weight_scale`, `{name}_weight_zero`, one [E, ...] stack each, the
layout of `QuantConfig.storage`), `load_stacked` fills them a few experts at a time from the
checkpoint (never a whole tensor in the model dtype), `pack_stacked` hands each expert to the
device's kernel (quantization/kernels.py `make_kernel`; the CPU int4 pack rewrites the
codes in place and the stacked scales are then freed: each kernel holds its own).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.layers.base import ParallelPlan
from cover_vllm.layers.base import Slice
from cover_vllm.layers.quantization.format import QuantConfig, dequantize, quantize_rows
from cover_vllm.layers.quantization.kernels import Int4CpuKernel, make_kernel

NAMES = ("gate_up_proj", "down_proj")
LOAD_CHUNK_BYTES = 16 << 20         # experts staged at once while quantizing (model dtype)


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, width: int,
                 act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.num_experts, self.width, self.act = num_experts, width, act
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.quant_config: QuantConfig | None = None
        self._kernels: dict[str, list] | None = None      # pack_stacked: name -> per expert

    def parallel_plan(self) -> ParallelPlan:
        m = self.width
        return ParallelPlan(param_splits={"gate_up_proj": (1, (m, m)), "down_proj": (2, (m,))},
                            reduce_output=True)

    # ---- forward ---------------------------------------------------------------------------
    def _matmul(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] through expert e's `name` weight -> [n, out]."""
        if self._kernels is not None:
            return self._kernels[name][e](x)
        if self.quant_config is not None:
            w = dequantize(self._expert_buffers(name, e), self.quant_config)
            return F.linear(x, w.to(x.dtype))
        return F.linear(x, getattr(self, name)[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights [T, k] (fp32) and expert ids [T, k] -> [T, H] in x.dtype.
        On the CPU one matmul per expert (its row count read on the host, which costs
        nothing there); on any other device in bf16 `grouped` (no host sync)."""
        if x.device.type != "cpu" and x.dtype == torch.bfloat16:
            return self.grouped(x, weights, chosen)
        k = chosen.shape[1]
        flat = chosen.reshape(-1)                               # [T * k], token-major
        order = flat.argsort(stable=True)                       # slots grouped by expert
        token = order // k
        slot_weight = weights.reshape(-1)[order, None]          # [T * k, 1] fp32
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            rows = token[start:start + count]
            gate, up = self._matmul("gate_up_proj", e, x[rows]).chunk(2, dim=-1)
            y = self._matmul("down_proj", e, self.act(gate) * up)
            out.index_add_(0, rows, y.float() * slot_weight[start:start + count])
            start += count
        return out.to(x.dtype)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
        """`forward` as two grouped GEMMs (`F.grouped_mm`) over the rows sorted by expert, the
        group ends found on the device (searchsorted), so the host never waits: the path of a
        GPU (bf16, SM >= 80) and of the shapes-only meta device. Quantized experts are
        dequantized whole for it (a fused int4 grouped kernel is left to a GPU backend)."""
        k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        experts = torch.arange(self.num_experts, device=x.device, dtype=flat.dtype)
        ends = torch.searchsorted(flat.index_select(0, order), experts, right=True).int()
        gate, up = F.grouped_mm(x.index_select(0, token), self._stacked("gate_up_proj", x),
                                offs=ends).chunk(2, dim=-1)
        y = F.grouped_mm(self.act(gate) * up, self._stacked("down_proj", x), offs=ends)
        slot_weight = weights.reshape(-1).index_select(0, order)[:, None]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, token, y.float() * slot_weight).to(x.dtype)

    def _stacked(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """[E, in, out]: every expert's `name` weight, transposed for `grouped_mm`."""
        if self.quant_config is None:
            return getattr(self, name).transpose(1, 2)
        bufs = self._expert_buffers(name, slice(None))               # [E, n, ...] each
        e, n = bufs["qweight"].shape[:2]
        whole = dequantize({k: b.flatten(0, 1) for k, b in bufs.items()}, self.quant_config)
        return whole.view(e, n, -1).to(x.dtype).transpose(1, 2)

    # ---- weight-only quantization hooks (models/quantization.py) -------------------------
    def check_stacked(self, config: QuantConfig, world_size: int = 1) -> None:
        """ValueError unless int4's group divides every input width on every rank."""
        if config.method != "int4":
            return
        for name, k in (("gate_up_proj", self.gate_up_proj.shape[2]),
                        ("down_proj", self.width // world_size)):
            if k % config.group_size:
                raise ValueError(f"quantization={config.label!r}: experts.{name} has {k} input "
                                 f"columns per rank, not a multiple of the group size "
                                 f"{config.group_size}; use int4:G with G dividing {k}, or int8")

    def quantize_stacked(self, config: QuantConfig) -> int:
        """Replace both stacked weights (meta, a rank's shard) by empty quantized buffers."""
        self.check_stacked(config)
        for name in NAMES:
            weight = self._parameters.pop(name)
            e, n, k = weight.shape
            for key, (shape, dtype) in config.storage(n, k, weight.dtype).items():
                self.register_buffer(f"{name}_{key}", torch.empty((e, *shape), dtype=dtype,
                                                                  device=weight.device))
        self.quant_config = config
        return 2 * self.num_experts

    def _expert_buffers(self, name: str, e: int | slice) -> dict[str, torch.Tensor]:
        return {key[len(name) + 1:]: buf[e] for key, buf in self._buffers.items()
                if key.startswith(name + "_")}

    def stacked_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(weight name, buffer) of the quantized storage, for weight-byte counts."""
        for key, buf in self._buffers.items():
            for name in NAMES:
                if key.startswith(name + "_"):
                    yield name, buf

    @torch.no_grad()
    def load_stacked(self, source, prefix: str, slices: dict[str, Slice]) -> set[str]:
        """Quantize checkpoint tensors `{prefix}.{name}` (their TP slices) into the buffers, a
        few whole experts at a time; returns the names it loaded."""
        config, loaded = self.quant_config, set()
        for name in NAMES:
            full_name, sl = f"{prefix}.{name}", slices.get(f"{prefix}.{name}")
            bufs = {key[len(name) + 1:]: buf for key, buf in self._buffers.items()
                    if key.startswith(name + "_")}
            dtype = bufs["weight_scale"].dtype
            e, n = bufs["qweight"].shape[:2]
            k = bufs["qweight"].shape[2] * (2 if config.method == "int4" else 1)
            want = sl.full_shape((e, n, k)) if sl is not None else (e, n, k)
            got = source.shape(full_name)
            if got is not None and tuple(got) != want:
                raise ValueError(f"{full_name}: checkpoint shape {tuple(got)} != model shape "
                                 f"{want}")
            loaded.add(full_name)
            if bufs["qweight"].device.type == "meta":
                continue                  # a shapes-only model: checked, nothing to read
            per = max(1, LOAD_CHUNK_BYTES // (want[1] * want[2] * dtype.itemsize))
            for first in range(0, e, per):
                count = min(per, e - first)
                stage = torch.empty((count, *want[1:]), dtype=dtype)
                source.fill(full_name, stage, Slice(0, first, count, e))
                amax = stage.abs().amax(dim=2) if sl is not None and sl.dim == 2 else None
                stage = sl.take(stage) if sl is not None else stage
                for j in range(count):
                    parts = quantize_rows(stage[j], config, dtype,
                                          None if amax is None else amax[j])
                    for key, value in parts.items():
                        bufs[key][first + j].copy_(value)
        return loaded

    @torch.no_grad()
    def pack_stacked(self) -> bool:
        """One kernel per expert and weight (quantization/kernels.py `make_kernel`); the stacked
        scales are freed when every kernel keeps its own copy (CPU int4). Returns whether it packed."""
        if self.quant_config is None or self._kernels is not None:
            return False
        kernels = {name: [make_kernel(self._expert_buffers(name, e), self.quant_config, None)
                          for e in range(self.num_experts)] for name in NAMES}
        self._kernels = kernels
        if all(isinstance(kern, Int4CpuKernel) for ks in kernels.values() for kern in ks):
            for key, buf in list(self._buffers.items()):
                if not key.endswith("_qweight"):
                    self._buffers[key] = buf.new_empty((0, *buf.shape[1:]))
        return True
