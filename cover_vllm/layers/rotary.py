"""Rotary position embedding (RoPE) shared by the families: the angles of a forward's positions
(`RotaryEmbedding.at`, tabulated once off the CPU) and their application in place (`Rotation`),
in the official code's precision (../shared/golden/README.md "Quirks"): angles always in fp32;
the rotation in fp32 (LLaDA's `rope_full_precision`) or in the model's dtype with cos and sin
rounded to it (Dream, LLaDA-MoE, SDAR, LLaDA2; issue #48)."""

from __future__ import annotations

import torch
from torch import nn


ROPE_TABLE_MAX_BYTES = 16 << 20      # beyond (a 32k-position, r = 128 table): angles computed


def reserve_rope_tables(model: nn.Module, num_positions: int) -> None:
    """`RotaryEmbedding.reserve` on every rotary embedding of `model` (worker/worker.py)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reserve(num_positions)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with fp32 inverse frequencies theta^(-2k/r), applied in fp32
    (`full_precision`) or in the rotated tensor's dtype (cos and sin rounded to it, every
    product and the sum rounded: the official Qwen2/Llama `apply_rotary_pos_emb`).

    Only the first `rotary_dim` (r, default head_dim) channels of each head rotate; the rest pass
    through unchanged (HF `partial_rotary_factor`). `at(positions)` computes the angles once per
    forward; every layer then applies the same `Rotation`. Off the CPU, `reserve(n)` tabulates
    the angles of positions < n once, and `at` then reads them (two gathers where computing
    takes ten ops; the same bits, from the same elementwise ops).
    """

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None,
                 full_precision: bool = True):
        super().__init__()
        r = rotary_dim or head_dim
        self.rotary_dim, self.theta, self.full_precision = r, theta, full_precision
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None     # (cos, signed sin)

    def _inv_freq(self, device) -> torch.Tensor:
        r = self.rotary_dim
        if torch.device(device or torch.get_default_device()).type == "meta":
            # a meta build (models/loader.py): shapes only, and no Python reference op (their
            # first use imports torch._dynamo, 143 MiB resident, and the import's frames keep
            # the engine being built alive for good)
            return torch.empty((r + 1) // 2, dtype=torch.float32, device="meta")
        return self._frequencies(device)

    def _frequencies(self, device) -> torch.Tensor:
        """[r/2] fp32 inverse frequencies on `device` (never meta)."""
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device)
        return 1.0 / (self.theta ** (exponent / self.rotary_dim))

    def reset_buffers(self) -> None:      # fp32 `inv_freq` after a meta build (models/loader.py)
        self.inv_freq = self._inv_freq(self.inv_freq.device)
        self.table = None

    def reserve(self, num_positions: int) -> None:
        """Tabulate the angles of positions 0..num_positions-1 on inv_freq's device, when that is
        not the CPU (whose vectorised sin/cos may round a tensor's tail differently from its
        body, so a table could differ in the last bit) and the table stays under
        ROPE_TABLE_MAX_BYTES. The caller guarantees every later position is below the bound
        (the engine refuses canvases beyond max_model_len)."""
        device = self.inv_freq.device
        if (device.type == "cpu"
                or 2 * num_positions * self.rotary_dim * 4 > ROPE_TABLE_MAX_BYTES):
            return
        self.table = self._angles(torch.arange(num_positions, device=device))

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of tokens at `positions` [T] (absolute, int)."""
        if self.table is not None:
            cos, sin = self.table
            return Rotation(cos.index_select(0, positions), sin.index_select(0, positions),
                            self.rotary_dim, self.full_precision)
        return Rotation(*self._angles(positions), self.rotary_dim, self.full_precision)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [T, 1, r] of `positions` [T], fp32."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]   # [T, r/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]              # [T, 1, r]
        sin = emb.sin()
        half = self.rotary_dim // 2
        sin[..., :half].neg_()          # rotate_half(x) * sin == roll(x, r/2) * [-sin, sin]
        return emb.cos(), sin


class Rotation:
    """RoPE angles of one forward's tokens: cos and the signed sin [T, 1, r], fp32 (and, for a
    rotation in the model's dtype, their copies in that dtype, made once per forward)."""

    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor, rotary_dim: int,
                 full_precision: bool = True):
        self.cos, self.signed_sin, self.rotary_dim = cos, signed_sin, rotary_dim
        self.full_precision = full_precision
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def angles_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) rounded to `dtype` (the official `cos.to(x.dtype)`; rounding the
        signed sin equals negating the rounded sin: round to nearest is symmetric)."""
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.signed_sin.to(dtype))
        return self._cast[dtype]

    def rotate_(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] in place (x may be a view, such as the q|k heads of
        the fused q|k|v output) and return it: x·cos + rotate_half(x)·sin computed in fp32 and
        rounded once into x, with rotate_half(x) = [-x2, x1] written as roll(x)·[-1, 1] folded
        into the sin (bit-identical: IEEE negation is exact). Only the first `rotary_dim`
        channels turn; the rest are left as they are.

        Four ops off the CPU: the roll and the two products widen by type promotion, and the sum
        lands in x (`out=`, one rounding). On the CPU products by type promotion run 2.6x
        slower (measured at 512 tokens), so x is widened first: five ops (four in fp32)."""
        r = self.rotary_dim
        x_rot = x if r == x.shape[-1] else x[..., :r]
        if not self.full_precision and x.dtype != torch.float32:
            cos, sin = self.angles_in(x.dtype)       # x*cos, rotate_half(x)*sin and their sum
            torch.add(x_rot * cos, x_rot.roll(r // 2, -1).mul_(sin), out=x_rot)   # each rounded
        elif x.device.type == "cpu":
            x32 = x_rot.float()         # x_rot itself when it is fp32
            rolled = x32.roll(r // 2, -1).mul_(self.signed_sin)
            torch.add(x32.mul_(self.cos), rolled, out=x_rot)
        else:
            torch.add(x_rot * self.cos, x_rot.roll(r // 2, -1) * self.signed_sin, out=x_rot)
        return x


def rotate_qk(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H + 2 Hkv, d] -> rotated q [T, H, d] and kv [T, 2 Hkv, d] (rotated K heads, then V
    heads; AttentionFn's v=None form): q and k rotate in one call, in place, so both stay views
    of `qkv` and the cache takes K and V in one write."""
    rot.rotate_(qkv.split([num_heads + num_kv_heads, num_kv_heads], dim=1)[0])
    q, kv = qkv.split([num_heads, 2 * num_kv_heads], dim=1)
    return q, kv
