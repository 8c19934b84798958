"""`cover-vllm make-checkpoint`: a full-size checkpoint in the official layout, random values.

Writes `config.json`, `model.safetensors.index.json` (`metadata.total_size`, `weight_map`) and
shards `model-0000i-of-0000N.safetensors` of at most `max_shard_bytes` (5 GB, as the official
uploads), tensors under the official names in module order. Values are the dummy weights of
models/weights.py for `seed`, generated and written a chunk at a time, so writing an 8B
checkpoint needs a few tens of MB; loading it gives exactly what `load_format="dummy"` builds.
This exercises the real loading path at the sizes users run, with no hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from cover_vllm.models.loader import build_model
from cover_vllm.models.registry import family_named
from cover_vllm.models.safetensors_io import ST_NAMES, write_safetensors
from cover_vllm.models.spec import ModelSpec
from cover_vllm.models.weights import DummyWeights

MAX_SHARD_BYTES = 5_000_000_000


@dataclass(frozen=True)
class CheckpointSpec:
    config: dict[str, Any]                   # config.json contents (its shape and token ids)
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    max_shard_bytes: int = MAX_SHARD_BYTES
    progress: bool = True


def _shards(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
            max_bytes: int) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Consecutive groups of at most `max_bytes` (a bigger single tensor gets its own shard)."""
    groups, size = [[]], 0
    for t in tensors:
        nbytes = t[1].itemsize * torch.Size(t[2]).numel()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups


def write_checkpoint(spec: CheckpointSpec, out: str | Path) -> dict[str, Any]:
    """Write the checkpoint into directory `out` (created; existing shards are overwritten).
    Returns the index dict (its `metadata.total_size` is the weight bytes)."""
    if spec.dtype not in ST_NAMES or not spec.dtype.is_floating_point:
        raise ValueError(f"dtype {spec.dtype} cannot be written; use bfloat16, float16 or "
                         "float32")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_spec = ModelSpec.from_config(spec.config)
    meta = build_model(model_spec, spec.dtype, "meta")
    tensors = [(n, spec.dtype, tuple(p.shape)) for n, p in meta.named_parameters()]
    source = DummyWeights({n: s for n, _, s in tensors}, spec.seed)
    groups = _shards(tensors, spec.max_shard_bytes)
    total = sum(spec.dtype.itemsize * torch.Size(s).numel() for _, _, s in tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}",
               disable=not spec.progress, mininterval=2.0)

    def chunks(group) -> Iterator[torch.Tensor]:
        for name, dtype, _ in group:
            for _, piece in source.chunks(name, dtype):
                bar.update(piece.numel() * dtype.itemsize)
                yield piece

    weight_map = {}
    try:
        for i, group in enumerate(groups):
            shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            write_safetensors(out / shard, group, chunks(group))
            weight_map.update({name: shard for name, _, _ in group})
    finally:
        bar.close()
    config = dict(spec.config)
    config.setdefault("architectures", [family_named(model_spec.family).architecture])
    config["torch_dtype"] = str(spec.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index
