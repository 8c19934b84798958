"""Whether this process can use a `device` string: one-line ValueErrors for a device torch does
not know, one this engine does not run on, and CUDA where this torch build or machine has none
(instead of torch's traceback from deep inside the first CUDA call). Called where an engine or
a benchmark is built in this process (LLM, the CLI's commands, the bench); a config sent to
Ray workers elsewhere is checked there, by them."""

from __future__ import annotations

from typing import Any

import torch

DEVICES = ("cpu", "cuda", "cuda:N", "meta")


def check_device(device: Any, field: str = "device") -> None:
    """ValueError naming `field` when `device` is not one of DEVICES, or is CUDA that this
    process cannot reach."""
    allowed = f"choose one of {', '.join(DEVICES)} (meta: shapes only, for op counts)"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"{field} must be a device name, got {type(device).__name__}; {allowed}")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{field}={str(device)!r} is not a torch device; {allowed}") from None
    if parsed.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{field}={str(device)!r} is not supported by this engine; {allowed}")
    if parsed.type == "cuda":
        check_cuda(parsed.index)


def check_cuda(index: int | None = None) -> None:
    """ValueError when CUDA (device `index`, if given) is not usable in this process."""
    version = torch.__version__
    if torch.version.cuda is None:
        raise ValueError(f"CUDA is not available in this torch build (torch {version})")
    if not torch.cuda.is_available():
        raise ValueError(f"CUDA is not available: torch {version} (CUDA {torch.version.cuda}) "
                         "sees no GPU (check the driver and CUDA_VISIBLE_DEVICES)")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(f"device cuda:{index} does not exist: {count} CUDA device(s) visible")
