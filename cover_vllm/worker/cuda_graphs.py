"""CUDA graphs of the model forward (issue #42): `embed` + `forward_tokens` captured once per batch
shape at bucketed token counts, then replayed with each step's inputs copied into static
buffers; eager beyond the largest bucket, past the cap on graphs, and in steps that read
statistics or edit embeddings. The captured forward is the one every device runs eagerly.

A graph freezes every op, shape and Python-side decision of the forward, so a graph's key is the
whole shape of its step: the padded token count, and every `AttentionMetadata` field (each
tensor's shape, every flag and count; the forward branches on nothing else). To make few keys
cover many steps, the batch is padded (`pad_batch`) with one *pad sequence* after the real
windows (vLLM's padded rows, expressed in the attention contract, attention/base.py):

* it holds P = bucket(T) - T query rows (the flat axis: real windows, pad rows, extra rows), at
  canvas position 0, with input id 0;
* its key columns are W = Kmax rounded up to `key_align`, every one the cache's `pad_slot`
  (worker/kv_cache.py), so Kmax is bucketed too (real rows' extra columns are padding, masked);
* its rows write their K/V to `pad_slot` only and see only its columns; no real row sees them.

The real rows' attention is therefore what the eager forward computes (same keys, same
overrides, same masks), and the pad rows' outputs are dropped (`Padded.unpad`). The step's ids,
positions and metadata are packed into one host tensor per dtype and copied into the graph's
static buffers (`StaticInputs`): two or three host-to-device copies a replay, against one per
metadata tensor in the eager forward. How a graph is captured is the backend's
(worker/graph_backends.py: `CudaGraphs`, or `Rerun` on CPU, which the tests use).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from cover_vllm.attention import AttentionMetadata, SeqLayout, build_metadata
from cover_vllm.logger import init_logger
from cover_vllm.worker.graph_backends import CaptureBackend, CudaGraphs

logger = init_logger(__name__)

CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 513, 8))   # tokens a step is padded to (vLLM's)
KEY_ALIGN = 64          # key columns are padded to a multiple of this
MAX_GRAPHS = 64         # graphs captured at most; a step of any other shape runs eagerly

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_backend_for(config, device: str) -> CaptureBackend | None:
    """The capture backend of a worker, or None (the forward runs eagerly): CUDA graphs on a CUDA
    device unless `enforce_eager`; off with tensor parallelism (its collectives go through gloo
    or Ray, which a graph cannot capture), said once in the log."""
    if config.enforce_eager or torch.device(device).type != "cuda":
        return None
    if config.tensor_parallel_size > 1:
        logger.info("CUDA graphs off: tensor_parallel_size=%d (its collectives cannot be "
                    "captured); the forward runs eagerly", config.tensor_parallel_size)
        return None
    return CudaGraphs(device)


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None beyond the largest."""
    return next((s for s in sizes if s >= n), None)


@dataclass
class Padded:
    """A batch padded to a graph's shape (host tensors)."""

    seqs: list[SeqLayout]       # the real sequences, then the pad sequence
    ids: torch.Tensor           # [bucket] input ids: real windows, pad rows, extra rows
    positions: torch.Tensor     # [bucket] their positions
    num_window: int             # real window tokens (the pad rows follow them)
    num_pad: int                # pad rows

    def unpad(self, hidden: torch.Tensor) -> torch.Tensor:
        """[bucket, ...] -> the real rows [T, ...] (a view when there are no extra rows)."""
        w, p = self.num_window, self.num_pad
        if hidden.shape[0] == w + p:
            return hidden[:w]
        return torch.cat((hidden[:w], hidden[w + p:]))


def pad_batch(seqs: list[SeqLayout], ids: torch.Tensor, positions: torch.Tensor,
              pad_slot: int, shape: tuple[tuple[int, ...], int]) -> Padded | None:
    """`seqs` plus the pad sequence (module docstring), ids and positions with its rows;
    `shape` = (token buckets, key alignment). None when the batch exceeds the largest bucket."""
    sizes, key_align = shape
    size = bucket(int(ids.numel()), sizes)
    if size is None:
        return None
    num_window = sum(s.window_len for s in seqs)
    num_pad = size - int(ids.numel())
    k_max = max(int(s.key_slots.numel()) for s in seqs)
    width = -(-k_max // key_align) * key_align
    dtype = seqs[0].key_slots.dtype
    pad_seq = SeqLayout(0, num_pad, torch.full((width,), pad_slot, dtype=dtype), [],
                        positions=torch.zeros(num_pad, dtype=torch.long))
    fill = ids.new_zeros(num_pad)
    return Padded(seqs + [pad_seq],
                  torch.cat((ids[:num_window], fill, ids[num_window:])),
                  torch.cat((positions[:num_window], positions.new_zeros(num_pad),
                             positions[num_window:])), num_window, num_pad)


def metadata_key(meta: AttentionMetadata) -> tuple:
    """Everything of `meta` the forward's op sequence depends on: each tensor's shape and dtype,
    whether an optional one is there, every other field's value (lazy caches excluded)."""
    key = []
    for f in dataclasses.fields(meta):
        if f.name.startswith("_"):
            continue
        value = getattr(meta, f.name)
        key.append((f.name, (tuple(value.shape), value.dtype)
                    if isinstance(value, torch.Tensor) else value))
    return tuple(key)


def metadata_tensors(meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)
            if not f.name.startswith("_") and isinstance(getattr(meta, f.name), torch.Tensor)}


class StaticInputs:
    """A graph's input buffers on the device: one flat buffer per dtype, each input a view of
    it, so loading a step is one host `cat` and one copy per dtype."""

    def __init__(self, host: dict[str, torch.Tensor], device: torch.device):
        self.order: dict[torch.dtype, list[str]] = {}
        for name, t in host.items():
            self.order.setdefault(t.dtype, []).append(name)
        self.flat, self.views = {}, {}
        for dtype, names in self.order.items():
            sizes = [host[n].numel() for n in names]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            for name, piece in zip(names, flat.split(sizes)):
                self.views[name] = piece.view(host[name].shape)
            self.flat[dtype] = flat
        self.load(host)

    def load(self, host: dict[str, torch.Tensor]) -> None:
        """Copy a step's host inputs (the shapes this was built for) into the buffers."""
        for dtype, names in self.order.items():
            packed = torch.cat([host[n].reshape(-1) for n in names])
            # a pageable source is staged by the driver before the call returns
            self.flat[dtype].copy_(packed, non_blocking=True)


@dataclass
class GraphCounts:
    captures: int = 0        # graphs captured
    replays: int = 0         # steps run by a graph (a capture's first step included)
    eager: int = 0           # steps offered that ran eagerly (too large, or the cap reached)
    padded_rows: int = 0     # pad rows the replays ran (their outputs dropped)


class _Graph:
    def __init__(self, inputs: StaticInputs, replay: Callable[[], torch.Tensor]):
        self.inputs, self.replay = inputs, replay


class GraphRunner:
    """Captures and replays `forward(ids, positions, meta) -> hidden` per step shape (module
    docstring). `prepare` lays a step out and returns the call that runs it, or None: eager."""

    def __init__(self, forward: Forward, capture: CaptureBackend, pad_slot: int,
                 device: torch.device, shape: tuple[tuple[int, ...], int, int] | None = None):
        self.forward, self.backend, self.pad_slot, self.device = forward, capture, pad_slot, device
        sizes, key_align, max_graphs = shape or (CAPTURE_SIZES, KEY_ALIGN, MAX_GRAPHS)
        self.sizes, self.key_align, self.max_graphs = sizes, key_align, max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.counts = GraphCounts()

    def prepare(self, seqs: list[SeqLayout], ids: torch.Tensor, positions: torch.Tensor,
                scratch: tuple[int, int] | None) -> Callable[[], torch.Tensor] | None:
        """The step's forward through a graph: a call returning the real rows' hidden states
        [T, D] (valid until the next step), or None when it must run eagerly. `ids` and
        `positions` are the step's host tensors [T]; `scratch` the cache's scratch region."""
        padded = pad_batch(seqs, ids, positions, self.pad_slot, (self.sizes, self.key_align))
        if padded is None:
            self.counts.eager += 1
            return None
        meta = build_metadata(padded.seqs, "cpu", scratch)
        key = (int(padded.ids.numel()), metadata_key(meta))
        host = {"ids": padded.ids, "positions": padded.positions, **metadata_tensors(meta)}
        graph = self.graphs.get(key)
        if graph is None and len(self.graphs) >= self.max_graphs:
            self.counts.eager += 1
            return None

        def run() -> torch.Tensor:
            nonlocal graph
            if graph is None:
                graph = self.graphs[key] = self._capture(meta, host)
                self.counts.captures += 1
            else:
                graph.inputs.load(host)
            self.counts.replays += 1
            self.counts.padded_rows += padded.num_pad
            return padded.unpad(graph.replay())

        return run

    def _capture(self, meta: AttentionMetadata, host: dict[str, torch.Tensor]) -> _Graph:
        inputs = StaticInputs(host, self.device)
        views = inputs.views
        template = dataclasses.replace(meta, **{n: views[n] for n in metadata_tensors(meta)})

        def fn() -> torch.Tensor:
            # a fresh metadata each run: its lazy masks are built inside the captured forward
            return self.forward(views["ids"], views["positions"], dataclasses.replace(template))

        if len(self.graphs) == 0:
            logger.info("CUDA graphs (%s): capturing the forward per batch shape up to %d tokens, "
                        "at most %d graphs; enforce_eager=True runs it eagerly",
                        self.backend.name, self.sizes[-1], self.max_graphs)
        return _Graph(inputs, self.backend.capture(fn))
