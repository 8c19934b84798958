"""Weight loading: safetensors (single file or sharded index), dtype resolution, dummy weights."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from cover_vllm.config import LOAD_FORMATS
from cover_vllm.models.spec import ModelSpec

# family -> (module, class); imported lazily so a family's extra needs only matter when used.
MODEL_CLASSES = {
    "llada": ("cover_vllm.models.llada", "LLaDAModelLM"),
    "dream": ("cover_vllm.models.dream", "DreamModel"),
    "llada_moe": ("cover_vllm.models.llada_moe", "LLaDAMoEModelLM"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, spec: ModelSpec, device: str = "cpu") -> torch.dtype:
    """'auto' takes config.json's torch_dtype (fp16 becomes fp32 on CPU, where it is slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = str(spec.hf_config.get("torch_dtype") or "float32")
        if name == "float16" and device == "cpu":
            name = "float32"
        return DTYPES.get(name, torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {['auto', *DTYPES]}")
    return DTYPES[dtype]


def build_model(spec: ModelSpec, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> nn.Module:
    """Construct the family's module with uninitialised weights on `device` ("meta" is allowed)."""
    module_name, class_name = MODEL_CLASSES[spec.family]
    cls = getattr(importlib.import_module(module_name), class_name)
    with torch.device(device):
        model = cls(spec)
    return model.to(dtype=dtype)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r} "
        "(use load_format='dummy' for random weights)")


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every tensor from the checkpoint into `model`; names must match exactly."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} in {path.name} has no place in "
                                     f"the {type(model).__name__} module")
                tensor = f.get_tensor(name)
                target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                     f"model shape {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor.to(target.dtype))
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"checkpoint in {str(model_dir)!r} lacks {len(missing)} tensors, "
                         f"e.g. {missing[:3]}")


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights (normal std for matrices, ones for norms) for benchmarks at any size."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def instantiate(resolved, spec: ModelSpec, dtype: torch.dtype, load_format: str = "auto",
                seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """Build `resolved`'s module and fill it (checkpoint or dummy weights); eval mode, no grads."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}; choose one of {list(LOAD_FORMATS)}")
    model = build_model(spec, dtype, device)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif resolved.path is None:
        raise ValueError(f"built-in config {resolved.name!r} has no weights; "
                         "use load_format='dummy'")
    else:
        load_weights(model, resolved.path)
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
