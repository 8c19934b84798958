"""Batch-invariant mode (issue #51): a TorchFunctionMode that makes every reduction of the forward
independent of the other rows and sequences of the step.

A diffusion decoder compares confidences many times per answer, so a one-ulp change in a logit
can change a whole continuation. Two kinds of op mix the batch into a row's reduction:

* **Row GEMMs** (F.linear, `x @ W`, oneDNN's packed bf16 linear, int8 / W8A8 kernels): the
  kernel picks its blocking (and, past a few rows, a different code path) from the row count.
  `RowPolicy` measures each kernel once per (op, dtype, weight shape) on this machine: a needle
  row at several positions in batches of 1..513 rows. A kernel whose result never changes runs
  untouched (bf16 oneDNN on AVX-512 BF16); one that is stable from `r` rows on gets calls of
  fewer rows padded to `r` (fp32 MKL here: 1, 2-3 and 4+ rows are three code paths); any other
  runs in fixed tiles of `TILE_ROWS` rows, the last one padded.
* **Attention** (F.scaled_dot_product_attention): keys are padded to the batch's longest
  sequence (`Kmax`), a sequence's override columns sit after Kmax, and the fused kernel splits
  keys and queries into blocks chosen from Kmax and Qmax. `invariant_sdpa` moves each
  sequence's key columns that any of its rows can see to the left, in their order (a no-op
  without override columns), pads the key axis to a multiple of `KEY_BLOCK` with hidden
  columns, and runs the queries as separate batch entries of `QUERY_TILE` rows. A row's result
  then depends on its own sequence's keys only: its keys always sit at the same columns, and the
  hidden columns after them add exact zeros (measured on this CPU with the key axis at any
  multiple of 64, tests/test_batch_invariant.py; 512, the CPU kernel's own key split, is the
  choice that needs no measurement).

Norms, softmax, RoPE, activations, the MoE router and combine, and the strategies' decisions
are row-wise already; tests/test_batch_invariant.py checks the whole chain (the needle test).
The mode covers the forward the worker runs (`Worker.execute_model`); docs/batch_invariance.md
says what it guarantees and what it costs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

TILE_ROWS = 64          # rows per GEMM call for a kernel whose result depends on the row count
KEY_BLOCK = 64          # key axis padded to a multiple of this (measured: docs/batch_invariance.md)
QUERY_TILE = 32         # query rows per attention batch entry (the CPU flash kernel's query split)
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 257)


# ---- row GEMMs -------------------------------------------------------------------------------
FREE = 0                # policy: the kernel never depends on the row count


class RowPolicy:
    """Per (op, dtype, input width, weight shape): FREE, the fewest rows `r` a call is padded to,
    or -TILE_ROWS (fixed tiles), measured on the first call (`probe`)."""

    def __init__(self, measured: dict[tuple, int] | None = None):
        self.rows = {} if measured is None else measured

    def get(self, func, x: torch.Tensor, rest: tuple, kwargs: dict) -> int:
        key = (func, x.dtype, x.device.type, x.shape[-1],     # and every tensor argument's
               tuple((tuple(t.shape), t.dtype) for t in rest if isinstance(t, torch.Tensor)))
        if key not in self.rows and x.device.type == "cuda":
            self.rows[key] = -TILE_ROWS     # by construction (and capturable in a CUDA graph)
        if key not in self.rows:
            self.rows[key] = probe(func, x, rest, kwargs)
            logger.debug("batch-invariant: %s %s k=%d -> %d", getattr(func, "__name__", func),
                         x.dtype, x.shape[-1], self.rows[key])
        return self.rows[key]


def probe(func, x: torch.Tensor, rest: tuple, kwargs: dict) -> int:
    """Run a needle row alone and first and last in batches of PROBE_ROWS rows; return the
    row policy (FREE, a minimum row count, or -TILE_ROWS)."""
    gen = torch.Generator().manual_seed(0)
    k = x.shape[-1]

    def rand(m: int) -> torch.Tensor:
        t = torch.randn(m, k, generator=gen)
        return t if x.is_floating_point() else (t * 50).round().clamp(0, 127)

    needle = rand(1).to(x.dtype).to(x.device)
    by_rows: dict[int, list[torch.Tensor]] = {}
    for m in PROBE_ROWS:
        outs = []
        for pos in sorted({0, m - 1}):
            batch = rand(m).to(x.dtype).to(x.device)
            batch[pos] = needle[0]
            outs.append(func(batch, *rest, **kwargs)[pos])
        by_rows[m] = outs
    last = by_rows[PROBE_ROWS[-1]][0]
    stable_from = None
    for m in reversed(PROBE_ROWS):
        if all(torch.equal(o, last) for o in by_rows[m]):
            stable_from = m
        else:
            break
    if stable_from == 1:
        return FREE
    if stable_from is not None and stable_from <= TILE_ROWS:
        return stable_from
    return -TILE_ROWS


def rows_call(func, policy: int, x: torch.Tensor, rest: tuple, kwargs: dict) -> torch.Tensor:
    """func(x, *rest) with x [..., k] run so that no row's result depends on the row count."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if policy == FREE or (policy > 0 and m >= policy) or m == 0:
        return func(x, *rest, **kwargs)
    tile = policy if policy > 0 else -policy
    padded = -(-m // tile) * tile
    if padded != m:
        x2 = torch.cat([x2, x2.new_zeros(padded - m, shape[-1])])
    if policy > 0 or padded == tile:
        out = func(x2, *rest, **kwargs)
    else:
        out = torch.cat([func(x2[i:i + tile], *rest, **kwargs) for i in range(0, padded, tile)])
    return out[:m].reshape(*shape[:-1], out.shape[-1])


# ---- attention -------------------------------------------------------------------------------
def invariant_sdpa(sdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """`sdpa` (F.scaled_dot_product_attention) on q [B, H, Q, d], k/v [B, Hkv, K, d] with each
    sequence's used key columns left-packed into a multiple of KEY_BLOCK and the queries run as
    [B * tiles, H, QUERY_TILE, d] (module doc)."""
    if q.dim() != 4 or dropout_p:
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
    b, h, n_q, _ = q.shape
    n_k = k.shape[-2]
    if is_causal:
        attn_mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
    if attn_mask is None:
        attn_mask = torch.ones(1, 1, 1, n_k, dtype=torch.bool, device=q.device)
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    is_bool = attn_mask.dtype == torch.bool
    allowed = attn_mask if is_bool else attn_mask != float("-inf")
    used = allowed.any(dim=2).any(dim=1).expand(b, n_k)                    # [B, K]
    # used columns first, in order; None: they already are (no override columns; host check,
    # so only on the CPU)
    order = None if q.device.type == "cpu" and bool((used[:, 1:] <= used[:, :-1]).all()) \
        else (~used).to(torch.uint8).argsort(dim=1, stable=True)
    flat_order = None if order is None else (
        order + torch.arange(b, device=q.device)[:, None] * n_k).reshape(-1)
    k_pad = -(-n_k // KEY_BLOCK) * KEY_BLOCK
    q_pad = -(-n_q // QUERY_TILE) * QUERY_TILE
    tiles = q_pad // QUERY_TILE

    def keys(t: torch.Tensor) -> torch.Tensor:                # [B, Hkv, K, d] -> [B*t, Hkv, Kp, d]
        t = t.expand(b, *t.shape[1:])
        if order is not None:               # whole key rows, in the cache's [B, K, Hkv, d] order
            rows = t.transpose(1, 2).reshape(b * n_k, -1).index_select(0, flat_order)
            t = rows.view(b, n_k, t.shape[1], t.shape[3]).transpose(1, 2)
        if k_pad != n_k:
            t = F.pad(t, (0, 0, 0, k_pad - n_k))
        if tiles == 1:
            return t
        return t[:, None].expand(b, tiles, *t.shape[1:]).reshape(b * tiles, *t.shape[1:])

    mb, mh, mq = attn_mask.shape[:3]
    mask = attn_mask.expand(b, mh, mq, n_k)
    if order is not None:
        mask = mask.gather(3, order[:, None, None, :].expand(b, mh, mq, n_k))
    mask = F.pad(mask, (0, k_pad - n_k), value=False if is_bool else float("-inf"))
    used_k = F.pad(used if order is None else used.gather(1, order), (0, k_pad - n_k),
                   value=False)                                            # [B, Kp] packed
    # keep padding columns hidden even where the caller's mask row broadcast over them
    mask = mask & used_k[:, None, None] if is_bool else mask.masked_fill(
        ~used_k[:, None, None], float("-inf"))
    if mq == 1:
        mask = mask.expand(b, mh, q_pad, k_pad)
    else:
        mask = F.pad(mask, (0, 0, 0, q_pad - n_q), value=False if is_bool else float("-inf"))
    mask = mask.reshape(b, mh, tiles, QUERY_TILE, k_pad).transpose(1, 2).reshape(
        b * tiles, mh, QUERY_TILE, k_pad)
    qt = F.pad(q, (0, 0, 0, q_pad - n_q)).reshape(b, h, tiles, QUERY_TILE, q.shape[3])
    qt = qt.transpose(1, 2).reshape(b * tiles, h, QUERY_TILE, q.shape[3])
    o = sdpa(qt, keys(k), keys(v), attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    o = o.reshape(b, tiles, h, QUERY_TILE, o.shape[-1]).transpose(1, 2)
    return o.reshape(b, h, q_pad, o.shape[-1])[:, :, :n_q]


# ---- the mode --------------------------------------------------------------------------------
def _row_ops() -> set:
    """The ops whose first argument is the rows [..., k] and whose output rows follow it."""
    ops = {F.linear, torch._weight_int8pack_mm}
    for ns, name in (("mkldnn", "_linear_pointwise"), ("onednn", "qlinear_pointwise"),
                     ("aten", "_weight_int4pack_mm_for_cpu")):
        packet = getattr(getattr(torch.ops, ns), name, None)
        if packet is not None:
            with contextlib.suppress(Exception):
                ops.add(packet)
    return ops


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
            torch.Tensor.mm}


class BatchInvariantMode(TorchFunctionMode):
    """Entered around the worker's forward when `batch_invariant` is on (module doc)."""

    def __init__(self, measured: dict[tuple, int] | None = None):
        super().__init__()
        self.policy = RowPolicy(measured)
        self.row_ops = _row_ops()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and (func in self.row_ops or (func in _MATMULS and _weight_like(args))):
            x, rest = args[0], tuple(args[1:])          # (rows given by keyword: left alone)
            if isinstance(x, torch.Tensor) and x.dim() >= 1:
                with torch._C.DisableTorchFunction():
                    policy = self.policy.get(func, x, rest, kwargs)
                    return rows_call(func, policy, x, rest, kwargs)
        if func is F.scaled_dot_product_attention:
            with torch._C.DisableTorchFunction():
                return invariant_sdpa(F.scaled_dot_product_attention, *args, **kwargs)
        return func(*args, **kwargs)


def _weight_like(args: tuple) -> bool:
    """`x @ W` with a 2-D W: a row GEMM (a batched matmul of activations is not)."""
    return (len(args) == 2 and isinstance(args[1], torch.Tensor) and args[1].dim() == 2
            and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2)


def configure_cuda() -> None:
    """On CUDA, as vLLM's batch-invariant mode sets it: no TF32, no reduced-precision
    reductions in bf16/fp16 GEMMs, a fixed cuBLAS workspace (no split-K heuristics that depend
    on free workspace) and deterministic algorithms where cuBLAS has them."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


@functools.cache
def measured_policies() -> dict[tuple, int]:
    """The row policies measured in this process, shared by its engines (a kernel's behaviour
    is the machine's, not an engine's)."""
    return {}


def invariant_context(enabled: bool, device: str = "cpu"):
    """A BatchInvariantMode when `enabled` (CUDA configured first), else a no-op context; the
    worker enters it around each forward."""
    if not enabled:
        return contextlib.nullcontext()
    logger.info("batch-invariant mode on: a request's logits do not depend on its batch "
                "(docs/batch_invariance.md)")
    if torch.device(device).type == "cuda":
        configure_cuda()
    return BatchInvariantMode(measured_policies())
