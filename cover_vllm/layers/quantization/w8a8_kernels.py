"""The matmuls of W8A8 projections (`quantization="w8a8"`): int8 weights x int8 activations
with int32 accumulation, and the bytes each kernel keeps resident (the memory plan's count).

A W8A8 projection stores int8's weights (codes per output channel, format.py); at run
time its input is quantized per row (`format.quantize_activations`: symmetric,
max|x_row| / 127) and the product is

    y[t, n] = (sum_k xq[t, k] * q[n, k]) * w_scale[n] * x_scale[t]   (+ bias)

the sum exact in int32, the scales applied to its fp32 value in that order, in fp32, then one
rounding to the model dtype. `reference` computes the same thing with the sum in float64 (exact):
every kernel equals it bit for bit where the int32 sum needs at most 24 bits, and to fp32's
rounding of it otherwise (tests/test_w8a8.py, test_w8a8_rotation.py). A kernel built with a
`rotation_block` b > 1 first rotates its input rows (`format.rotate_input`, blocks of b
columns), as the codes' weight rows were rotated at load, so x is then the rotated input
(bf16: x (D H_b) in bf16, with 1 / sqrt(b) in x_scale).

Kernels, chosen by measurement (docs/benchmarks.md "W8A8", scripts/quant_kernels.py; AMD EPYC
with AVX-512 VNNI + BF16, no AMX, one thread, LLaDA-8B's q|k|v [12288, 4096], 2026-11-25):

* `OnednnKernel` (CPU): oneDNN's u8 x s8 GEMM, `torch.ops.onednn.qlinear_prepack` once at load
  (a blocked copy of the codes: N and K padded to the ISA's blocks plus an int32 compensation
  per column, `onednn_packed_bytes`) and `torch.ops.onednn.qlinear_pointwise` per call (the op
  Inductor's x86 int8 path lowers to). The activations go in as u8 with zero point 128
  (codes + 128): VNNI's dot product is u8 x s8, and s8 activations take oneDNN's reference
  path here (53 s instead of 9 ms at 32 rows). x_scale = 1 and the per-channel weight scales
  run inside the op (its fp32 output is the int32 sum times w_scale, bit for bit); the per-row
  activation scale is one multiply of the output.
* `IntMMKernel` (CUDA, and the CPU fallback): `torch._int_mm(xq s8, q^T s8) -> int32`, then
  the scales. On this CPU it is 2.7x slower than oneDNN at 32 rows (24 vs 9 ms), so it only
  runs where oneDNN's ops are missing or misbehave (`onednn_problem`, checked at load with a
  warning that says why). CUDA needs more than 16 rows (fewer are padded with zero rows) and
  K and N multiples of 8 (else `ReferenceKernel`). Untested on a GPU (none here).
* `ReferenceKernel`: the fp32 formula through F.linear; correct anywhere, fast nowhere.

Tensor parallelism: a row-parallel projection (attention output, MLP down) sees only its
rank's input columns (whole rotation blocks, each rotated as TP=1 rotates it);
`RowParallel.amax` (a max all-reduce) gives each row TP=1's max |x|, so
every rank quantizes its columns exactly as TP=1 would, and `RowParallel.total` sums the
ranks' integer sums before the scales, so the output is TP=1's bit for bit (`_Kernel`).
Rounding makes this necessary: a sum of scaled fp32 partial outputs differs from TP=1's in
the last bits, and the next projection's activation codes amplify that (a value next to a
rounding boundary moves a whole code), enough to change tokens of a random-weight model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from cover_vllm.layers.quantization.format import quantize_activations, rotate_input

ZERO_POINT = 128                 # u8 activation codes = int8 codes + 128
CUDA_MIN_ROWS = 17               # torch._int_mm on CUDA needs more than 16 rows
Collective = Callable[[torch.Tensor], torch.Tensor]       # in place over the TP ranks


@dataclass(frozen=True)
class RowParallel:
    """The collectives of a row-parallel projection (this rank holds a slice of its input
    columns; TensorParallel.shard provides them as the Linear's `reduce_input_amax` and, when
    the Linear's output is all-reduced, `reduce_output`)."""

    amax: Collective                 # max over ranks: each row's whole max |x|
    total: Collective | None = None  # sum over ranks of the output; None: a parent sums


def reference(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, x_factor: float = 1.0) -> torch.Tensor:
    """The exact W8A8 product (module doc) of x [T, k] with codes q [n, k] and fp32 scales
    [n]: the int32 sum computed in float64 (exact), the scales in fp32 in the kernels' order.
    `x_factor`: a factor of every row's scale (a bf16 rotated input's 1 / sqrt(b))."""
    codes, x_scale = quantize_activations(x, factor=x_factor)
    acc = F.linear(codes.double(), q.double()).float()                   # [T, n]
    out = acc.mul_(w_scale.float()).mul_(x_scale)
    return (out if bias is None else out.add_(bias.float())).to(x.dtype)


class _Kernel:
    """Shared by the kernels: flatten the input, quantize it, run the integer product, scale.

    Row-parallel with `RowParallel.total` and no bias: the ranks' integer sums are summed as
    int32 (exact, in any order) before the scales, so the output is TP=1's bit for bit (while
    every rank's partial sum fits fp32's 24 bits: always below 1,040 input columns a rank,
    and in practice far beyond); `reduces_output` then tells the Linear's TP hook to skip
    its own all-reduce. A row-parallel bias (kept by rank 0 only) keeps the hook's sum of
    scaled outputs."""

    zero_point = 0

    def __init__(self, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 row: RowParallel | None = None, rotation_block: int = 1):
        self.n, self.k = q.shape
        self.w_scale = w_scale.float().contiguous()                      # [n] fp32
        self.bias, self.row, self.rotation_block = bias, row, rotation_block
        self.reduces_output = row is not None and row.total is not None and bias is None

    def _sums(self, codes: torch.Tensor) -> torch.Tensor:
        """The integer sums [T, n] (exact int32, or their fp32 values)."""
        raise NotImplementedError

    def _scaled(self, codes: torch.Tensor) -> torch.Tensor:
        """The sums times w_scale, fp32 [T, n] (a kernel may fuse the scale)."""
        return self._sums(codes).float().mul_(self.w_scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        rotated = self.rotation_block > 1
        x, factor = rotate_input(x.reshape(-1, self.k), self.rotation_block)  # as the weight's
        amax = None
        if self.row is not None:
            amax = self.row.amax(x.abs().amax(dim=-1, keepdim=True).float())
        codes, x_scale = quantize_activations(x, amax, self.zero_point, overwrite=rotated,
                                              factor=factor)
        if self.reduces_output:
            sums = self.row.total(self._sums(codes).to(torch.int32))
            out = sums.float().mul_(self.w_scale)
        else:
            out = self._scaled(codes)
        out = out.mul_(x_scale)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.to(dtype).view(*shape[:-1], self.n)

    def nbytes(self) -> int:
        """Bytes this kernel keeps resident (the bias belongs to the model's parameters)."""
        return self.w_scale.numel() * 4


class OnednnKernel(_Kernel):
    """oneDNN's u8 x s8 GEMM over the codes prepacked once (module doc)."""

    zero_point = ZERO_POINT

    def __init__(self, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 row: RowParallel | None = None, rotation_block: int = 1):
        super().__init__(q, w_scale, bias, row, rotation_block)
        self.w_zero = torch.zeros(1, dtype=torch.int64)
        self.unit = torch.ones(1)
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)          # its own blocked copy

    def matmul_codes(self, codes: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        """u8 codes [T, k] (int8 codes + 128) -> fp32 [T, n]: the int32 sums x w_scale."""
        return torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, ZERO_POINT, self.packed, w_scale, self.w_zero, None, 1.0, 0,
            torch.float32, "none", [], "")

    def _sums(self, codes: torch.Tensor) -> torch.Tensor:
        return self.matmul_codes(codes, self.unit)

    def _scaled(self, codes: torch.Tensor) -> torch.Tensor:
        return self.matmul_codes(codes, self.w_scale)

    def nbytes(self) -> int:
        return super().nbytes() + torch.ops.mkldnn._nbytes(self.packed) + 8 + 4


class IntMMKernel(_Kernel):
    """`torch._int_mm` (s8 x s8 -> int32), then the scales in fp32."""

    def __init__(self, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 row: RowParallel | None = None, rotation_block: int = 1):
        super().__init__(q, w_scale, bias, row, rotation_block)
        self.q_t = q.t()                                   # [k, n] view: column-major codes
        self.min_rows = CUDA_MIN_ROWS if q.device.type == "cuda" else 1

    def _sums(self, codes: torch.Tensor) -> torch.Tensor:
        t = codes.shape[0]
        if t < self.min_rows:
            codes = torch.cat([codes, codes.new_zeros(self.min_rows - t, self.k)])
        return torch._int_mm(codes, self.q_t)[:t]                        # int32 [T, n]

    def nbytes(self) -> int:
        return super().nbytes() + self.q_t.numel()


class ReferenceKernel(_Kernel):
    """The sums in float64 (exact): `reference`, per call."""

    def __init__(self, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 row: RowParallel | None = None, rotation_block: int = 1):
        super().__init__(q, w_scale, bias, row, rotation_block)
        self.q = q

    def _sums(self, codes: torch.Tensor) -> torch.Tensor:
        return F.linear(codes.double(), self.q.double()).float()

    def nbytes(self) -> int:
        return super().nbytes() + self.q.numel()


# ---- choosing a kernel, checked at load ----------------------------------------------------

def onednn_problem() -> str | None:
    """Why oneDNN's u8 x s8 ops cannot run W8A8 in this torch (None: they can). Checks that the
    ops exist with the argument list `OnednnKernel` passes (older and newer torch builds have
    had others), then runs one tiny product against the exact integer result."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    ops = torch.ops.onednn
    if not (hasattr(ops, "qlinear_prepack") and hasattr(ops, "qlinear_pointwise")
            and hasattr(torch.ops.mkldnn, "_nbytes")):
        return f"torch {torch.__version__} has no torch.ops.onednn.qlinear_pointwise"
    args = [a.name for a in ops.qlinear_pointwise.default._schema.arguments]
    if args[:10] != ["qx", "x_scale", "x_zero_point", "qw", "w_scale", "w_zero_point", "bias",
                     "output_scale", "output_zero_point", "output_dtype"]:
        return (f"torch {torch.__version__}'s onednn.qlinear_pointwise takes ({', '.join(args)}), "
                "not the arguments this engine passes")
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (24, 40), dtype=torch.int8, generator=gen)
    x = torch.randn(3, 40, generator=gen)
    try:
        got = OnednnKernel(q, torch.ones(24), None)(x)
    except RuntimeError as exc:
        return f"onednn.qlinear_pointwise failed on a 3 x 40 x 24 product ({exc})"
    if not torch.equal(got, reference(x, q, torch.ones(24))):
        return "onednn.qlinear_pointwise gave a wrong 3 x 40 x 24 product"
    return None


def make_w8a8_kernel(t: dict[str, torch.Tensor], bias: torch.Tensor | None,
                     row: RowParallel | None = None, rotation_block: int = 1):
    """The kernel for codes `t["qweight"]` [n, k] and scales `t["weight_scale"]` [n] on their
    device (module doc); a CPU without working oneDNN ops falls back with a warning. `row`:
    the collectives of a row-parallel projection; `rotation_block`: its input's rotation
    (`format.rotate_columns`; the codes are of the rotated weight)."""
    q, scale = t["qweight"], t["weight_scale"]
    device = q.device.type
    if device == "cpu":
        problem = onednn_problem()
        if problem is None:
            return OnednnKernel(q, scale, bias, row, rotation_block)
        kind = IntMMKernel if hasattr(torch, "_int_mm") else ReferenceKernel
        warnings.warn(f"quantization='w8a8': {problem}; running {kind.__name__} instead "
                      "(slower than bf16 here, docs/benchmarks.md 'W8A8')", RuntimeWarning)
        return kind(q, scale, bias, row, rotation_block)
    n, k = q.shape
    if device == "cuda" and hasattr(torch, "_int_mm") and n % 8 == 0 and k % 8 == 0:
        return IntMMKernel(q, scale, bias, row, rotation_block)
    return ReferenceKernel(q, scale, bias, row, rotation_block)


# ---- the bytes a kernel keeps: the memory plan ---------------------------------------------

def _probe_bytes(n: int, k: int) -> int:
    return torch.ops.mkldnn._nbytes(torch.ops.onednn.qlinear_prepack(
        torch.zeros(n, k, dtype=torch.int8), None))


def _block(along_n: bool, limit: int = 1024) -> int:
    """The smallest power of two p with bytes(p + 1) > bytes(p) along one dimension: the
    packed layout's block (padding) size there."""
    p = 1
    while p < limit:
        a, b = ((p, 1), (p + 1, 1)) if along_n else ((1, p), (1, p + 1))
        if _probe_bytes(*b) > _probe_bytes(*a):
            return p
        p *= 2
    raise RuntimeError("no block size found")


def onednn_layout() -> tuple[int, int, int] | None:
    """(block_n, block_k, compensation bytes per padded column) of `qlinear_prepack`'s layout
    on this CPU, probed on tiny weights and checked on two odd shapes; None if unknown. The
    blocks depend on the ISA (AVX-512 VNNI here: 64 and 64, 4 bytes of int32 compensation)."""
    if onednn_problem() is not None:
        return None
    bn, bk = _block(True), _block(False)
    comp, rest = divmod(_probe_bytes(1, 1) - bn * bk, bn)
    layout = (bn, bk, comp)
    for n, k in ((bn + 3, 2 * bk + 5), (3 * bn - 1, max(1, bk - 1))):
        if rest or _probe_bytes(n, k) != _packed(layout, n, k):
            return None
    return layout


def _packed(layout: tuple[int, int, int], n: int, k: int) -> int:
    bn, bk, comp = layout
    pad_n, pad_k = -(-n // bn) * bn, -(-k // bk) * bk
    return pad_n * pad_k + comp * pad_n


def resident_bytes(n: int, k: int, device: str, layout: tuple[int, int, int] | None) -> int:
    """Bytes the kernel `make_w8a8_kernel` builds keeps for an [n, k] group on `device`: the
    codes as it holds them (oneDNN's padded blocks with `layout` = `onednn_layout()`, else
    n x k) + fp32 scales (+ oneDNN's int64 zero point and unit fp32 scale)."""
    if str(device).startswith("cpu") and layout is not None:
        return _packed(layout, n, k) + 4 * n + 8 + 4
    return n * k + 4 * n
