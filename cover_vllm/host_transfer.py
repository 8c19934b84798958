"""HostTransfer: the copies of a step between host and device, each one copy however many tensors
it moves (`fetch`: device to host; `to_device`: host to device).

A step's results live on the model's device; the host needs only what it applies: decisions,
tokens, a few per-request numbers (engine/decide.py), and the attention mass the refresh policy
reads (worker/model_runner.py). `fetch` packs any number of such small tensors into one buffer on
their device, copies that buffer once and views the pieces back on the host, so the host waits for
the device once, whatever the batch size or the mix of strategies.

The buffer is float64, filled by one `torch.cat` that converts as it copies: every value a step
reads back (bools, token ids, positions and counts below 2^53, fp32/bf16/fp16 scores, float64
confidences) is a float64 exactly, so the host's `to(dtype)` gives the same bits back. That is
a few ops on the device for the whole batch where packing bytes took four per tensor (issue #42):
the per-row tensors [n, W_i] of a batch of n rows are laid side by side by one `cat` along their
second dimension into a [n, sum W_i] view of the buffer, the rest (1-D, or flattened) by one more.
A device without float64 (MPS) packs bytes instead.

`to_device` is the other direction: the int64 and bool host tensors a step builds (attention
metadata, token ids, positions, the decoders' canvas rows) ride in one int64 buffer, the bools'
bytes after the integers, pinned and asynchronous on CUDA; on the device every piece is a view
of the copy (a split, a reshape, a bool view of the bytes), so the move is one copy and no kernel.

On the CPU nothing moves: the tensors are already where the host reads them and come back as
they are. On the "meta" device (a shapes-only dry run, tests/test_device.py) there are no values:
the host gets zeros of the right shapes and dtypes, through one op that reads the packed meta
buffer, so a dispatch-level count still sees one copy.
"""

from __future__ import annotations

import torch

ALIGN = 8          # bytes: every piece of a byte-packed buffer starts where any dtype can be viewed
NO_FLOAT64 = ("mps",)       # device types without float64: their buffers are packed as bytes


class HostTransfer:
    """Counts what it moves (`copies`, `bytes`) so the benchmarks can report it per step."""

    def __init__(self) -> None:
        self.copies = 0
        self.bytes = 0

    def fetch(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Host copies of `tensors` (None stays None), all on one device, in one copy."""
        live = [t for t in tensors if t is not None]
        if not live or live[0].device.type == "cpu":
            return list(tensors)
        pack = _pack_bytes if live[0].device.type in NO_FLOAT64 else _pack_float64
        packed, unpack = pack(live)
        if packed.device.type == "meta":
            host = torch.empty_like(packed, device="cpu").zero_()
        else:
            host = packed.to("cpu")
        self.copies += 1
        self.bytes += packed.numel() * packed.element_size()
        out = iter(unpack(host))
        return [None if t is None else next(out) for t in tensors]


def _pack_float64(live: list[torch.Tensor]):
    """One float64 buffer holding every tensor's values, and how to take them back apart: a
    region [n, sum W] per first dimension n shared by 2-D tensors (one `cat` along dim 1 each),
    then one flat region for the others (one `cat` of them flattened)."""
    groups: dict = {}
    for i, t in enumerate(live):
        groups.setdefault(t.shape[0] if t.dim() == 2 else None, []).append(i)
    sizes = {key: sum(live[i].numel() for i in members) for key, members in groups.items()}
    packed = torch.empty(sum(sizes.values()), dtype=torch.float64, device=live[0].device)
    regions, offset = {}, 0
    for key, members in groups.items():
        if key is None:
            region = (packed if sizes[key] == packed.numel() else
                      packed[offset:offset + sizes[key]])
            torch.cat([live[i].reshape(-1) if live[i].dim() != 1 else live[i]
                       for i in members], out=region)
        else:                           # [n, sum W]: one strided view (a slice and a view)
            width = sizes[key] // key if key else 0
            region = packed.as_strided((key, width), (width, 1), offset)
            torch.cat([live[i] for i in members], dim=1, out=region)
        regions[key] = (offset, sizes[key])
        offset += sizes[key]

    def unpack(host: torch.Tensor) -> list[torch.Tensor]:
        out = [None] * len(live)
        for key, members in groups.items():
            start, size = regions[key]
            region = host[start:start + size]
            if key is None:
                pieces = region.split([live[i].numel() for i in members])
            else:
                pieces = region.view(key, -1).split([live[i].shape[1] for i in members], 1)
            for i, piece in zip(members, pieces):
                out[i] = piece.to(live[i].dtype).reshape(live[i].shape)
        return out

    return packed, unpack


def _pack_bytes(live: list[torch.Tensor]):
    """One uint8 buffer holding every tensor's bytes (each piece aligned), and the unpacking."""
    device = live[0].device
    pieces, spans, offset = [], [], 0
    for t in live:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % ALIGN
        pieces.append(raw)
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        spans.append((offset, raw.numel()))
        offset += raw.numel() + pad

    def unpack(host: torch.Tensor) -> list[torch.Tensor]:
        return [host[start:start + size].view(t.dtype).reshape(t.shape)
                for t, (start, size) in zip(live, spans)]

    return torch.cat(pieces), unpack


def to_device(tensors: list[torch.Tensor | None],
              device: torch.device) -> list[torch.Tensor | None]:
    """int64 / bool host `tensors` (None stays None) -> the same on `device`, through one
    int64 buffer: one host->device copy, views on the device (module doc)."""
    if device.type == "cpu" or all(t is None for t in tensors):
        return list(tensors)
    return one_buffer(tensors, device)


def one_buffer(tensors: list[torch.Tensor | None],
               device: torch.device) -> list[torch.Tensor | None]:
    """`to_device`'s packing, on any device (the CPU included: tests/test_host_transfer.py).

    The host lays the 1-D int64 tensors first, then the others, then the bools' bytes. On the
    device one split gives every 1-D int64 piece, and every other tensor is one `as_strided`
    of the buffer (of its bytes for a bool), except that three or more of one shape and kind
    are one [k, *shape] view and its `unbind`: two ops for a decision's [n, W] masks (#50)."""
    live = [t for t in tensors if t is not None]
    flat_longs = [t for t in live if t.dtype == torch.long and t.dim() == 1]
    longs = flat_longs + [t for t in live if t.dtype == torch.long and t.dim() != 1]
    bools = [t for t in live if t.dtype == torch.bool]
    assert len(longs) + len(bools) == len(live), "to_device moves int64 and bool tensors"
    parts = [t.reshape(-1) for t in longs]
    num_bools = sum(t.numel() for t in bools)
    if bools:                                  # their bytes, padded to whole int64 words
        pad = torch.zeros(-num_bools % ALIGN, dtype=torch.bool)
        parts.append(torch.cat([t.reshape(-1) for t in bools] + [pad]).view(torch.long))
    flat = torch.cat(parts)
    if device.type == "cuda":
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=device.type == "cuda")
    by_id = {}
    sizes = [t.numel() for t in flat_longs]
    if flat_longs:
        rest = moved.numel() - sum(sizes)
        pieces = moved.split(sizes + [rest]) if rest or len(sizes) > 1 else (moved,)
        by_id.update({id(t): p for t, p in zip(flat_longs, pieces)})
    by_id.update(_strided(moved, longs[len(flat_longs):], sum(sizes)))
    if bools:
        by_id.update(_strided(moved.view(torch.bool), bools, 8 * sum(t.numel() for t in longs)))
    return [None if t is None else by_id[id(t)] for t in tensors]


def _strided(buffer: torch.Tensor, tensors: list[torch.Tensor], offset: int) -> dict:
    """{id(t): t's values as a view of the 1-D `buffer`}, the tensors laid end to end from
    `offset` elements: one `as_strided` each, or for three or more tensors of one shape in a
    row one [k, *shape] view and its `unbind`."""
    out, i = {}, 0
    while i < len(tensors):
        shape = tensors[i].shape
        run = 1
        while i + run < len(tensors) and tensors[i + run].shape == shape:
            run += 1
        if run < 3:
            run = 1
        whole = (run, *shape) if run > 1 else tuple(shape)
        view = buffer.as_strided(whole, _contiguous_strides(whole), offset)
        for t, piece in zip(tensors[i:i + run], view.unbind(0) if run > 1 else (view,)):
            out[id(t)] = piece
        offset += run * tensors[i].numel()
        i += run
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
