"""SchedulerOutput: the only thing that crosses from the scheduler to the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CanvasInput:
    """One canvas copy to run: its window tokens and where its canvas lives in the cache."""

    input_ids: torch.Tensor      # [window_len] tokens at positions window_start.. (seeds masked)
    key_slots: torch.Tensor      # [L] cache slot of every canvas position


@dataclass
class WorkItem:
    """One request's share of a step: a forward over its window, logits for its view."""

    request_id: str
    window_start: int                         # first query position of the forward
    canvases: list[CanvasInput]               # [cond] or [cond, uncond] (classifier-free guidance)
    view_start: int                           # logits wanted for positions view_start..view_end-1
    view_end: int
    override: list[tuple[int, int]] = field(default_factory=list)   # (position s, row π(s))
    cfg_scale: float = 0.0
    is_refresh: bool = False                  # the window covers the whole canvas
    want_stats: bool = False                  # return KV drift / attention in-mass for the view

    @property
    def window_len(self) -> int:
        return int(self.canvases[0].input_ids.numel())


@dataclass
class SchedulerOutput:
    items: list[WorkItem]
    num_waiting: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(item.window_len * len(item.canvases) for item in self.items)
