"""HostTransfer: the device-to-host copies of a step, each one copy however many tensors it brings.

A step's results live on the model's device; the host needs only what it applies: decisions,
tokens, a few per-request numbers (engine/decide.py), and the attention mass the refresh policy
reads (worker/model_runner.py). `fetch` packs any number of such small tensors, of any dtypes, as
bytes into one buffer on their device, copies that buffer once and views the pieces back on the
host, so the host waits for the device once, whatever the batch size or the mix of strategies.

On the CPU nothing moves: the tensors are already where the host reads them and come back as
they are. On the "meta" device (a shapes-only dry run, tests/test_device.py) there are no values:
the host gets zeros of the right shapes and dtypes, through one op that reads the packed meta
buffer, so a dispatch-level count still sees one copy.
"""

from __future__ import annotations

import torch

ALIGN = 8          # bytes: every piece starts where any dtype can be viewed


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
        packed = torch.cat(pieces)
        if device.type == "meta":
            host = torch.empty_like(packed, device="cpu").zero_()
        else:
            host = packed.to("cpu")
        self.copies += 1
        self.bytes += offset
        out = iter([host[start:start + size].view(t.dtype).reshape(t.shape)
                    for t, (start, size) in zip(live, spans)])
        return [None if t is None else next(out) for t in tensors]
