"""Keep a forward's activations off fresh mmaps (glibc malloc tuning for CPU workers).

glibc serves every allocation above its mmap threshold (128 KiB at start, raised on the fly to
at most 32 MiB) with a new mmap and returns it to the OS on free, so a tensor of a few MB made
and dropped by every layer of every step is page-faulted in anew each time. On this project's
2-core test machine that made a [512, 16, 64] RoPE step 14x slower than the same arithmetic on
reused memory. Raising the threshold above the largest activation (and the trim threshold with
it) keeps those blocks on the heap, where they are reused. The heap itself must not shrink and
regrow around every step either: a top pad of the same size keeps that much slack when it grows
or is trimmed (measured on llada-50m, bf16, batch 1: 72 tokens/s with the thresholds alone,
107 with the pad too). Weights and the KV cache are allocated before it is set (each in its own
mapping, so a freed engine gives them back to the OS at once: a 512 MiB pool of llada-50m's
ten 51 MiB layers otherwise stayed in the heap after the engine was gone), so they are
unaffected; the cost is at most the pad in idle heap.

It is set once per worker process after the weights are loaded and the KV cache allocated;
elsewhere than glibc it is a no-op. While the weights load, the opposite holds (`map_large_allocations`): every allocation
of 1 MiB or more is its own mapping, so what the loader frees goes back to the OS at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

from cover_vllm.logger import init_logger

logger = init_logger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 64 << 20      # above a 7-8B model's per-layer activations at batch 16
LOAD_MMAP_THRESHOLD_BYTES = 1 << 20  # while loading: `map_large_allocations`
_done = False


def map_large_allocations(threshold: int = LOAD_MMAP_THRESHOLD_BYTES) -> bool:
    """While weights load: every allocation of `threshold` bytes or more gets its own mmap, given
    back to the OS when freed, so the weights and the loader's temporaries never share heap
    pages. With glibc's dynamic threshold (raised up to 32 MiB by each freed mapping), loading
    LLaDA-8B in int4 (4.67 GiB of weights; models/quantization.py quantizes 16 MiB chunks)
    peaked anywhere between 5.3 and 9.9 GiB from run to run; with this, 5.3 GiB every time.
    `keep_activations_on_heap` raises the threshold again once the weights are in place."""
    global _done
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    _done = False                          # the activations' setting must be applied again
    return ok


def keep_activations_on_heap(mmap_threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Raise malloc's mmap threshold and top pad to `mmap_threshold` and its trim threshold to
    twice that. Returns whether glibc accepted it (False off Linux/glibc: nothing changed)."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(option, value) for option, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, 2 * mmap_threshold),
            (_M_TOP_PAD, mmap_threshold)))
    except (OSError, AttributeError):
        return False
    if not ok:
        logger.warning("malloc refused an mmap threshold of %d bytes; activations may be "
                       "page-faulted in every step", mmap_threshold)
    _done = ok
    return ok
