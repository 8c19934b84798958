"""The interface of uniform-state canvas decoders (DiffusionGemma): no [MASK], every position of a
canvas re-drawn each step until the canvas stops, then its argmax appended.

A masked decoder (strategies/base.py) commits tokens into [MASK] slots; a uniform-state one
instead hands back a whole new canvas per step. Its per-request state is a `CanvasState` the
decoder owns (set by `start_canvas`, advanced by `absorb`); the scheduler reads only its
`temperature` (the next forward divides the logits by it, because every tensor-parallel rank keeps
those processed logits to self-condition the next step) and `done`.

Where things live: as for every decoder (strategies/base.py). `decide(CanvasBatch)` is tensor code
on the logits' device that never reads a device value back; its `CanvasDecision` crosses to the
host in the step's one copy (engine/canvas_decide.py), then `absorb` updates the host state.
Random draws come from each request's own generator on that device, in the reference's order, so
batching never changes a request's tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies.base import StrategyParams


@dataclass
class CanvasState:
    """One request's decoder state for its current canvas (host)."""

    steps_left: int                     # denoising steps this canvas may still take (cur_step)
    temperature: float = 1.0            # the next step's temperature (a float32 value)
    step: int = 0                       # steps taken in this canvas
    done: bool = False                  # the canvas stopped: its last argmax is the output
    history: list[torch.Tensor] = field(default_factory=list)   # argmax canvases [C] of the
                                        # canvas's latest steps (the stability check's)
    rewind: torch.Tensor | None = None  # the generator's state before this step's draw of
                                        # the next canvas (restored when the canvas goes on)


@dataclass
class CanvasBatch:
    """One decision over n requests' canvases (C positions each), on the logits' device."""

    logits: torch.Tensor                # [n, C, V] float32 processed (temperature-scaled)
    states: list[CanvasState]           # host
    generators: list[torch.Generator | None]   # each request's own, on the logits' device
                                               # (None on the shapes-only "meta" device)
    draw_next: list[bool]               # host: a canvas follows this one, so the next canvas's
                                        # initial draw is made after this step's draws

    @property
    def device(self) -> torch.device:
        return self.logits.device


@dataclass
class CanvasDecision:
    """What one denoising step decided, [n, ...] tensors (device, then their host copies)."""

    canvas: torch.Tensor                # [n, C] long: the next step's input canvas
    argmax: torch.Tensor                # [n, C] long: this step's argmax canvas (the output
                                        # when the canvas stops here)
    accepted: torch.Tensor              # [n, C] bool: positions that kept their sample
    confident: torch.Tensor             # [n] bool: mean entropy below the threshold
    next_canvas: torch.Tensor | None = None   # [n, C] long: the next canvas's initial tokens
                                        # (drawn where `draw_next`; used only if this canvas stops)

    def tensors(self) -> list[torch.Tensor | None]:
        return [getattr(self, f.name) for f in fields(self)]

    def from_tensors(self, tensors: list[torch.Tensor | None]) -> "CanvasDecision":
        return CanvasDecision(*tensors)

    def row(self, i: int) -> "CanvasDecision":
        """Request i's decision ([C] / scalar tensors)."""
        return CanvasDecision(*(None if t is None else t[i] for t in self.tensors()))


class CanvasDecoder(ABC):
    """One uniform-state decoding rule (subclasses set `name`, `params_cls`, implement the
    schedule hooks and `decide`)."""

    name: ClassVar[str]
    params_cls: ClassVar[type[StrategyParams]] = StrategyParams
    eos_ends_request: ClassVar[bool] = True    # a canvas holding an EOS ends the request
    revises_done_blocks: ClassVar[bool] = False   # a finished canvas never changes (streamed)

    def __init__(self, params: StrategyParams, spec: ModelSpec):
        self.params, self.spec = params, spec

    def check_request(self, params) -> None:
        """Raise ValueError naming the SamplingParams fields that mean nothing to this decoder."""

    @abstractmethod
    def start_canvas(self) -> CanvasState:
        """The state of a canvas about to start (its first step's temperature set)."""

    @abstractmethod
    def initial_canvas(self, generator: torch.Generator | None, length: int,
                       device: torch.device) -> torch.Tensor:
        """[length] long: a canvas's starting tokens, drawn from `generator` on `device`."""

    @abstractmethod
    def decide(self, batch: CanvasBatch) -> CanvasDecision:
        """One vectorised denoising decision on the logits' device (module doc)."""

    @abstractmethod
    def absorb(self, batch: CanvasBatch, decision: CanvasDecision) -> None:
        """After the step's copy: advance every request's state from its host `decision`
        (history, the stop, the next temperature; `done` when the canvas stops)."""
