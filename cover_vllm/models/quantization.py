"""Quantization (`quantization="int8" | "int4" | "int4:G" | "w8a8"`): which layers are
quantized, turning a model's projections into quantized ones, and loading them from a bf16/fp32
checkpoint (the format's math: layers/quantization/format.py; the matmuls: kernels.py,
w8a8_kernels.py there).

Formats (all computed at load, in fp32, from the tensor the unquantized model would have held):
* int8: symmetric per output channel: w ~ q * s, q int8 in [-127, 127], s = max|w_row| / 127.
* int4: asymmetric per group of G input columns (G = 128 by default; 32, 64, 128 or 256, what
  torch's CPU kernel accepts), the convention of torch's int4 kernels (tinygemm):
  w ~ (q - 8) * scale + zero, q in [0, 15], zero = min + 8 * scale.
* w8a8: int8's weights, and every projection's input quantized per row at run time (int8
  arithmetic, w8a8_kernels.py). Both are first rotated along the input columns by the same
  orthogonal block-Hadamard matrix (format.rotate_columns; the weight once at load,
  before its codes; the input on every call), which spreads the activations' outlier
  channels so that one int8 scale a row fits (`QuantConfig(rotation=False)` turns it off).
  Its input embedding table takes 12 bits a value too (int8
  rows + a 4-bit residual, format.quantize_embedding_rows; a row looked up is
  dequantized): at LLaDA-8B's shape the bf16 table (0.96 GiB) kept the model's peak at
  0.553 x bf16's, over the 0.55 bound, and int8 rows alone cost accuracy
  (docs/benchmarks.md "W8A8").
Scales and zeros are stored in the model dtype (the kernels take them in the activations'
dtype); codes are rounded against the stored, already-rounded scale and zero.

Which layers: every nn.Linear in a `FusedLinears` group (layers/common.py): attention q/k/v/o,
MLP gate/up/down, every MoE expert and the LM head, i.e. every matrix a token streams through;
and every module that quantizes its own non-Linear weights (stacked MoE experts,
layers/stacked_experts.py: hooks `check_stacked`, `quantize_stacked`, `stacked_tensors`,
`load_stacked`, `pack_stacked`). "int4" without a G takes the family's group when its registry
entry declares one (`int4_group`: DiffusionGemma's widths are multiples of 64, not 128).
Under w8a8 stacked experts stay weight-only int8 (`_stacked_config`: no W8A8 kernel per expert,
no TP row scales for them), so DiffusionGemma's experts run int8 and its other projections W8A8.
Embeddings (but w8a8's untied input table), norms and the MoE router (`mlp.gate`, in no group)
keep the model dtype. The LM head
is quantized by default (`QuantConfig.lm_head`): at LLaDA-8B's shape it is 6.5 % of the weights,
and leaving it in bf16 would put the int8 model over 0.55 x the bf16 peak (docs/benchmarks.md
"Quantized weights" has the measurement).

A quantized Linear stays the same module under the same name, so its owner's `parallel_plan()`
still declares it; `quantize_model` runs on the meta device after tensor parallelism has shrunk
the model to a rank's shard (distributed/tensor_parallel.py), so a rank quantizes exactly its
rows (column split) or columns (row split) and its scales follow them. Its `weight` parameter is
replaced by buffers (QUANT_BUFFERS): `qweight` (int8 [N, K], or uint8 [N, K/2]: two 4-bit codes
a byte, the even column in the high nibble, the layout CUDA's int4 pack takes), `weight_scale`
([N] or [N, K/G]) and, for int4, `weight_zero` [N, K/G]. `load_quantized` reads each such
weight a bounded chunk of rows at a time and quantizes it into place, so loading peaks at the
quantized bytes plus one chunk (LOAD_CHUNK_BYTES), never a whole bf16 tensor.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Iterator

import torch
from torch import nn

from cover_vllm.layers.base import Slice
from cover_vllm.layers.common import FusedLinears, projection_groups
from cover_vllm.layers.quantization.format import (QuantConfig, embedding_lookup, embedding_storage,
                                                   is_quantized, linear_buffers, parse_quantization,
                                                   quantize_embedding_rows, quantize_rows,
                                                   reference_linear, rotate_columns, rotation_block)
from cover_vllm.layers.quantization.kernels import QuantizedGroup
from cover_vllm.layers.quantization.w8a8_kernels import onednn_layout, resident_bytes
from cover_vllm.models.loader import load_into
from cover_vllm.models.registry import family_named

__all__ = ["QuantConfig", "parse_quantization", "quantize_model", "load_quantized",
           "check_quantization", "quantized_tensors", "kernel_extra_bytes", "reference_linear"]

LOAD_CHUNK_BYTES = 16 << 20     # rows of a checkpoint tensor staged at once; quantizing them
                                # takes ~4 x this in fp32 temporaries


# ---- quantized Linear layers ---------------------------------------------------------------

def quantized_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(qualified name, module) of every quantized Linear (and w8a8 Embedding) of `model`."""
    for name, module in model.named_modules():
        if is_quantized(module):
            yield name, module


def quantized_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name of the weight, tensor) for every quantized buffer: what a weight-byte
    count adds to the parameters (a sharded weight's buffers are sharded with it)."""
    for name, linear in quantized_linears(model):
        for buf in linear_buffers(linear).values():
            yield f"{name}.weight", buf
    for prefix, module in _stacked(model):
        for name, buf in module.stacked_tensors():
            yield f"{prefix}.{name}", buf


def _stacked(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module that quantizes its own (non-Linear) weights."""
    return [(n, m) for n, m in model.named_modules()
            if callable(getattr(m, "quantize_stacked", None))]


def _stacked_config(config: QuantConfig) -> QuantConfig:
    """The format of stacked experts: w8a8 keeps them weight-only int8 (module doc)."""
    return replace(config, method="int8") if config.method == "w8a8" else config


def for_model(model: nn.Module, config: QuantConfig | str | None) -> QuantConfig | None:
    """`config` as `model` applies it: "int4" without a G takes the family's `int4_group`."""
    config = parse_quantization(config)
    spec = getattr(model, "spec", None)
    if config is None or config.method != "int4" or config.explicit_group or spec is None:
        return config
    group = family_named(spec.family).int4_group
    return config if group is None else replace(config, group_size=group)


def kernel_extra_bytes(model: nn.Module, device: str = "cpu",
                       slices: dict[str, Slice] | None = None) -> int:
    """Bytes one rank's kernels keep beyond the buffers `quantized_tensors` counts: a W8A8
    group's kernel replaces its int8 codes and model-dtype scales by its own copy (oneDNN's
    padded blocks and compensation on CPU, w8a8_kernels.resident_bytes) and fp32 scales.
    `slices` (tensor_parallel.param_slices of rank 0) give a rank's shard shapes: each Linear's
    rows (a column split, 1/N or a copied kv head) or the group's input columns (row split)."""
    groups = [g for g in projection_groups(model)
              if g.quant is not None and g.quant.config.method == "w8a8"]
    if not groups:
        return 0
    names = {id(linear): prefix for prefix, linear in quantized_linears(model)}
    layout = onednn_layout() if str(device).startswith("cpu") else None
    slices = slices or {}
    extra = 0
    for group in groups:
        n, k = 0, group.linears[0].in_features
        for lin in group.linears:
            sl = slices.get(f"{names[id(lin)]}.weight")
            rows = lin.out_features
            if sl is not None and sl.dim == 0:
                rows = rows * sl.size // sl.full
            elif sl is not None:
                k = lin.in_features * sl.size // sl.full
            n += rows
        scale_bytes = linear_buffers(group.linears[0])["weight_scale"].element_size()
        extra += resident_bytes(n, k, device, layout) - n * (k + scale_bytes)
    return extra


def _head_groups(model: nn.Module) -> set[int]:
    head = getattr(model, "head", None)            # the LM head's group (LLaDA, StackedLM)
    return {id(head)} if isinstance(head, FusedLinears) else set()


def check_quantization(model: nn.Module, config: QuantConfig | None,
                       world_size: int = 1) -> None:
    """ValueError unless every Linear to quantize has an int4 group-aligned input width, on
    every rank (a row-parallel Linear's `parallel_plan()` splits its input over `world_size`)."""
    config = for_model(model, config)
    if config is None or config.method != "int4":
        return
    for _, module in _stacked(model):
        module.check_stacked(config, world_size)
    row_split: set[int] = set()
    for module in model.modules():
        declare = getattr(module, "parallel_plan", None)
        if callable(declare) and world_size > 1:
            plan = declare()
            row_split |= {id(getattr(module, a)) for a in (*plan.row, *plan.row_unreduced)}
    names = {id(m): n for n, m in model.named_modules()}
    for group in _selected_groups(model, config):
        for lin in group.linears:
            k = lin.in_features // (world_size if id(lin) in row_split else 1)
            if k % config.group_size:
                raise ValueError(
                    f"quantization={config.label!r}: {names.get(id(lin), 'a layer')} has {k} "
                    f"input columns per rank, not a multiple of the group size "
                    f"{config.group_size}; use int4:G with G dividing {k}, or int8")


def _selected_groups(model: nn.Module, config: QuantConfig) -> list[FusedLinears]:
    skip = set() if config.lm_head else _head_groups(model)
    return [g for g in projection_groups(model) if id(g) not in skip]


def _selected_embeddings(model: nn.Module, config: QuantConfig) -> list[nn.Embedding]:
    """The input embedding tables to quantize (`QuantConfig.quantizes_embedding`): every
    nn.Embedding of a model whose LM head is its own matrix (`tied` False: a tied head reads
    the table's `weight` directly, a model that does not say keeps it)."""
    if not config.quantizes_embedding or getattr(model, "tied", True):
        return []
    return [m for m in model.modules() if isinstance(m, nn.Embedding)]


def _quantize_weight(module: nn.Module, storage) -> None:
    """Replace `module`'s weight parameter by empty buffers: `storage(model dtype)` gives
    their names, shapes and dtypes."""
    weight = module.weight
    module.weight = None                                         # no longer a parameter
    for name, (shape, dtype) in storage(weight.dtype).items():
        module.register_buffer(name, torch.empty(shape, dtype=dtype, device=weight.device))


@torch.no_grad()
def quantize_model(model: nn.Module, config: QuantConfig | str | None) -> int:
    """Turn the projections of a meta-device `model` (already a rank's shard) into quantized
    Linears: each group gets a `QuantizedGroup`, each Linear the empty buffers of its format
    instead of its weight; w8a8 also stores the input embedding in 12 bits a value
    (`_selected_embeddings`, looked up by `embedding_lookup`). Returns how many modules were
    converted (0 for None)."""
    config = for_model(model, config)
    if config is None:
        return 0
    check_quantization(model, config)
    stacked = _stacked_config(config)
    count = sum(module.quantize_stacked(stacked) for _, module in _stacked(model))
    for group in _selected_groups(model, config):
        for lin in group.linears:
            _quantize_weight(lin, functools.partial(config.storage, lin.out_features,
                                                    lin.in_features))
            lin.quant_config = config
            lin.rotation_block = (rotation_block(getattr(lin, "full_in_features", lin.in_features))
                                  if config.rotates_inputs else 1)
            count += 1
        group.quant = QuantizedGroup(group, config)
        if len(group.linears) == 1:     # called as a module (TP's all-reduce hook still runs)
            group.linears[0].forward = group.__call__
    for emb in _selected_embeddings(model, config):
        _quantize_weight(emb, functools.partial(embedding_storage, emb.num_embeddings,
                                                emb.embedding_dim))
        emb.forward = functools.partial(embedding_lookup, emb)
        count += 1
    return count


# ---- loading -------------------------------------------------------------------------------

class _Without:
    """A WeightSource that no longer offers `hidden` (tensors already loaded elsewhere)."""

    def __init__(self, source, hidden: set[str]):
        self.source, self.hidden = source, hidden

    def names(self) -> set[str] | None:
        names = self.source.names()
        return None if names is None else names - self.hidden

    def shape(self, name: str):
        return self.source.shape(name)

    def fill(self, name: str, dst: torch.Tensor, sl: Slice | None) -> None:
        self.source.fill(name, dst, sl)

    def file_of(self, name: str) -> str:
        return self.source.file_of(name)

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


def _row_chunks(full_rows: int, sl: Slice | None, row_bytes: int) -> Iterator[tuple[int, Slice]]:
    """(first destination row, the rows to read as a dim-0 Slice of the full tensor), at most
    LOAD_CHUNK_BYTES of full-width rows each."""
    per = max(1, LOAD_CHUNK_BYTES // max(1, row_bytes))
    ranges = sl.ranges if sl is not None and sl.dim == 0 else ((0, full_rows),)
    at = 0
    for first, size in ranges:
        for a in range(0, size, per):
            n = min(per, size - a)
            yield at + a, Slice(0, first + a, n, full_rows)
        at += size


@torch.no_grad()
def _load_linear(linear: nn.Module, source, name: str, sl: Slice | None) -> None:
    """Quantize checkpoint tensor `name` (its TP slice `sl`) into `linear`'s buffers (a
    quantized Linear, or w8a8's Embedding)."""
    bufs = linear_buffers(linear)
    dtype = bufs["weight_scale"].dtype           # the model dtype: what it would have loaded as
    if isinstance(linear, nn.Embedding):
        shard = (linear.num_embeddings, linear.embedding_dim)
        quantize = functools.partial(_quantize_embedding_rows, dtype)
    else:
        shard = (linear.out_features, linear.in_features)
        quantize = functools.partial(_quantize_linear_rows, linear.quant_config, dtype)
    want = sl.full_shape(shard) if sl is not None else shard
    got = source.shape(name)
    if got is not None and tuple(got) != want:
        raise ValueError(f"{name}: checkpoint shape {tuple(got)} != model shape {want}")
    block = getattr(linear, "rotation_block", 1)       # w8a8: rotate the input columns first
    if sl is not None and sl.dim == 1 and any(a % block for r in sl.ranges for a in r):
        raise ValueError(f"{name}: this rank's input columns {sl.ranges} split w8a8's rotation "
                         f"blocks of {block} columns; use QuantConfig('w8a8', rotation=False)")
    if bufs["qweight"].device.type == "meta":
        return                    # a shapes-only model: checked above, nothing to read
    full_rows, full_cols = want
    for at, rows in _row_chunks(full_rows, sl, full_cols * dtype.itemsize):
        stage = torch.empty((rows.size, full_cols), dtype=dtype)
        source.fill(name, stage, rows)
        stage = rotate_columns(stage, block)      # fp32 when it rotates (quantized in fp32)
        amax = None
        if sl is not None and sl.dim == 1:        # a row-parallel rank's input columns; int8
            amax = stage.abs().amax(dim=1)        # scales by the whole row, int4's groups lie
            stage = sl.take(stage)                # inside the rank's columns: both are TP=1's
        for key, value in quantize(stage, amax).items():
            bufs[key][at:at + rows.size].copy_(value)


def _quantize_linear_rows(config: QuantConfig, dtype: torch.dtype, w: torch.Tensor,
                          amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return quantize_rows(w, config, dtype, amax)


def _quantize_embedding_rows(dtype: torch.dtype, w: torch.Tensor,
                             amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return quantize_embedding_rows(w, dtype)           # replicated: never a column slice


def load_quantized(model: nn.Module, source, slices: dict[str, Slice] | None = None,
                   pack: bool = False) -> None:
    """`loader.load_into` for a model with quantized Linears: each quantized weight is read a
    chunk of rows at a time (its TP slice only) and quantized into its buffers; every other
    parameter loads as usual, after them. `pack`: hand each group to its kernel as soon as its
    Linears are loaded (`QuantizedGroup.pack`), so a kernel that copies the codes (W8A8's
    oneDNN blocks) adds one group's copy at a time, while the embedding is not yet loaded,
    instead of the largest group's on top of every weight."""
    slices = slices or {}
    names = {id(linear): prefix for prefix, linear in quantized_linears(model)}
    claimed = set()
    for group in projection_groups(model):
        if group.quant is None:
            continue
        for linear in group.linears:
            name = f"{names[id(linear)]}.weight"
            _load_linear(linear, source, name, slices.get(name))
            claimed.add(name)
        if pack:
            group.pack()
    for prefix, module in _stacked(model):
        if module.quant_config is not None:
            claimed |= module.load_stacked(source, prefix, slices)
    for prefix, module in quantized_linears(model):       # w8a8's embedding: replicated
        if isinstance(module, nn.Embedding):
            _load_linear(module, source, f"{prefix}.weight", None)
            claimed.add(f"{prefix}.weight")
    load_into(model, _Without(source, claimed) if claimed else source, slices)



def load_quantized_model(model_dir, quantization: QuantConfig | str | None,
                         dtype: str | torch.dtype = "float32", load_format: str = "auto",
                         seed: int = 0, pack: bool = True) -> nn.Module:
    """`loader.load_model` with quantized projections: the dense oracle (`model(input_ids)`)
    of what the engine runs; `pack=False` keeps the slow reference path."""
    from cover_vllm.layers.common import pack_projections
    from cover_vllm.models.builtin import resolve_model
    from cover_vllm.models.loader import build_model, materialize, resolve_dtype, weight_source
    from cover_vllm.models.spec import ModelSpec

    resolved = resolve_model(model_dir)
    spec = ModelSpec.from_config(resolved.config)
    model = build_model(spec, resolve_dtype(dtype, spec), "meta")
    source = weight_source(resolved, model, load_format, seed)
    quantize_model(model, quantization)
    materialize(model, "cpu")
    load_quantized(model, source, pack=pack)
    if pack:
        pack_projections(model)
    return model.eval().requires_grad_(False)
