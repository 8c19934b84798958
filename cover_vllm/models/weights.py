"""Where parameter values come from: a checkpoint directory or the deterministic dummy generator.

Both fill an already-allocated parameter in place, in its final dtype and device, with the whole
tensor or one tensor-parallel rank's `Slice` of it (one range, or several side by side for a
fused tensor's pieces); neither ever builds the full tensor of a slice or an fp32 copy of the
model.

Dummy weights are generated a chunk of rows at a time, each chunk from its own generator seeded
by (seed, tensor name, chunk index): a rank's shard is exactly the same slice of the TP=1 tensor,
and `cover-vllm make-checkpoint` writes the very values `load_format="dummy"` would build.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Iterator, Protocol

import torch

from cover_vllm.layers.base import Slice
from cover_vllm.models.safetensors_io import TensorInfo, numel, read_header, read_tensor_into

DUMMY_CHUNK_ELEMS = 1 << 22     # 4 M values (16 MB in fp32) per generated chunk


class WeightSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...] | None:
        """The full (unsharded) shape of tensor `name`, or None if the source lacks it."""

    def fill(self, name: str, dst: torch.Tensor, sl: Slice | None) -> None:
        """Write tensor `name` (or its slice `sl`) into `dst`, converting to dst.dtype."""

    def names(self) -> set[str] | None:
        """Every tensor the source holds (None: it makes any tensor asked for)."""


def weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file, from model.safetensors.index.json or a single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / shard for name, shard in weight_map.items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        return {name: single for name in read_header(single)}
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r} "
        "(use load_format='dummy' for random weights)")


class CheckpointWeights:
    """Tensors of a safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._file_of = weight_files(model_dir)
        self._infos: dict[str, TensorInfo] = {}
        self._where: dict[str, Path] = {}
        for path in sorted(set(self._file_of.values())):
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint shard {path.name} listed in the index of "
                                        f"{str(model_dir)!r} does not exist")
            for name, info in read_header(path).items():
                self._infos[name], self._where[name] = info, path
        self._files: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self._infos)

    def file_of(self, name: str) -> str:
        return self._where[name].name

    def shape(self, name: str) -> tuple[int, ...] | None:
        info = self._infos.get(name)
        return None if info is None else info.shape

    def fill(self, name: str, dst: torch.Tensor, sl: Slice | None) -> None:
        path = self._where[name]
        if path not in self._files:
            self._files[path] = open(path, "rb", buffering=0)
        read_tensor_into(self._files[path], self._infos[name], dst, sl)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 7_919 + chunk) % (1 << 63)


ONES_SUFFIXES = ("weight", "scale", "scalar")    # 1-D multipliers: norm weights, router and
                                                # expert scales, layer scalars (DiffusionGemma)


class DummyWeights:
    """Random weights for any shape: N(0, std) matrices, ones for 1-D multipliers (names ending
    in `weight`, `scale` or `scalar`: norm weights, router scales, layer scalars), zeros for
    other 1-D tensors (biases, the MoE expert bias)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0, std: float = 0.02):
        self._shapes, self.seed, self.std = shapes, seed, std

    def names(self) -> None:
        return None

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)

    def chunks(self, name: str, dtype: torch.dtype,
               rows: tuple[int, int] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) pieces of the full tensor along dim 0, in `dtype`; with `rows`
        = (lo, hi) only the pieces that overlap those rows are generated."""
        shape = self._shapes[name]
        if len(shape) <= 1:                  # 1-D weights are norm scales (LLaDA's `ln_f` too)
            value = 1.0 if name.endswith(ONES_SUFFIXES) else 0.0
            yield 0, torch.full(shape, value, dtype=dtype)
            return
        per_row = max(1, DUMMY_CHUNK_ELEMS // max(1, numel(shape[1:])))
        for c, start in enumerate(range(0, shape[0], per_row)):
            n = min(per_row, shape[0] - start)
            if rows is not None and (start + n <= rows[0] or start >= rows[1]):
                continue
            gen = torch.Generator().manual_seed(_chunk_seed(self.seed, name, c))
            piece = torch.empty((n, *shape[1:]), dtype=torch.float32)
            yield start, piece.normal_(0.0, self.std, generator=gen).to(dtype)

    def fill(self, name: str, dst: torch.Tensor, sl: Slice | None) -> None:
        if sl is None or sl.dim != 0:
            for start, piece in self.chunks(name, dst.dtype):
                if sl is not None:
                    piece = sl.take(piece)            # every range of the sliced dim
                dst[start:start + piece.shape[0]].copy_(piece)
            return
        at = 0
        for first, size in sl.ranges:                 # dim 0: each range's overlapping rows
            for start, piece in self.chunks(name, dst.dtype, (first, first + size)):
                lo, hi = max(start, first), min(start + piece.shape[0], first + size)
                if lo < hi:
                    dst[at + lo - first:at + hi - first].copy_(piece[lo - start:hi - start])
            at += size
