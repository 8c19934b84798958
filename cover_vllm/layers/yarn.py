"""YaRN RoPE (Peng et al. 2023, "YaRN: Efficient Context Window Extension", §3.2-3.4) and the
Llama-4 query scale after RoPE, as transformers' `ministral3` computes them (Nemotron-Labs-
Diffusion's backbone). Added beside layers/rotary.py: the rotation itself is its `Rotation`.

Every number is read from config.json's `rope_parameters` (or `rope_scaling`): `factor`,
`original_max_position_embeddings`, `beta_fast` / `beta_slow`, `truncate`, `attention_factor` or
`mscale` / `mscale_all_dim`, `llama_4_scaling_beta`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from cover_vllm.layers.rotary import Rotation, RotaryEmbedding


@dataclass(frozen=True)
class YarnParams:
    """YaRN's knobs from config.json (`from_config`)."""

    theta: float
    factor: float
    original_max: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0          # cos and sin are multiplied by it
    llama4_beta: float | None = None       # q *= 1 + beta * log(1 + floor(pos / original_max))

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "YarnParams | None":
        """The YaRN parameters, or None when the config's RoPE is not YaRN."""
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type") or rope.get("type")
        if kind in (None, "default"):
            return None
        if kind != "yarn":
            raise ValueError(f"rope_type={kind!r} is not supported; only 'yarn' and 'default'")
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        factor = float(rope["factor"])
        attention = rope.get("attention_factor")
        if attention is None:
            ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all
                         else yarn_mscale(factor))
        beta = rope.get("llama_4_scaling_beta")
        return cls(theta=theta, factor=factor,
                   original_max=int(rope.get("original_max_position_embeddings")
                                    or cfg["max_position_embeddings"]),
                   beta_fast=float(rope.get("beta_fast") or 32.0),
                   beta_slow=float(rope.get("beta_slow") or 1.0),
                   truncate=bool(rope.get("truncate", True)),
                   attention_factor=float(attention),
                   llama4_beta=None if beta is None else float(beta))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·mscale·ln(s) + 1 (1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(p: YarnParams, dim: int) -> torch.Tensor:
    """[dim/2] fp32 inverse frequencies: extrapolated (theta^(-2k/d)) for the fast dimensions
    that turn more than `beta_fast` times over the original context, interpolated (divided by
    `factor`) for those turning fewer than `beta_slow` times, a linear ramp between (§3.2)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(p.original_max / (rotations * 2 * math.pi)) / (2 * math.log(p.theta))

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = p.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (p.factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                     # 1: extrapolate (high frequency), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep


def llama4_q_scale(positions: torch.Tensor, beta: float, original_max: int) -> torch.Tensor:
    """[T] fp32 Llama-4 attention temperature 1 + beta·ln(1 + floor(pos / original_max)) of
    absolute positions (exactly 1 below original_max); integer positions, so floor(pos / m) is
    their floor division. ln(1 + q) is log1p(q) (transformers: log of 1 + q; bit-identical to it for every
    position below 300000, measured), one op fewer a forward: #42's bar of 32 device ops per
    layer holds. Four device ops."""
    return torch.log1p(torch.floor_divide(positions, original_max)).mul_(beta).add_(1)


class YarnRotaryEmbedding(RotaryEmbedding):
    """RoPE with YaRN's inverse frequencies and cos / sin times `attention_factor`; when the
    config sets `llama_4_scaling_beta`, `at` returns a rotation that also scales the query heads
    after rotating them (ScaledQRotation). `q_fraction` = H / (H + Hkv): which leading heads of
    the rotated q|k view are queries (the same under tensor parallelism, both split alike)."""

    def __init__(self, head_dim: int, params: YarnParams, q_fraction: float):
        self.params, self.q_fraction = params, q_fraction
        super().__init__(head_dim, params.theta)
        self.position_bound: int | None = None     # `positions_below`; None: unknown

    def _frequencies(self, device) -> torch.Tensor:
        inv_freq = yarn_inv_freq(self.params, self.rotary_dim)
        return inv_freq if device is None else inv_freq.to(device)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super()._angles(positions)
        a = self.params.attention_factor
        return (cos, sin) if a == 1.0 else (cos * a, sin * a)

    def at(self, positions: torch.Tensor) -> Rotation:
        rot = super().at(positions)
        p = self.params
        if p.llama4_beta is None or self._q_scale_is_one():
            return rot
        scale = llama4_q_scale(positions, p.llama4_beta, p.original_max)
        return ScaledQRotation(rot, scale[:, None, None], self.q_fraction)

    def _q_scale_is_one(self) -> bool:
        """Whether the host knows every position of this forward is below
        original_max_position_embeddings (`positions_below`): the Llama-4 scale is then exactly
        1 (log1p(0) = 0 times a finite beta, plus 1), and multiplying by 1 leaves every bit, so
        the forward skips it (one op per layer and nine per forward; issue #50)."""
        bound, beta = self.position_bound, self.params.llama4_beta
        return bound is not None and bound <= self.params.original_max and math.isfinite(beta)


def yarn_ropes(model: torch.nn.Module) -> list["YarnRotaryEmbedding"]:
    """The model's YaRN rotations (for `positions_below`), found once per model."""
    ropes = model.__dict__.get("_yarn_ropes")
    if ropes is None:
        ropes = [m for m in model.modules() if isinstance(m, YarnRotaryEmbedding)]
        model.__dict__["_yarn_ropes"] = ropes
    return ropes


@contextlib.contextmanager
def positions_below(ropes: list[YarnRotaryEmbedding], positions: torch.Tensor | int):
    """Within this block each of `ropes` knows that every position it is given is below the
    largest of the host tensor `positions` (or the int itself) plus one (the model runner's
    eager forward; a captured graph replays for any positions and never gets a bound)."""
    if not ropes or (isinstance(positions, torch.Tensor) and positions.numel() == 0):
        yield
        return
    bound = (positions if isinstance(positions, int) else int(positions.max())) + 1
    for rope in ropes:
        rope.position_bound = bound
    try:
        yield
    finally:
        for rope in ropes:
            rope.position_bound = None


class ScaledQRotation(Rotation):
    """A rotation that, after rotating the q|k heads, multiplies the query heads by a per-token
    scale (the Llama-4 temperature, cast to the query's dtype as transformers applies it: one
    rounding of the rotated q, then one of the product). The per-head factors [T, H + Hkv, 1]
    (the scale on query heads, exactly 1 on key heads) are built once per forward, on the first
    layer, so a layer adds one in-place multiply and no view."""

    def __init__(self, rot: Rotation, scale: torch.Tensor, q_fraction: float):
        super().__init__(rot.cos, rot.signed_sin, rot.rotary_dim)
        self.scale, self.q_fraction = scale, q_fraction      # scale: [T, 1, 1] fp32
        self._factors: torch.Tensor | None = None

    def rotate_(self, x: torch.Tensor) -> torch.Tensor:
        super().rotate_(x)
        if self._factors is None or self._factors.shape[1] != x.shape[1] \
                or self._factors.dtype != x.dtype:
            heads = x.shape[1]
            q_heads = round(heads * self.q_fraction)
            factors = torch.ones(x.shape[0], heads, 1, dtype=x.dtype, device=x.device)
            factors[:, :q_heads].copy_(self.scale)          # cast to x's dtype, as .to()
            self._factors = factors
        return x.mul_(self._factors)
