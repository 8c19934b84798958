"""Safetensors files read and written a slice at a time, without mapping or holding a whole file.

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length N, an
N-byte JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {}}`
with offsets relative to the end of the header, then the raw little-endian tensor bytes.

Why not `safe_open`: it memory-maps the whole file, and every page a tensor read touches stays
resident *in this process* (VmRSS / VmHWM count mapped file pages) until the file is closed, so
reading a 5 GB shard shows up as 5 GB of peak memory on top of the weights. Here a tensor, or one
rank's slice of it, is read with plain `readinto` straight into its destination when the bytes
are contiguous and the dtype matches, else through a bounded staging buffer (`CHUNK_BYTES`).
Any file in the format loads, whoever wrote it (`safetensors.torch.save_file` included).
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import torch

from cover_vllm.layers.base import Slice

CHUNK_BYTES = 64 << 20          # staging buffer for converted or strided reads
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
             "F16": torch.float16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
             "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int                 # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header; ValueError naming the file if it is malformed."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header ({exc})") from None
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']} (supported: "
                             f"{sorted(ST_DTYPES)})")
        begin, end = entry["data_offsets"]
        dtype, shape = ST_DTYPES[entry["dtype"]], tuple(int(s) for s in entry["shape"])
        if end - begin != dtype.itemsize * numel(shape):
            raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape}")
        infos[name] = TensorInfo(dtype, shape, 8 + n + begin, end - begin)
    return infos


def numel(shape: Iterable[int]) -> int:
    total = 1
    for s in shape:
        total *= s
    return total


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _readinto(f: BinaryIO, offset: int, buf: memoryview) -> None:
    f.seek(offset)
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            raise ValueError(f"{f.name}: file ends before the tensor data does (truncated?)")
        got += n


def read_tensor_into(f: BinaryIO, info: TensorInfo, dst: torch.Tensor,
                     sl: Slice | None = None) -> None:
    """Fill `dst` with the tensor at `info` (or with its slice `sl`, every range of it side by
    side along `sl.dim`), converting to dst.dtype; never more than a range or a staging chunk
    of the source is read at once."""
    assert sys.byteorder == "little", "safetensors data is little-endian"
    # The tensor as [outer, length, inner] around the sliced dim; rows of `outer` are strided.
    dim = sl.dim if sl is not None else 0
    shape = info.shape or (1,)
    outer, length, inner = numel(shape[:dim]), shape[dim], numel(shape[dim + 1:])
    ranges = sl.ranges if sl is not None else ((0, length),)
    item = info.dtype.itemsize
    direct = dst.device.type == "cpu" and dst.dtype == info.dtype and dst.is_contiguous()
    flat = dst.view(outer, sum(n for _, n in ranges), inner)
    if outer > 1 and not (direct and ranges == ((0, length),)):
        _read_strided(f, info, flat, length, ranges)
        return
    at = 0
    for start, size in ranges:                 # outer == 1 or the whole tensor: one byte range
        part = flat[:, at:at + size]           # [outer, size, inner], contiguous in dst
        at += size
        if direct:
            _readinto(f, info.offset + start * inner * item, _as_bytes(part))
        else:
            _read_rows(f, info, part[0], start)


def _read_rows(f: BinaryIO, info: TensorInfo, dst: torch.Tensor, start: int) -> None:
    """dst [size, inner] <- rows [start, start + size) of the tensor viewed as [length, inner],
    through a staging buffer of at most CHUNK_BYTES (dtype conversion)."""
    size, inner = dst.shape
    item = info.dtype.itemsize
    per = max(1, CHUNK_BYTES // max(1, inner * item))
    for a in range(0, size, per):
        n = min(per, size - a)
        stage = torch.empty((n, inner), dtype=info.dtype)
        _readinto(f, info.offset + (start + a) * inner * item, _as_bytes(stage))
        dst[a:a + n].copy_(stage)


def _read_strided(f: BinaryIO, info: TensorInfo, flat: torch.Tensor, length: int,
                  ranges: tuple[tuple[int, int], ...]) -> None:
    """flat [outer, sum(sizes), inner] <- the ranges of the tensor viewed as [outer, length,
    inner], a few whole outer rows (at most CHUNK_BYTES) staged at a time."""
    outer, _, inner = flat.shape
    row_bytes = length * inner * info.dtype.itemsize                 # one outer row, unsliced
    per = max(1, CHUNK_BYTES // row_bytes)
    for a in range(0, outer, per):
        n = min(per, outer - a)
        stage = torch.empty((n, length, inner), dtype=info.dtype)
        _readinto(f, info.offset + a * row_bytes, _as_bytes(stage))
        at = 0
        for start, size in ranges:
            flat[a:a + n, at:at + size].copy_(stage[:, start:start + size])
            at += size


def write_safetensors(path: str | Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      chunks: Iterator[torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Stream a safetensors file: the header from (name, dtype, shape), then the data from
    `chunks` (contiguous pieces of the tensors in that order, already in their dtype), so no
    more than a chunk is ever in memory."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = numel(shape) * dtype.itemsize
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                                # data 8-byte aligned
    written = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for chunk in chunks:
            data = _as_bytes(chunk.contiguous())
            f.write(data)
            written += len(data)
    if written != offset:
        raise RuntimeError(f"{path}: wrote {written} data bytes, header promised {offset}")
