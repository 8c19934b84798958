"""StepPlan, ModelRunnerOutput and RowDecision: what a request's strategy asks of its next
forward, what the forward returns, and what the strategy decided after it (with the committed
tokens' log-probabilities, TokenLogprobs, when the request asked for them). A plan may carry more
than the window: extra query rows (ExtraRows) and input-embedding edits (EmbedEdit).

A neutral module: the strategies build these, the engine's strategy stage makes the plans, the
scheduler packs them into work items, the runner executes them and tensor parallelism reduces
their outputs, so it sits below all five and imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
class StepPlan:
    """One request's strategy inputs to its next forward, made before packing."""

    view_start: int                   # first canvas position whose logits `decide` needs
    seeds: list[int]                  # positions verified in this forward (masked in its input)
    extra: ExtraRows | None           # extra query rows (WINO's shadow block)
    embed_edit: EmbedEdit | None      # input-embedding edits (ASRD)
    cfg_scale: float                  # > 0: an unconditional canvas copy runs too
    want_stats: bool                  # the strategy reads KV drift / attention in-mass
    masked_rows_only: bool            # `decide` reads only [MASK] rows and seeds: may be sparse


@dataclass
class TokenLogprobs:
    """Log-probabilities of the tokens one decision writes (commit or replace), from the
    forward that decided them: log_softmax of each position's logits row, [MASK] excluded."""

    positions: torch.Tensor      # [N] long: view indices written (commit | replace)
    token_ids: torch.Tensor      # [N, 1 + k] long: column 0 the written token, then the top k
    logprobs: torch.Tensor       # [N, 1 + k] float32: their log-probabilities
    ranks: torch.Tensor          # [N] long: the written token's 1-based rank in the vocabulary


@dataclass
class RowDecision:
    """One request's decision after a forward, view-relative ([view_len] tensors)."""

    commit: torch.Tensor              # [view_len] bool: [MASK] -> tokens
    tokens: torch.Tensor              # [view_len] long
    remask: torch.Tensor | None       # [view_len] bool: committed -> [MASK]
    replace: torch.Tensor | None      # [view_len] bool: committed -> another token, in place
    keeps: int                        # verified tokens left unchanged
    verified: int                     # positions checked this step
    stop: bool = False                # end the request right after this step
    logprobs: TokenLogprobs | None = None   # set after `decide` for requests with
                                            # SamplingParams.logprobs (engine/logprobs.py)


@dataclass
class ModelRunnerOutput:
    """What one forward returns to the engine: the views' logits, per work item, and the
    statistics a strategy or the refresh policy asked for (the runner builds it; tensor
    parallelism reduces its statistics across ranks). Logits and the strategies' statistics
    live on the model's device; the refresh policy's masses on the host."""

    logits: list[torch.Tensor]    # per work item: [view_len, V] float32, row i predicts view pos i
    drift: list[torch.Tensor | None] | None = None     # per item [view_len] (want_stats items)
    attn_in: list[torch.Tensor | None] | None = None   # per item [view_len]
    prepare_s: float = 0.0        # seconds spent laying out the batch before the model ran
    extra_logits: list[torch.Tensor | None] | None = None   # per item [E, V] (items with extras)
    cached_mass: list[float | None] | None = None   # per item: share of the still-masked view
                                    # rows' attention on keys outside the view (None: no such row)
    column_mass: list[torch.Tensor | None] | None = None   # per item [L]: that attention per key
    host_copies: int = 0          # device-to-host copies the forward made (the attention
                                  # mass, the scoring totals)
    host_bytes: int = 0           # and the bytes they moved
    scores: list | None = None    # per SchedulerOutput.score_items entry: its ScoreResult
                                  # (likelihood scoring, cover_vllm/scoring/)
