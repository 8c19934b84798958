"""SchedulerOutput: the only thing that crosses from the scheduler to the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CanvasInput:
    """One canvas copy to run: its window tokens and where its canvas lives in the cache."""

    input_ids: torch.Tensor      # [window_len] tokens at the window's positions (seeds masked)
    key_slots: torch.Tensor      # [L] cache slot of every canvas position


@dataclass
class ExtraRows:
    """Query rows run alongside a window that are never part of the canvas (WINO's shadow block).

    They are queries only: their K/V are never written to the cache and no window row sees them.
    Row e sees canvas column j where `allowed[e, j]` and extra row f where `allowed[e, L + f]`.
    Their logits come back raw (row e's own output; no predictor-row shift is applied).
    """

    input_ids: torch.Tensor      # [E] tokens of the extra rows
    positions: torch.Tensor      # [E] their RoPE positions (may repeat canvas positions)
    allowed: torch.Tensor        # [E, L + E] bool: canvas key columns, then extra-row columns

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class EmbedEdit:
    """Per-position input-embedding edits, applied by the runner right after `model.embed`:

        e_p <- e_p + sum_k mix_weights[n, k] * embed(mix_ids[n, k])  +  perturb[n] * |e_p| * u_n

    (p = positions[n]; u_n a unit vector orthogonal to e_p, drawn from torch.Generator(seed), so a
    request's edit never depends on its batch). Positions must lie in the window; the edited
    positions' fresh K/V are written to the cache like any other window position.
    """

    positions: torch.Tensor      # [N] canvas positions (inside the window)
    mix_ids: torch.Tensor        # [N, K] token ids whose embeddings are added
    mix_weights: torch.Tensor    # [N, K] float weights (0 = unused slot)
    perturb: torch.Tensor        # [N] float: orthogonal perturbation size relative to |e_p|
    seed: int = 0


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
    extra: ExtraRows | None = None            # extra query rows (cond canvas only), e.g. WINO
    embed_edit: EmbedEdit | None = None       # input-embedding edits (cond canvas only), e.g. ASRD
    window_positions: torch.Tensor | None = None   # [window_len] sorted canvas positions of a
                                                   # sparse window (None: contiguous from
                                                   # window_start); view rows outside it get
                                                   # zero logits (cache_refresh.py)

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
class SchedulerOutput:
    items: list[WorkItem]
    num_waiting: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(item.window_len * len(item.canvases) + item.num_extra for item in self.items)
