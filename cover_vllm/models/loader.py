"""Model construction and weight loading that cost the weights and nothing more.

The module is built on the meta device (no storage, no initialisation) in its final dtype; a
tensor-parallel rank then shrinks it to its shard, still on meta (distributed/tensor_parallel.py);
`materialize` gives every parameter uninitialised storage on the target device and rebuilds the
non-persistent buffers (RoPE frequencies); `load_into` fills each parameter in place from a
`WeightSource` (models/weights.py): the checkpoint's safetensors files read slice by slice, or
the chunked dummy generator. Peak memory is the weights plus a 64 MiB staging buffer.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from cover_vllm.config import LOAD_FORMATS
from cover_vllm.layers.base import Slice
from cover_vllm.layers.common import fuse_projections
from cover_vllm.models.registry import family_named
from cover_vllm.models.spec import ModelSpec
from cover_vllm.models.weights import CheckpointWeights, DummyWeights, WeightSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, spec: ModelSpec, device: str = "cpu") -> torch.dtype:
    """'auto' takes config.json's torch_dtype, except on a CPU where it would be slow: fp16
    becomes fp32, and bf16 does too unless the CPU has bf16 arithmetic (`cpu_has_bf16`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = str(spec.hf_config.get("torch_dtype") or "float32")
        on_cpu = torch.device(device).type == "cpu"
        if on_cpu and (name == "float16" or (name == "bfloat16" and not cpu_has_bf16())):
            name = "float32"
        return DTYPES.get(name, torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {['auto', *DTYPES]}")
    return DTYPES[dtype]


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AVX512-BF16 or AMX-BF16, Arm BF16), read
    from /proc/cpuinfo; without it bf16 GEMMs are emulated and slower than fp32."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Turns every `torch.nn.init` call (a module's `reset_parameters`) into a no-op while a
    model is built on meta, where there are no values to set anyway. `nn.Embedding`'s
    `normal_` on a meta tensor otherwise goes through torch's Python reference ops, whose
    first use imports torch._dynamo: 143 MiB of resident memory in every engine process."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **(kwargs or {}))


def build_model(spec: ModelSpec, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> nn.Module:
    """The family's module with uninitialised weights of `dtype` on `device` ("meta": no storage
    at all). No initialiser ever runs, so this costs nothing but the final storage."""
    cls = family_named(spec.family).model_cls()   # imported lazily (models/registry.py)
    with torch.device("meta"), _SkipInit():
        model = cls(spec)
    model.to(dtype=dtype)                      # free on meta; buffers are rebuilt in fp32
    if str(device) != "meta":
        materialize(model, device)
    return model


def materialize(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Give a meta model uninitialised storage on `device` (pages are committed only when the
    weights are written), fuse its projections (`fuse_projections`: weights that run as one GEMM
    share one tensor, which loading then fills in place) and rebuild its non-persistent buffers
    (`reset_buffers` hooks)."""
    model.to_empty(device=device)
    fuse_projections(model, copy=False)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model


def param_bytes(model: nn.Module) -> int:
    """Bytes of every parameter (works on meta models)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weight_source(resolved, model: nn.Module, load_format: str = "auto",
                  seed: int = 0) -> WeightSource:
    """The checkpoint of `resolved`, or dummy weights (shapes taken from the unsharded `model`)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}; choose one of {list(LOAD_FORMATS)}")
    if load_format == "dummy":
        return DummyWeights({n: tuple(p.shape) for n, p in model.named_parameters()}, seed)
    if resolved.path is None:
        raise ValueError(f"built-in config {resolved.name!r} has no weights; "
                         "use load_format='dummy'")
    return CheckpointWeights(Path(resolved.path))


def _check_names(model: nn.Module, source: WeightSource) -> None:
    names = source.names()
    if names is None:
        return
    spec = getattr(model, "spec", None)
    if spec is not None:                  # tensors the family never loads (a vision tower)
        family = family_named(spec.family)
        names = {n for n in names if not family.ignores(n)}
    params = dict(model.named_parameters())
    extra = sorted(names - set(params))
    if extra:
        where = source.file_of(extra[0]) if hasattr(source, "file_of") else "the checkpoint"
        raise ValueError(f"checkpoint tensor {extra[0]!r} in {where} has no place in the "
                         f"{type(model).__name__} module" + (
                             f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    missing = sorted(set(params) - names)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors of "
                         f"{type(model).__name__}, e.g. {missing[:3]}")


@torch.no_grad()
def load_into(model: nn.Module, source: WeightSource,
              slices: dict[str, Slice] | None = None) -> None:
    """Fill every parameter of a materialized `model` from `source`, in place; a parameter named
    in `slices` is a tensor-parallel shard and gets only its slice. ValueError names the tensor
    on a missing, unexpected or wrongly shaped tensor. Parameters on the "meta" device (a
    shapes-only engine) are checked and left without values."""
    _check_names(model, source)
    slices = slices or {}
    for name, param in model.named_parameters():
        sl = slices.get(name)
        want = sl.full_shape(tuple(param.shape)) if sl is not None else tuple(param.shape)
        got = source.shape(name)
        if got is not None and tuple(got) != want:
            raise ValueError(f"{name}: checkpoint shape {tuple(got)} != model shape {want}")
        if param.device.type == "meta":
            continue                  # a shapes-only model: checked above, nothing to read
        if sl is not None and sl.zero:
            param.zero_()
        else:
            source.fill(name, param.data, sl)
    close = getattr(source, "close", None)
    if callable(close):
        close()


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every tensor of the checkpoint in `model_dir` into `model`; names must match."""
    load_into(model, CheckpointWeights(Path(model_dir)))


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights (N(0, std) matrices, ones for norms, zeros for other 1-D tensors)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    load_into(model, DummyWeights(shapes, seed, std))


def instantiate(resolved, spec: ModelSpec, dtype: torch.dtype, load_format: str = "auto",
                seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """Build `resolved`'s whole module and fill it (checkpoint or dummy); eval mode, no grads."""
    model = build_model(spec, dtype, "meta")
    source = weight_source(resolved, model, load_format, seed)
    materialize(model, device)
    load_into(model, source)
    return model.eval().requires_grad_(False)


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               load_format: str = "auto", seed: int = 0) -> nn.Module:
    """Load a checkpoint directory (or built-in name) as an eval-mode torch module.

    `model.forward(input_ids, attention_mask=None)` returns full-sequence logits [B, L, V].
    """
    from cover_vllm.models.builtin import resolve_model

    resolved = resolve_model(model_dir)
    spec = ModelSpec.from_config(resolved.config)
    return instantiate(resolved, spec, resolve_dtype(dtype, spec), load_format, seed)
