"""Building blocks shared by the model families: RMSNorm, SwiGLU MLP, fused projections, and the
HF Llama/Qwen2-named attention, decoder layer and decoder stack used by Dream and LLaDA-MoE.

Each matches the official code's numerics (RMSNorm and RoPE computed in fp32; see
../shared/golden/README.md "Quirks"; RoPE: layers/rotary.py). LLaDA keeps its own block (its
tensors sit flat on the block under different names) but uses the same RMSNorm."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.layers.base import AttentionFn, ModelDims, ParallelPlan
from cover_vllm.layers.rotary import Rotation, rotate_qk


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, the normalisation in fp32.

    Rounding in bf16/fp16 (issue #48): by default the official order of LLaDA, Dream, LLaDA-MoE
    and LLaDA2 (normalise in fp32, round to x's dtype, then multiply by the weight in x's
    dtype: two roundings). `weight_in_fp32=True` is flash-attn's `rms_norm_fn` order (SDAR's
    official norm: the weight multiplies in fp32 before the one rounding); `fast` (the engine
    option `fast_norm`, set by `use_fast_norm`) takes that one-op order for every norm. fp32:
    every order gives the same bits."""

    def __init__(self, size: int, eps: float, weight_in_fp32: bool = False):
        super().__init__()
        self.eps, self.weight_in_fp32 = eps, weight_in_fp32
        self.fast = False
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`F.rms_norm` without its weight computes in fp32 and rounds once to x's dtype, bit
        for bit `(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(x.dtype)`
        (tests/test_bf16_official_order.py); the weight then multiplies in x's dtype. On the
        meta device both forms count the same ops (tests/test_op_count.py)."""
        if self.fast or self.weight_in_fp32 or x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight_free(x) * self.weight

    def weight_free(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps)     # the caller applies the weight


def use_fast_norm(model: nn.Module, fast: bool = True) -> None:
    """Every RMSNorm of `model` in the one-op order (`F.rms_norm` with its weight: one rounding
    in bf16/fp16) or back in the official order (EngineConfig.fast_norm)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fast = fast


PACK_MAX_BYTES = 256 << 20     # largest group packed: its copy is transient extra memory


class FusedLinears:
    """Linear layers that read the same input, run as one GEMM.

    `fuse()` re-points each layer's weight (and bias) at a row slice of one [sum(out), in]
    tensor (on every device, meta included): the layers keep their names, shapes and in-place
    loading, and tensor-parallel shards fuse per rank. A layer whose weight left the fused tensor
    (`model.to(...)`) makes `__call__` run one GEMM per layer, so the result never goes stale."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None    # oneDNN-blocked weight (`pack`)
        self.quant = None       # weight-only quantized storage (layers/quantization/kernels.py)

    @property
    def sizes(self) -> list[int]:
        return [lin.out_features if lin.weight is None else lin.weight.shape[0]   # the
                for lin in self.linears]                       # (sharded) rows; None: quantized

    @torch.no_grad()
    def pack(self) -> bool:
        """Replace the fused weight by oneDNN's blocked copy of it (CPU, bf16): the GEMM skips
        re-blocking it on every call (1.5-2.4x faster at 32 rows here, same bits). The plain
        weights are freed (zero-row placeholders); a group above PACK_MAX_BYTES (a 7-8B LM
        head, 1 GB) stays plain, so memory never grows past one group's copy. Only an engine
        should call this. Returns whether it packed; a quantized group hands its codes to its
        kernel instead (`QuantizedGroup.pack`)."""
        if self.quant is not None:
            return self.quant.pack()
        if (not self._fused() or self.weight.device.type != "cpu"
                or self.weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available()
                or self.weight.numel() * self.weight.element_size() > PACK_MAX_BYTES):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        self.weight = None
        for lin in self.linears:
            lin.weight = nn.Parameter(lin.weight.new_empty(0, lin.in_features),
                                      requires_grad=False)
        if len(self.linears) == 1:      # a lone layer is still called as a module (its forward
            self.linears[0].forward = self.__call__    # hooks, e.g. TP's all-reduce, still run)
        return True

    @torch.no_grad()
    def fuse(self, copy: bool = True) -> None:
        """Allocate the fused tensors and make every layer's parameters views of them (`copy`:
        keep their values; False right after materialising, when they hold nothing)."""
        if self.quant is not None:              # quantized: its buffers fuse the same way
            self.quant.fuse(copy)
            return
        self.weight = self._stack([lin.weight for lin in self.linears], copy)
        biases = [lin.bias for lin in self.linears]
        self.bias = None if any(b is None for b in biases) else self._stack(biases, copy)
        for i, lin in enumerate(self.linears):
            lin.weight = nn.Parameter(self._part(self.weight, i), requires_grad=False)
            if self.bias is not None:
                lin.bias = nn.Parameter(self._part(self.bias, i), requires_grad=False)

    def _stack(self, parts: list[torch.Tensor], copy: bool) -> torch.Tensor:
        if copy:
            return torch.cat([p.detach() for p in parts])
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        return torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)

    def _part(self, fused: torch.Tensor, i: int) -> torch.Tensor:
        start = sum(self.sizes[:i])
        return fused[start:start + self.sizes[i]]

    def _fused(self) -> bool:
        """Whether every layer's parameters still are the slices `fuse` made."""
        if self.weight is None:
            return False
        start = 0
        for lin, size in zip(self.linears, self.sizes):
            if not (_is_rows(lin.weight, self.weight, start)
                    and (self.bias is None or _is_rows(lin.bias, self.bias, start))):
                return False
            start += size
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, sum(out)]: the layers' outputs side by side, from one GEMM."""
        if self.quant is not None:
            return self.quant(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if not self._fused():
            return torch.cat([lin(x) for lin in self.linears], dim=-1)
        return F.linear(x, self.weight, self.bias)


def _is_rows(t: torch.Tensor | None, fused: torch.Tensor, start: int) -> bool:
    """Whether `t` is `fused`'s row slice starting at row `start` (same storage and dtype; the
    storage's identity as well, since on the meta device every storage starts at address 0)."""
    if t is None or t.dtype != fused.dtype:
        return False
    offset = start * fused.stride(0) * fused.element_size()
    return (t.data_ptr() == fused.data_ptr() + offset
            and t.untyped_storage()._cdata == fused.untyped_storage()._cdata)


def projection_groups(model: nn.Module) -> list[FusedLinears]:
    """Every `FusedLinears` of the modules that group their projections (`fused_groups()`)."""
    groups = []
    for module in model.modules():
        of = getattr(module, "fused_groups", None)
        if callable(of):
            groups += of()
    return groups


def fuse_projections(model: nn.Module, copy: bool = True) -> None:
    """Fuse the projections of every module that groups them (`fused_groups()`), then stack
    what a module runs grouped (`stack_experts`: layers/expert_stack.py)."""
    for group in projection_groups(model):
        group.fuse(copy)
    for module in model.modules():
        if callable(getattr(module, "stack_experts", None)):
            module.stack_experts(copy)


def pack_projections(model: nn.Module) -> int:
    """Pack every fused group for oneDNN (`FusedLinears.pack`) and every module's quantized
    stacked weights (`pack_stacked`: MoE experts); returns how many were packed."""
    stacked = [m.pack_stacked() for m in model.modules()
               if callable(getattr(m, "pack_stacked", None))]
    return sum(group.pack() for group in projection_groups(model)) + sum(stacked)


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with HF Llama/Qwen2 tensor names; gate and up
    run as one GEMM once fused (`FusedLinears`).

    Tensor parallel: gate/up column-, down row-parallel. `reduce_output=False` marks an MLP whose
    partial output a parent module sums once (a sparse MoE block's experts and shared expert):
    its row-parallel `down_proj` is not all-reduced on its own."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 reduce_output: bool = True):
        super().__init__()
        self.reduce_output = reduce_output
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)
        self.down = FusedLinears(self.down_proj)

    def fused_groups(self) -> list[FusedLinears]:
        return [self.gate_up, self.down]

    def parallel_plan(self) -> ParallelPlan:
        if self.reduce_output:
            return ParallelPlan(column=("gate_proj", "up_proj"), row=("down_proj",))
        return ParallelPlan(column=("gate_proj", "up_proj"), row_unreduced=("down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up(x)))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2M] (gate, up side by side) -> silu(gate) * up [T, M]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SelfAttention(nn.Module):
    """`self_attn.{q,k,v,o}_proj` (+ optional per-head `q_norm`/`k_norm`), RoPE, then the caller's
    AttentionFn (dense or paged). Grouped-query heads: query head h reads kv head h // group.
    q, k and v run as one GEMM once fused."""

    def __init__(self, dims: ModelDims, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: float | None = None, clip_qkv: float | None = None):
        super().__init__()
        d, hd = dims.hidden_size, dims.head_dim
        self.dims, self.clip_qkv = dims, clip_qkv
        self.q_proj = nn.Linear(d, dims.num_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, dims.num_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, dims.num_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(dims.num_heads * hd, d, bias=o_bias)
        self.q_norm = RMSNorm(hd, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(hd, qk_norm_eps) if qk_norm_eps is not None else None
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        self.out = FusedLinears(self.o_proj)

    def fused_groups(self) -> list[FusedLinears]:
        return [self.qkv, self.out]

    def parallel_plan(self) -> ParallelPlan:
        """Heads split over the ranks (q: H/N, k and v: Hkv/N each); o_proj reduces."""
        return ParallelPlan(column=("q_proj", "k_proj", "v_proj"), row=("o_proj",),
                            local_dims=True)

    def forward(self, h: torch.Tensor, layer: int, rot: Rotation,
                attn: AttentionFn) -> torch.Tensor:
        """h: [T, hidden] (already normed) -> [T, hidden] attention output."""
        t, dims = h.shape[0], self.dims
        heads, kv_heads = dims.num_heads, dims.num_kv_heads
        qkv = self.qkv(h).view(t, heads + 2 * kv_heads, dims.head_dim)
        if self.q_norm is not None:       # per-head RMSNorm after projection, before RoPE,
            qk = qkv.split([heads + kv_heads, kv_heads], dim=1)[0]    # written back in place
            if self.q_norm.weight_in_fp32 and qk.dtype != torch.float32:
                qk_hat = self.q_norm.weight_free(qk.float())     # SDAR: the weight in fp32,
            else:                                                # one rounding into qk
                qk_hat = self.q_norm.weight_free(qk)             # rounded, then the weight
            torch.mul(qk_hat, self._qk_norm_weight(heads, kv_heads), out=qk)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        q, kv = rotate_qk(qkv, heads, kv_heads, rot)          # K and V side by side: one write
        return self.o_proj(attn(layer, q, kv))                          # attn: [T, H * d]

    def _qk_norm_weight(self, heads: int, kv_heads: int) -> torch.Tensor:
        """[H + Hkv, d]: q_norm's weight per query head, then k_norm's per kv head (one multiply,
        the same products as two); rebuilt when either weight is replaced or written."""
        wq, wk = self.q_norm.weight, self.k_norm.weight
        key = (wq.untyped_storage()._cdata, wq.data_ptr(), wq._version, wk.data_ptr(),
               wk._version, heads, kv_heads, wq.dtype)
        if getattr(self, "_qk_weight_key", None) != key:
            d = wq.shape[0]
            self._qk_weight = torch.cat([wq.expand(heads, d), wk.expand(kv_heads, d)])
            self._qk_weight_key = key
        return self._qk_weight


class DecoderLayer(nn.Module):
    """Pre-norm block: x += self_attn(input_layernorm(x)); then, with
    h = post_attention_layernorm(x), x += mlp(h) (+ shared_expert(h) when the layer has one)."""

    def __init__(self, self_attn: SelfAttention, mlp: nn.Module, eps: float,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        hidden = self_attn.dims.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp
        self.shared_expert = shared_expert

    def forward(self, x: torch.Tensor, layer: int, rot: Rotation,
                attn: AttentionFn) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), layer, rot, attn)
        h = self.post_attention_layernorm(x)
        out = self.mlp(h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(h)
        return x + out


class DecoderStack(nn.Module):
    """The HF `model.` submodule: `embed_tokens`, `layers.{i}`, final `norm`."""

    def __init__(self, dims: ModelDims, layers: list[DecoderLayer], eps: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(dims.hidden_size, eps)

    def forward(self, x: torch.Tensor, rot: Rotation, attn: AttentionFn) -> torch.Tensor:
        """x: [T, hidden] input embeddings rotated by `rot` -> [T, hidden] final hidden states."""
        for i, layer in enumerate(self.layers):
            x = layer(x, i, rot, attn)
        return self.norm(x)


class StackedLM(nn.Module, ABC):
    """Shared glue of the HF-named families (Dream, LLaDA-MoE): a `model.` DecoderStack, an
    optional untied `lm_head`, RoPE. Subclasses build the stack and define the dense `forward`
    (their padding semantics differ)."""

    def __init__(self, spec, dims: ModelDims, stack: DecoderStack, rope: RotaryEmbedding,
                 tied: bool):
        super().__init__()
        self.spec, self.dims, self.model, self.rope, self.tied = spec, dims, stack, rope, tied
        if not tied:
            self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)
            self.head = FusedLinears(self.lm_head)

    def fused_groups(self) -> list[FusedLinears]:
        return [] if self.tied else [self.head]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    def forward_tokens(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionFn) -> torch.Tensor:
        """[T, hidden] at positions [T] -> [T, hidden] final hidden states."""
        return self.model(inputs_embeds, self.rope.at(positions), attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] raw (unshifted) logits."""
        if self.tied:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Dense full-sequence logits [B, L, V]."""
