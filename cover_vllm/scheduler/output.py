"""SchedulerOutput: the only thing that crosses from the scheduler to the workers each step.

ExtraRows and EmbedEdit (what a strategy may add to a forward) live in cover_vllm/step_plan.py,
below both the scheduler and the strategies; they are re-exported here for the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cover_vllm.scoring.items import ScoreItem
from cover_vllm.step_plan import EmbedEdit, ExtraRows


@dataclass
class CanvasInput:
    """One canvas copy to run: its window tokens and where its canvas lives in the cache."""

    input_ids: torch.Tensor      # [window_len] tokens at the window's positions (seeds masked)
    key_slots: torch.Tensor      # [L] cache slot of every canvas position the window sees
                                 # (block-causal: up to the current block's end)

    def __getstate__(self) -> dict:
        """Pickled for other ranks: compact copies of tensors that are views of a batch-wide
        tensor (the step's gathered ids, admission's slot tables), not that tensor whole."""
        return {name: _compact(value) for name, value in self.__dict__.items()}


def _compact(value):
    if isinstance(value, torch.Tensor) and \
            value.untyped_storage().nbytes() > value.numel() * value.element_size():
        return value.clone()
    return value


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
    want_mass: bool = False                   # return the still-masked rows' attention on
                                              # cached positions (cache_refresh.py's gate)
    extra: ExtraRows | None = None            # extra query rows (cond canvas only), e.g. WINO
    embed_edit: EmbedEdit | None = None       # input-embedding edits (cond canvas only), e.g. ASRD
    window_positions: torch.Tensor | None = None   # [window_len] sorted canvas positions of a
                                                   # sparse window (None: contiguous from
                                                   # window_start); view rows outside it get
                                                   # zero logits (cache_refresh.py)
    causal_block: int | None = None           # block-causal attention with this block size:
                                              # a row at p sees keys < (p // B + 1) * B
    masked_rows_only: bool = False            # the decoder reads only the view's [MASK] rows
                                              # and seeds (worker/logit_rows.py)
    causal_commit: bool = False               # ... except rows before the window's last block,
                                              # which see keys <= p (a causal commit)

    def attention_pairs(self) -> int:
        """Query-key pairs one canvas copy's window attends over (its visible keys per row)."""
        length = int(self.canvases[0].key_slots.numel())
        if self.causal_block is None:
            return self.window_len * length
        b = self.causal_block
        return int(((self.positions() // b + 1) * b).clamp(max=length).sum())

    def positions(self) -> torch.Tensor:
        """[window_len] canvas position of every window row."""
        if self.window_positions is not None:
            return self.window_positions
        return torch.arange(self.window_start, self.window_start + self.window_len)

    @property
    def window_len(self) -> int:
        return int(self.canvases[0].input_ids.numel())

    @property
    def num_extra(self) -> int:
        return 0 if self.extra is None else self.extra.num_rows


@dataclass
class CanvasItem:
    """One uniform-state request's share of a step (DiffusionGemma): tokens to encode into its
    cache, then a canvas to denoise against everything encoded (worker/canvas_runner.py)."""

    request_id: str
    encode_ids: torch.Tensor | None      # [n] tokens whose K/V this step writes (the prompt, or
                                         # the finished canvas), at positions encode_start..
    encode_start: int
    canvas_ids: torch.Tensor | None      # [C] the canvas to denoise (None: encode only)
    canvas_start: int                    # its first position: everything before is encoded
    temperature: float                   # the step's T: the logits are divided by it
    self_conditioning: bool              # feed the previous step's processed logits (the
                                         # runner keeps them); False at a canvas's first step
    key_slots: torch.Tensor              # [L] full-attention layers' slot of positions 0..L-1
    ring: int                            # index of its sliding-layer ring
    want_logits: bool = False            # also return the raw logits (logprobs)

    @property
    def num_encode(self) -> int:
        return 0 if self.encode_ids is None else int(self.encode_ids.numel())


@dataclass
class SchedulerOutput:
    items: list[WorkItem]
    num_waiting: int = 0
    # likelihood scoring: forward-only sequences run in the same forward (cover_vllm/scoring/)
    score_items: list[ScoreItem] = field(default_factory=list)
    # uniform-state canvases (a DiffusionGemma engine's requests): encoder and decoder work
    canvas_items: list[CanvasItem] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.window_len * len(item.canvases) + item.num_extra for item in self.items) \
            + sum(item.num_query_tokens for item in self.score_items) \
            + sum(item.num_encode + (0 if item.canvas_ids is None else item.canvas_ids.numel())
                  for item in self.canvas_items)


__all__ = ["CanvasInput", "CanvasItem", "EmbedEdit", "ExtraRows", "SchedulerOutput", "WorkItem"]
