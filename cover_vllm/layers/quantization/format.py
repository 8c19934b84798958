"""The quantization formats: the config parsed from `quantization=`, and the math that turns a
float weight into codes and scales and back, and (W8A8) an activation row into int8 codes and a
scale (models/quantization.py has the formats' description; kernels.py and
w8a8_kernels.py run the matmuls).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

METHODS = ("int8", "int4", "w8a8")
INT4_GROUP_SIZES = (32, 64, 128, 256)       # what torch's CPU int4 kernel accepts
DEFAULT_GROUP_SIZE = 128
QUANT_BUFFERS = ("qweight", "weight_scale", "weight_zero", "qresidual")
EMBEDDING_RESIDUAL_STEPS = 14   # w8a8's embedding: the residual's step is 1/14 of int8's
ROTATION_BLOCK = 128            # w8a8's input rotation: the most input columns one block mixes
ROTATION_TP_RANKS = 8           # ... and its blocks stay whole on every split up to 8 ranks
ROTATION_SEED = 0               # ... and its random signs (scripts/w8a8_flips.py varies it)
_ALLOWED = ("None, 'int8', 'int4', 'int4:G' (G = 32, 64, 128 or 256 input columns per scale) "
            "or 'w8a8'")


@dataclass(frozen=True)
class QuantConfig:
    """One model's quantization (`parse_quantization` builds it from the option). "w8a8" stores
    int8's weights and also quantizes every projection's input per row at run time."""

    method: str                             # "int8" | "int4" | "w8a8"
    group_size: int = DEFAULT_GROUP_SIZE    # int4: input columns sharing a scale and zero
    lm_head: bool = True                    # quantize the LM head too (see the module doc)
    embedding: bool | None = None           # the input embedding table in 12 bits a value
                                            # (`quantize_embedding_rows`); None: w8a8 does,
                                            # int8 / int4 do not
    rotation: bool | None = None            # w8a8: rotate every projection's input and
                                            # weight columns (`rotate_columns`); None: w8a8
                                            # does (the default), int8 / int4 never
    explicit_group: bool = field(default=False, compare=False)   # "int4:G" given: a family's
                                            # own int4 group (registry `int4_group`) does not apply

    @property
    def quantizes_embedding(self) -> bool:
        return self.method == "w8a8" if self.embedding is None else self.embedding

    @property
    def rotates_inputs(self) -> bool:
        return self.method == "w8a8" and self.rotation is not False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization={self.method!r}; choose one of {_ALLOWED}")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization='int4:{self.group_size}': the group size must be one "
                             f"of {INT4_GROUP_SIZES}")
        if self.rotation and self.method != "w8a8":
            raise ValueError(f"QuantConfig(rotation=True) rotates the inputs of w8a8's int8 "
                             f"activations; quantization={self.method!r} quantizes none")

    @property
    def label(self) -> str:
        return f"int4:{self.group_size}" if self.method == "int4" else self.method

    @property
    def per_channel(self) -> bool:
        """int8 codes with one scale per output channel (int8 and w8a8)."""
        return self.method != "int4"

    def storage(self, n: int, k: int, dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """Buffer name -> (shape, dtype) of one quantized [n, k] weight in a `dtype` model."""
        if self.per_channel:
            return {"qweight": ((n, k), torch.int8), "weight_scale": ((n,), dtype)}
        groups = k // self.group_size
        return {"qweight": ((n, k // 2), torch.uint8), "weight_scale": ((n, groups), dtype),
                "weight_zero": ((n, groups), dtype)}

    def bytes_per_weight(self, itemsize: int) -> float:
        """Bytes stored (and read by a forward) per weight, scales included (int8's one scale a
        row is left out: under 1 % of a row of >= 128 columns)."""
        if self.per_channel:
            return 1.0
        return 0.5 + 2 * itemsize / self.group_size


def parse_quantization(value: str | QuantConfig | None) -> QuantConfig | None:
    """The `quantization` option: None / "none", "int8", "int4", "int4:G" or "w8a8"."""
    if value is None or isinstance(value, QuantConfig):
        return value
    if not isinstance(value, str):
        raise ValueError(f"quantization={value!r}; choose one of {_ALLOWED}")
    method, _, group = value.strip().lower().partition(":")
    if method == "none" and not group:
        return None
    if method in ("int8", "w8a8") and not group:
        return QuantConfig(method)
    if method == "int4":
        if not group:
            return QuantConfig("int4")
        if group.isdigit():
            return QuantConfig("int4", int(group), explicit_group=True)
    raise ValueError(f"quantization={value!r}; choose one of {_ALLOWED}")


# ---- the math ------------------------------------------------------------------------------

def quantize_rows(w: torch.Tensor, config: QuantConfig, dtype: torch.dtype,
                  amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """w [n, k] (any float dtype) -> the buffers of QuantConfig.storage, scales in `dtype`.
    `amax` [n] (int8): the rows' max |w| to scale by, when w is a slice of longer rows (a
    row-parallel rank's columns: the scale of the whole row, so the rank's codes are TP=1's)."""
    w = w.to(torch.float32, copy=True)             # every step below works in place on it
    if config.per_channel:
        amax = w.abs().amax(dim=1) if amax is None else amax.float()
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(dtype)   # [n]
        q = w.div_(scale.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return {"qweight": q, "weight_scale": scale}
    n, k = w.shape
    wg = w.view(n, k // config.group_size, config.group_size)          # [n, G, g]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)                          # [n, G]
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo)).to(dtype)
    zero = (lo + 8 * scale.float()).to(dtype)
    base = zero.float() - 8 * scale.float()                            # what code 0 decodes to
    q = wg.sub_(base[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, 15)
    return {"qweight": pack_nibbles(q.view(n, k).to(torch.uint8)), "weight_scale": scale,
            "weight_zero": zero}


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[n, k] 4-bit codes (uint8) -> [n, k/2] uint8, column 2j in the high nibble."""
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, k/2] uint8 -> [n, k] codes (uint8); inverse of `pack_nibbles`."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).view(packed.shape[0], -1)


def dequantize(t: dict[str, torch.Tensor], config: QuantConfig) -> torch.Tensor:
    """The weight [n, k] the buffers stand for, in the scales' dtype: the slow reference every
    kernel is checked against."""
    scale = t["weight_scale"]
    if config.per_channel:
        return (t["qweight"].float() * scale.float()[:, None]).to(scale.dtype)
    codes = unpack_nibbles(t["qweight"]).float()
    n, k = codes.shape
    g = config.group_size
    w = (codes.view(n, k // g, g) - 8) * scale.float()[..., None] + t["weight_zero"].float()[
        ..., None]
    return w.view(n, k).to(scale.dtype)


# ---- a quantized Linear's storage ----------------------------------------------------------

def linear_buffers(linear: nn.Linear) -> dict[str, torch.Tensor]:
    """The quantized storage of `linear` (empty for a Linear that is not quantized)."""
    return {name: buf for name in QUANT_BUFFERS
            if (buf := linear._buffers.get(name)) is not None}


def is_quantized(module: nn.Module) -> bool:
    """A Linear (or, w8a8, an Embedding) whose weight is quantized buffers."""
    return isinstance(module, (nn.Linear, nn.Embedding)) and "qweight" in module._buffers


# ---- w8a8's embedding table: 12 bits a value ------------------------------------------------

def embedding_storage(v: int, d: int, dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
    """Buffer name -> (shape, dtype) of a quantized [v, d] embedding table (d even)."""
    return {"qweight": ((v, d), torch.int8), "qresidual": ((v, d // 2), torch.uint8),
            "weight_scale": ((v,), dtype)}


def quantize_embedding_rows(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """w [v, d] -> int8 codes per row (as int8 weights), plus the residual w - q * s in 4 bits
    (codes -7..7 of step s / 14, stored + 8 as nibbles): |error| <= s / 28, about 1/14 of int8's
    and below bf16's own rounding. A row is looked up once per token, so only memory counts:
    12 bits a value, where int8 rows alone moved cover-tiny's accuracy by up to 1.7 points
    (docs/benchmarks.md "W8A8")."""
    t = quantize_rows(w, QuantConfig("int8"), dtype)
    scale = t["weight_scale"].float()[:, None]
    residual = w.float() - t["qweight"].float() * scale                  # |r| <= s / 2
    steps = residual.mul_(EMBEDDING_RESIDUAL_STEPS).div_(scale).round_().clamp_(-7, 7)
    t["qresidual"] = pack_nibbles(steps.add_(8).to(torch.uint8))
    return t


def dequantize_embedding(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rows [v, d] the buffers of `quantize_embedding_rows` stand for, in the scales'
    dtype (one rounding)."""
    scale = t["weight_scale"]
    fine = unpack_nibbles(t["qresidual"]).float().sub_(8).div_(EMBEDDING_RESIDUAL_STEPS)
    return ((t["qweight"].float() + fine) * scale.float()[:, None]).to(scale.dtype)


def embedding_lookup(embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """A quantized Embedding's forward: the rows of `ids` [...] dequantized -> [..., d] in
    the model dtype (`dequantize_embedding`)."""
    flat = ids.reshape(-1)
    rows = {name: buf[flat] for name, buf in linear_buffers(embedding).items()}
    return dequantize_embedding(rows).view(*ids.shape, -1)


def reference_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x [T, in] -> [T, out] through the dequantized weight: F.linear, nothing fused. W8A8: the
    input rotated like the weight's columns (`rotate_input`, the Linear's `rotation_block`)
    and quantized per row first (`quantize_activations`), the product in fp32."""
    config, bufs = linear.quant_config, linear_buffers(linear)
    if config.method != "w8a8":
        return F.linear(x, dequantize(bufs, config).to(x.dtype), linear.bias)
    rotated, factor = rotate_input(x, getattr(linear, "rotation_block", 1))
    codes, scale = quantize_activations(rotated, factor=factor)
    w = bufs["qweight"].float() * bufs["weight_scale"].float()[:, None]     # fp32, unrounded
    bias = None if linear.bias is None else linear.bias.float()
    return F.linear(codes.float() * scale, w, bias).to(x.dtype)


# ---- W8A8: activations quantized per row at run time ---------------------------------------

def quantize_activations(x: torch.Tensor, amax: torch.Tensor | None = None,
                         zero_point: int = 0, overwrite: bool = False, factor: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, k] (any float dtype) -> (codes [T, k], scale fp32 [T, 1]): symmetric per row,
    x ~ codes * scale, codes in [-127, 127], scale = max|x_row| / 127 (an all-zero row: 1).
    `zero_point` 128 returns codes + 128 as uint8 (oneDNN's u8 input), 0 int8 codes.
    `amax` [T, 1]: the rows' max |x| to scale by instead, when x holds a slice of longer rows
    (a row-parallel rank's input columns: TP=1's scales, so the codes are TP=1's).
    `overwrite`: x is an fp32 temporary (a rotated input) the codes may be computed in.
    `factor`: the rows stand for factor * x (`rotate_input`'s 1 / sqrt(b) for a bf16 input): the
    codes are x's, the scale returned is factor times theirs."""
    if amax is None:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    codes = x if overwrite and x.dtype == torch.float32 else x.to(torch.float32, copy=True)
    codes = codes.div_(scale).round_().clamp_(-127, 127)
    if factor != 1.0:
        scale = scale * factor
    if zero_point:
        return codes.add_(zero_point).to(torch.uint8), scale
    return codes.to(torch.int8), scale


# ---- W8A8: the input rotation --------------------------------------------------------------
#
# A projection's input rows carry outliers (cover-tiny's MLP down inputs: a row's max is
# 10-14x its rms), and one int8 scale per row then leaves a typical value ~10 levels. An
# orthogonal R changes nothing in exact arithmetic, y = x W^T = (x R)(W R)^T, but x R spreads
# each outlier over a block of columns, so the row's int8 step shrinks (QuaRot, Ashkboos et al.
# 2024, and QuIP#'s randomized Hadamard transform). R is block diagonal: blocks of b columns,
# each D H_b / sqrt(b) with H_b the Sylvester-Hadamard matrix and D a fixed diagonal of random
# signs (seeded by b, the same on every machine). The weights' columns are rotated once at
# load, in fp32, before they are quantized; the input on every call (`rotate_input`), a GEMM of
# 2 b FLOPs per input value (b = 128: 1 % of LLaDA-8B's q|k|v product, 3 % of its down): in
# fp32, or for a bf16 input in bf16 against D H_b (entries +-1, exact), whose 1 / sqrt(b) the
# row's scale takes; bf16's GEMM runs it 2-5x faster here, and rounding each rotated value to
# bf16 (2^-9 relative) is far below the int8 step (max|row| / 127) that follows.

def rotation_block(in_features: int) -> int:
    """The rotation's block b for a projection of `in_features` input columns (the whole row,
    before any TP split): the largest power of two <= ROTATION_BLOCK that divides
    in_features / ROTATION_TP_RANKS, so a row-parallel split over up to 8 ranks keeps whole
    blocks and every rank's rotated columns are TP=1's (1: no rotation)."""
    return min(ROTATION_BLOCK, max(1, (in_features & -in_features) // ROTATION_TP_RANKS))


@functools.lru_cache(maxsize=None)
def _signed_hadamard(b: int, device: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    draw = torch.Generator().manual_seed(b + 1000 * seed)
    signs = torch.randint(0, 2, (b,), generator=draw) * 2 - 1
    return (signs[:, None] * h).to(device=device, dtype=dtype)        # D H_b, entries +-1


@functools.lru_cache(maxsize=None)
def _rotation_matrix(b: int, device: str, seed: int) -> torch.Tensor:
    return (_signed_hadamard(b, "cpu", torch.float64, seed) / b ** 0.5).float().to(device)


def rotation_matrix(b: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One diagonal block of R, D H_b / sqrt(b) in fp32 [b, b] (R R^T = I; section comment)."""
    return _rotation_matrix(b, str(device), ROTATION_SEED)


def rotate_columns(x: torch.Tensor, b: int) -> torch.Tensor:
    """x [..., k] -> x R in fp32 (R block diagonal, blocks of b columns; b divides k): a weight
    row (its input columns) before its codes, or an input row before its. b = 1: x."""
    if b <= 1:
        return x
    k = x.shape[-1]
    blocks = x.float().reshape(-1, k // b, b)
    return (blocks @ rotation_matrix(b, x.device)).view(x.shape)


def rotate_input(x: torch.Tensor, b: int) -> tuple[torch.Tensor, float]:
    """A W8A8 input [T, k] before its per-row codes -> (y, f) with x R = f * y (section
    comment): bf16 x gives y = x (D H_b) in bf16 and f = 1 / sqrt(b), which the row's scale
    takes (a row's codes do not depend on a factor common to the row); other dtypes
    y = rotate_columns(x, b) (fp32), f = 1. b = 1: (x, 1)."""
    if b <= 1:
        return x, 1.0
    if x.dtype != torch.bfloat16:
        return rotate_columns(x, b), 1.0
    k = x.shape[-1]
    hadamard = _signed_hadamard(b, str(x.device), torch.bfloat16, ROTATION_SEED)
    return (x.reshape(-1, k // b, b) @ hadamard).view(x.shape), b ** -0.5
