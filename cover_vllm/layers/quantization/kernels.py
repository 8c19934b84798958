"""The matmuls of weight-only quantized projections, and the storage of one quantized group
(W8A8's matmuls: w8a8_kernels.py, chosen here by `make_kernel` too).

`QuantizedGroup` is the quantized half of a `FusedLinears` group (`FusedLinears.quant`): `fuse`
lays its Linears' buffers (and biases) side by side in one tensor each, as FusedLinears does for
plain weights, so q|k|v or gate|up still run as one matmul; `pack` hands those tensors to the
kernel of the device (`make_kernel`). Until then `__call__` is the slow reference: each Linear's
dequantized weight through F.linear (format.reference_linear).

Kernels: no hand-written matmul; the choice (`make_kernel`) is by measurement on this project's
CPU (AMD EPYC, AVX-512 with BF16, no AMX; scripts/quant_kernels.py, one thread, LLaDA-8B's
q|k|v [12288, 4096], ms per call at 32 / 256 rows; docs/benchmarks.md "Quantized weights"):

  bf16 activations: bf16 oneDNN-packed 7.98 / 60.2 (the unquantized engine);
    int8 `TiledKernel` 14.0 / 68.6; `torch._weight_int8pack_mm` 27.9 / 274;
    int8 dequantize whole + F.linear 59.5 / 122; torchao Int8WeightOnlyConfig 65.7 / 124;
    int4 `torch._weight_int4pack_mm_for_cpu` 17.6 / 190; int4 `TiledKernel` 132 / 193
    (torchao's int4 needs a package not installable here).
  fp32 activations: fp32 F.linear 48.8 / 312; int8 `TiledKernel` 44.0 / 304; int4
    `TiledKernel` 97.4 / 370; torch's packed int8 / int4 kernels take seconds per call (their
    fp32 path is scalar here).

So on a CPU: int8 -> `TiledKernel`; int4 -> torch's int4 pack in bf16 (fp16), `TiledKernel` in
fp32. No quantized kernel beats the bf16 GEMM on this CPU: its BF16 dot products make a 32-row
bf16 window read-bound at ~13 GB/s, while every weight-only kernel spends more time widening
codes than it saves in bytes. Weight-only quantization here buys memory, not speed (W8A8's
int8 arithmetic buys both: w8a8_kernels.py).

* `TiledKernel`: dequantize TILE_BYTES of rows into the activations' dtype (in cache) and run
  torch's GEMM on them (F.linear: oneDNN / MKL), tile by tile.
* `Int8Kernel`: `torch._weight_int8pack_mm` on CPU; on other devices `F.linear(x, q.to(x.dtype))
  * s`, the CUDA path.
* `Int4CpuKernel`: `torch._convert_weight_to_int4pack_for_cpu` (codes as int32 [N, K] -> its
  blocked uint8 [N, K/2], converted in place PACK_ROWS rows at a time: the layout is local to
  blocks of 64 rows with AVX-512, 32 with AVX2; a test checks the chunked pack against the
  whole one) and `torch._weight_int4pack_mm_for_cpu(x, packed, G, scales_and_zeros
  [K/G, N, 2])`. N must be a multiple of 16: zero rows pad it when it is not (cover-tiny's
  227-row LM head), and the output is cut back.
* `Int4CudaKernel` (CUDA, bf16): `torch._convert_weight_to_int4pack(q uint8 [N, K/2],
  inner_k_tiles)` and `torch._weight_int4pack_mm` (tinygemm). Untested here (no GPU on this
  project's machine); anything else dequantizes per call (`DequantKernel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.layers.quantization.format import (QuantConfig, dequantize, linear_buffers,
                                                   reference_linear, unpack_nibbles)
from cover_vllm.layers.quantization.w8a8_kernels import RowParallel, make_w8a8_kernel

PACK_ROWS = 1024         # rows converted at once by the in-place CPU int4 pack (a multiple of 64)
INT4_ROW_MULTIPLE = 16   # torch's int4 kernels need N % 16 == 0 on CPU (N % 8 on CUDA)
TILE_BYTES = 2 << 20     # one dequantized tile of `TiledKernel`: stays in the L2/L3 caches


class QuantizedGroup:
    """The quantized storage and matmul of one FusedLinears group (models/quantization.py
    `quantize_model` attaches it)."""

    def __init__(self, group, config: QuantConfig):
        self.group, self.config = group, config
        self.fused: dict[str, torch.Tensor] = {}
        self.bias: torch.Tensor | None = None
        self.kernel = None

    @property
    def linears(self) -> tuple[nn.Linear, ...]:
        return self.group.linears

    @torch.no_grad()
    def fuse(self, copy: bool = True) -> None:
        """One tensor per buffer (and the bias) over every Linear's rows; the Linears' buffers
        become row views of them (`copy`: keep their values)."""
        if linear_buffers(self.linears[0])["qweight"].device.type == "meta":
            return
        for name in linear_buffers(self.linears[0]):
            parts = [lin._buffers[name] for lin in self.linears]
            if copy:
                fused = torch.cat(parts)
            else:
                fused = parts[0].new_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
            self.fused[name] = fused
            at = 0
            for lin, part in zip(self.linears, parts):
                lin._buffers[name] = fused[at:at + part.shape[0]]
                at += part.shape[0]
        biases = [lin.bias for lin in self.linears]
        self.bias = None if any(b is None for b in biases) else self.group._stack(biases, copy)
        if self.bias is not None:
            for i, lin in enumerate(self.linears):
                lin.bias = nn.Parameter(self.group._part(self.bias, i), requires_grad=False)

    def _is_fused(self) -> bool:
        """Whether every Linear's buffers still are the row views `fuse` made."""
        if not self.fused:
            return False
        for name, fused in self.fused.items():
            at = 0
            for lin in self.linears:
                buf = lin._buffers[name]
                if buf.data_ptr() != fused.data_ptr() + at * fused.stride(0) * fused.element_size():
                    return False
                at += buf.shape[0]
        return True

    @torch.no_grad()
    def pack(self) -> bool:
        """Hand the fused tensors to the device's kernel (the CPU int4 pack rewrites them in
        place); the Linears keep zero-row placeholders. Returns whether it packed."""
        if self.kernel is not None:
            return False
        if self._is_fused():
            tensors, bias = self.fused, self.bias
        else:                                   # re-allocated since (e.g. `.to(...)`): stack
            names = linear_buffers(self.linears[0])
            tensors = {n: torch.cat([lin._buffers[n] for lin in self.linears]) for n in names}
            biases = [lin.bias for lin in self.linears]
            bias = None if any(b is None for b in biases) else torch.cat(biases)
        lin = self.linears[0]
        amax = getattr(lin, "reduce_input_amax", None)            # row-parallel (TP)
        row = None if amax is None else RowParallel(amax, getattr(lin, "reduce_output", None))
        self.kernel = make_kernel(tensors, self.config, bias, row,
                                  getattr(lin, "rotation_block", 1))
        if getattr(self.kernel, "reduces_output", False):
            lin.output_reduced = True                    # TP's hook: already summed (exactly)
        self.fused = {}
        for lin in self.linears:
            for name, buf in linear_buffers(lin).items():
                lin._buffers[name] = buf.new_empty((0, *buf.shape[1:]))
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, sum(out)]."""
        if self.kernel is not None:
            return self.kernel(x)
        outs = [reference_linear(lin, x) for lin in self.linears]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def make_kernel(t: dict[str, torch.Tensor], config: QuantConfig, bias: torch.Tensor | None,
                row: RowParallel | None = None, rotation_block: int = 1):
    """The fastest kernel for buffers `t` (QuantConfig.storage layout) on their device and the
    model dtype (the scales'), as measured (module doc; W8A8: w8a8_kernels.py, `row` the
    collectives of a row-parallel projection, `rotation_block` its input rotation's)."""
    device, dtype = t["qweight"].device.type, t["weight_scale"].dtype
    if config.method == "w8a8":
        return make_w8a8_kernel(t, bias, row, rotation_block)
    if device == "cpu":
        if config.method == "int4" and dtype in (torch.bfloat16, torch.float16):
            return Int4CpuKernel(t, config.group_size, bias)
        return TiledKernel(t, config, bias)
    if config.method == "int8":
        return Int8Kernel(t, bias)
    if device == "cuda" and dtype == torch.bfloat16:
        return Int4CudaKernel(t, config.group_size, bias)
    return DequantKernel(t, config, bias)


def _finish(out: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Cut padded output columns back to `n` and add the bias."""
    if out.shape[-1] != n:
        out = out[:, :n].contiguous()
    return out if bias is None else out.add_(bias)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0],
                                                                  *t.shape[1:])])


class Int8Kernel:
    """y = x @ (q * s)^T: `_weight_int8pack_mm` on CPU, F.linear on the widened codes elsewhere."""

    def __init__(self, t: dict[str, torch.Tensor], bias: torch.Tensor | None):
        self.q, self.scale, self.bias = t["qweight"], t["weight_scale"], bias
        self.cpu = self.q.device.type == "cpu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu:
            out = torch._weight_int8pack_mm(x, self.q, self.scale)
        else:
            out = F.linear(x, self.q.to(x.dtype)).mul_(self.scale)
        return _finish(out, self.q.shape[0], self.bias)


class Int4CpuKernel:
    """torch's CPU int4 kernel over the codes packed in place into its blocked layout."""

    def __init__(self, t: dict[str, torch.Tensor], group_size: int, bias: torch.Tensor | None):
        q = t["qweight"]
        self.n, self.group_size, self.bias = q.shape[0], group_size, bias
        rows = -(-self.n // INT4_ROW_MULTIPLE) * INT4_ROW_MULTIPLE
        scale, zero = (_pad_rows(t[n], rows) for n in ("weight_scale", "weight_zero"))
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [G, N, 2]
        self.packed = pack_int4_cpu(_pad_rows(q, rows))     # after the lasting allocation:
                                                            # its temporaries then free cleanly

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size,
                                                self.scales_zeros)
        return _finish(out, self.n, self.bias)


@torch.no_grad()
def pack_int4_cpu(q: torch.Tensor, rows: int = PACK_ROWS) -> torch.Tensor:
    """[N, K/2] nibble codes -> the CPU int4 kernel's layout, in place, `rows` rows at a time
    (a multiple of the kernel's 64-row block, so each chunk packs on its own)."""
    for a in range(0, q.shape[0], rows):
        codes = unpack_nibbles(q[a:a + rows]).to(torch.int32)           # [rows, K]
        q[a:a + rows].copy_(torch._convert_weight_to_int4pack_for_cpu(codes, 1))
    return q


class Int4CudaKernel:
    """tinygemm (`torch._weight_int4pack_mm`), bf16 activations."""

    def __init__(self, t: dict[str, torch.Tensor], group_size: int, bias: torch.Tensor | None):
        q = t["qweight"]
        self.n, self.group_size, self.bias = q.shape[0], group_size, bias
        k = q.shape[1] * 2
        inner = 8 if k % 128 == 0 else (4 if k % 64 == 0 else 2)
        rows = -(-self.n // INT4_ROW_MULTIPLE) * INT4_ROW_MULTIPLE
        self.packed = torch._convert_weight_to_int4pack(_pad_rows(q, rows).contiguous(), inner)
        scale, zero = (_pad_rows(t[n], rows) for n in ("weight_scale", "weight_zero"))
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm(x.contiguous(), self.packed, self.group_size,
                                        self.scales_zeros)
        return _finish(out, self.n, self.bias)


class TiledKernel:
    """Dequantize a cache-sized tile of rows (TILE_BYTES in the activations' dtype) and run
    torch's GEMM on it (F.linear: oneDNN / MKL), tile after tile into one output: the weight
    is read once, as codes, and never exists whole in the activations' dtype. int8's per-row
    scale is applied to the output once instead of to every tile."""

    def __init__(self, t: dict[str, torch.Tensor], config: QuantConfig,
                 bias: torch.Tensor | None):
        self.t, self.config, self.bias = t, config, bias
        self.n, k2 = t["qweight"].shape
        self.k = k2 if config.method == "int8" else 2 * k2
        self.rows = max(16, TILE_BYTES // (self.k * t["weight_scale"].element_size()))

    def _tile(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [a, b) of the weight in `dtype` (int8: without the scale)."""
        q = self.t["qweight"][a:b]
        if self.config.method == "int8":
            return q.to(dtype)                                    # |q| <= 127: exact
        g = self.config.group_size
        codes = unpack_nibbles(q).to(dtype).sub_(8).view(b - a, -1, g)      # [c, G, g], exact
        scale, zero = self.t["weight_scale"][a:b, :, None], self.t["weight_zero"][a:b, :, None]
        return torch.addcmul(zero, codes, scale).view(b - a, self.k)   # one rounding, as
                                                                       # `dequantize`

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], self.n))
        for a in range(0, self.n, self.rows):
            b = min(self.n, a + self.rows)
            out[:, a:b] = F.linear(x, self._tile(a, b, x.dtype))
        if self.config.method == "int8":
            out.mul_(self.t["weight_scale"])
        return out if self.bias is None else out.add_(self.bias)


class DequantKernel:
    """Dequantize per call, then F.linear: correct anywhere, fast nowhere."""

    def __init__(self, t: dict[str, torch.Tensor], config: QuantConfig,
                 bias: torch.Tensor | None):
        self.t, self.config, self.bias = t, config, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.t, self.config).to(x.dtype), self.bias)
