"""The strategy interface: a vectorised decision from logits rows and canvas state.

A strategy never sees the model, the cache or the scheduler, and never writes a request: the
engine's strategy stage (engine/strategy_stage.py) asks it what the next forward needs and for
its decision, and the request applies that decision. Each step it gets a `StepBatch` for all its
requests at once: the logits of the positions in each request's *view* (by default the current
block), already taken from each position's predictor row (so Dream's shift is invisible here),
plus the canvas tokens there.

Where things live. The logits stay on the model's device, and `decide` is tensor code on that
device: it never reads a device value back (no `.item()`, `.tolist()`, `.numpy()`, boolean
indexing or `bool()` of a device tensor), so a GPU never waits for the host inside it. What the
host knows anyway travels the other way: the canvas (`StepBatch.host`), the sampling knobs and
each request's `BlockState` are host objects a decision may read, and per-request counts made
from them are uploaded (`on_device`). `decide` returns a `Decision` of device tensors; the engine
brings the decisions of every strategy of the step to the host in one copy, then calls each
strategy's `absorb` with its decision there, where it advances the per-request state its host
hooks (`select_seeds`, `block_done`, `embed_edits`) read; `Decision.state` carries the extra
O(rows) values `absorb` needs. `decide_now` runs the three parts for one strategy (tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.step_plan import EmbedEdit, ExtraRows
from cover_vllm.strategies.sampling import MaskColumn


@dataclass(frozen=True)
class StrategyParams:
    """Base for every strategy's typed knobs (also the server's `decoding_params` JSON)."""


@dataclass
class BlockState:
    """Per-request bookkeeping the engine keeps for every strategy."""

    block_steps: int            # steps budgeted for the current block (fixed-schedule strategies)
    step: int = 0               # steps taken in the current block
    extra: Any = field(default_factory=dict)   # strategy-owned state of the current block, set
                                               # by `start_block`: the strategy's dataclass
                                               # (CoverState, ScheduleState, ...; ASRD: a dict)
    memory: dict[str, Any] = field(default_factory=dict)  # strategy-owned, kept across blocks
    block_size: int = 0         # the request's block length B (a block-causal model's first
                                # block may hold fewer generation slots: the prompt's tail)
    max_tokens: int = 0         # the request's generation length (gen_length)
    steps: int | None = None    # SamplingParams.steps as the user gave it (None: unset)


@dataclass
class CanvasRows:
    """The canvas side of a StepBatch, [n, W] tensors on one device (padded: see `valid`)."""

    tokens: torch.Tensor        # [n, W] current canvas tokens
    valid: torch.Tensor         # [n, W] bool, False on padding
    in_block: torch.Tensor      # [n, W] bool, view position inside the current block
    is_gen: torch.Tensor        # [n, W] bool, view position is a generation slot (not prompt)
    seeds: torch.Tensor | None  # [n, W] bool: verified this step (masked in the input)
    mask_id: int

    @property
    def masked(self) -> torch.Tensor:
        """[n, W] bool: view positions holding [MASK]."""
        return (self.tokens == self.mask_id) & self.valid

    @property
    def candidates(self) -> torch.Tensor:
        """[n, W] bool: masked positions of the current block (what may be committed)."""
        return self.masked & self.in_block

    @property
    def lengths(self) -> list[int]:
        """Each request's view width (host tensors only)."""
        return self.valid.sum(-1).tolist()


@dataclass
class StepBatch:
    """Inputs of one decision for n requests; W = widest view, padded (see `valid`).

    The [n, W] / [n, W, V] tensors live on the logits' device; `host` holds the same canvas rows
    on the host, and the sampling knobs, states and generators are host objects (module doc)."""

    logits: torch.Tensor        # [n, W, V] float32, row i predicts view position i
    tokens: torch.Tensor        # [n, W] current canvas tokens
    valid: torch.Tensor         # [n, W] bool, False on padding
    in_block: torch.Tensor      # [n, W] bool, view position inside the current block
    is_gen: torch.Tensor        # [n, W] bool, view position is a generation slot (not prompt)
    states: list[BlockState]
    temperature: torch.Tensor   # [n] float (host)
    top_p: torch.Tensor         # [n] float (host)
    top_k: torch.Tensor         # [n] long, -1 = off (host)
    generators: list[torch.Generator | None]   # each request's own, on the logits' device
                                               # (None on the shapes-only "meta" device)
    mask_id: int
    seeds: torch.Tensor | None = None      # [n, W] bool: verified this step (masked in the input)
    drift: torch.Tensor | None = None      # [n, W] relative K change at write-back (stats layer)
    attn_in: torch.Tensor | None = None    # [n, W] attention mass from masked rows (stats layer)
    extra_logits: torch.Tensor | None = None   # [n, E, V] float32 logits of the extra rows the
                                               # strategy asked for (`extra_rows`), raw row order
    extra_valid: torch.Tensor | None = None    # [n, E] bool, False on padding / no extra rows
    host_rows: CanvasRows | None = None    # the canvas rows on the host (None: the fields above
                                           # are host tensors already, e.g. a CPU engine)
    mask_logits: torch.Tensor | None = None    # [n, W] float32: the [MASK] column of the model's
                                               # logits, -inf in `logits` (`mask_column`)
    moved_candidates: torch.Tensor | None = None   # [n, W] bool: `candidates`, computed on the
                                                   # host and moved in the step's one copy (#42)

    @property
    def device(self) -> torch.device:
        return self.logits.device

    @property
    def rows(self) -> CanvasRows:
        """The canvas rows on the logits' device."""
        return CanvasRows(self.tokens, self.valid, self.in_block, self.is_gen, self.seeds,
                          self.mask_id)

    @property
    def host(self) -> CanvasRows:
        """tokens / valid / in_block / is_gen / seeds as host tensors, for per-request counts."""
        if self.host_rows is not None:
            return self.host_rows
        assert self.tokens.device.type == "cpu", "a device batch carries its host rows"
        return self.rows

    @property
    def mask_column(self) -> MaskColumn | None:
        """The [MASK] logits for the official softmax (`token_prob(mask=)`); None when the
        batch was built without them (tests)."""
        return None if self.mask_logits is None else MaskColumn(self.mask_id, self.mask_logits)

    @property
    def masked(self) -> torch.Tensor:
        return self.rows.masked

    @property
    def candidates(self) -> torch.Tensor:
        """[n, W] bool, `CanvasRows.candidates`: the engine's batches bring them from the host
        (three device ops fewer a step); a batch built without them computes them here."""
        if self.moved_candidates is not None:
            return self.moved_candidates
        return self.rows.candidates


@dataclass
class Decision:
    """What to do with each view position. Tokens are read where commit or replace is set."""

    commit: torch.Tensor                  # [n, W] bool: [MASK] -> tokens
    tokens: torch.Tensor                  # [n, W] long
    remask: torch.Tensor | None = None    # [n, W] bool: committed -> [MASK]
    replace: torch.Tensor | None = None   # [n, W] bool: committed -> another token, in place
    keeps: torch.Tensor | None = None     # [n] long: verified tokens left unchanged
    verified: torch.Tensor | None = None  # [n] long: positions checked this step
    stop: torch.Tensor | None = None      # [n] bool: end the request right after this step
                                          # (finish_reason "stop"; LLaDA2's eos_early_stop)
    state: dict[str, torch.Tensor] | None = None   # [n, ...] values `absorb` reads on the host
                                                   # (the strategy's own bookkeeping)

    def tensors(self) -> list[torch.Tensor | None]:
        """Every tensor of the decision, in a fixed order (`from_tensors` inverts it)."""
        state = self.state or {}
        return [self.commit, self.tokens, self.remask, self.replace, self.keeps, self.verified,
                self.stop, *state.values()]

    def from_tensors(self, tensors: list[torch.Tensor | None]) -> "Decision":
        """A decision like this one holding `tensors` (e.g. their host copies)."""
        fixed, rest = tensors[:7], tensors[7:]
        state = None if self.state is None else dict(zip(self.state, rest))
        return Decision(*fixed, state=state)


class Strategy(ABC):
    """One decoding rule. Subclasses set `name` and `params_cls` and implement `decide`."""

    name: ClassVar[str]
    params_cls: ClassVar[type[StrategyParams]] = StrategyParams
    fixed_schedule: ClassVar[bool] = False   # True: `steps` budgets the steps of each block
    wants_stats: ClassVar[bool] = False      # True: StepBatch.drift / attn_in are filled
    revises_done_blocks: ClassVar[bool] = False   # True: a finished block may still change, so
                                                  # tokens are FINAL only when the request ends
    masked_rows_only: ClassVar[bool] = False      # True: `decide` reads logits only at the
                                                  # block's [MASK] positions and the seeds, so a
                                                  # sparse window may leave other rows out
    verifies_seeds: ClassVar[bool] = False        # True: `select_seeds` / `plan_seeds` pick
                                                  # seeds (COVER), whose fresh K/V want the
                                                  # cache's scratch slots (worker/kv_cache.py)

    def __init__(self, params: StrategyParams, spec: ModelSpec):
        self.params, self.spec = params, spec

    @property
    def cfg_scale(self) -> float:
        """Classifier-free guidance weight; > 0 runs an unconditional copy of the canvas."""
        return 0.0

    def default_steps(self, max_tokens: int) -> int:
        """Total steps when SamplingParams.steps is None (fixed-schedule strategies)."""
        return max_tokens

    def check_steps(self, steps: int | None, max_tokens: int) -> None:
        """Raise ValueError when SamplingParams.steps cannot mean anything for this strategy:
        a step reveals at least one token, so more steps than max_tokens never run."""
        if steps is not None and steps > max_tokens:
            raise ValueError(f"steps ({steps}) exceeds max_tokens ({max_tokens}): decoding="
                             f"{self.name!r} reveals at least one token a step; give steps <= "
                             "max_tokens (or leave steps unset)")

    def default_block_length(self, max_tokens: int) -> int:
        """Block length when SamplingParams.block_length is None (default: the model's, capped
        at max_tokens). A decoder whose reference has no blocks returns max_tokens: one block."""
        return min(self.spec.default_block_length, max_tokens)

    def view_start(self, block_start: int, prompt_len: int) -> int:
        """First canvas position whose logits `decide` needs (default: the current block)."""
        return block_start

    def select_seeds(self, state: BlockState, block_tokens: torch.Tensor,
                     block_start: int) -> list[int]:
        """Canvas positions to verify in the next forward (masked in its input, their cached
        K/V served to every other row). `block_tokens` [block_len] is the current block."""
        return []

    def plan_seeds(self, states: list[BlockState], canvases: list[torch.Tensor],
                   blocks: list[tuple[int, int]]) -> list[list[int]]:
        """`select_seeds` for every request this instance serves in a step, from each one's
        canvas [L] and current block (start, end); a strategy with seeds overrides it with one
        vectorised pass over the batch."""
        return [self.select_seeds(st, canvas[start:end], start)
                for st, canvas, (start, end) in zip(states, canvases, blocks)]

    def plan_extra_rows(self, states: list[BlockState], canvases: list[torch.Tensor],
                        blocks: list[tuple[int, int]]) -> list[ExtraRows | None]:
        """`extra_rows` for every request this instance serves in a step (as `plan_seeds`)."""
        return [self.extra_rows(st, canvas, block)
                for st, canvas, block in zip(states, canvases, blocks)]

    def overrides(self, *names: str) -> bool:
        """Whether this strategy's class overrides any of the hooks `names` (the stage skips
        a hook no strategy of the step has)."""
        return any(getattr(type(self), name) is not getattr(Strategy, name) for name in names)

    def extra_rows(self, state: BlockState, canvas: torch.Tensor,
                   block: tuple[int, int]) -> ExtraRows | None:
        """Extra query rows for the next forward (WINO's shadow block): never cached, never seen
        by canvas rows; their logits arrive as `StepBatch.extra_logits`. `canvas` [L]."""
        return None

    def embed_edits(self, state: BlockState, canvas: torch.Tensor,
                    block: tuple[int, int]) -> EmbedEdit | None:
        """Input-embedding edits for the next forward at positions of the current block (ASRD's
        anchor guidance and perturbations), applied by the runner after `model.embed`."""
        return None

    def start_block(self, state: BlockState, num_masked: int) -> None:
        """Called when a request enters a new block, before its first step."""

    def block_done(self, state: BlockState, num_masked: int) -> bool:
        """Whether the current block is complete (default: no [MASK] left in it)."""
        return num_masked == 0

    @property
    def eos_ends_request(self) -> bool:
        """Whether a finished block holding an EOS ends the request (unless ignore_eos; vLLM's
        rule). False: every block is generated and only the output is cut after the first EOS
        (LLaDA2.1's `generate` without eos_early_stop). stop_token_ids end it either way."""
        return True

    @abstractmethod
    def decide(self, batch: StepBatch) -> Decision:
        """One vectorised decision for every request of the batch, on the logits' device (the
        module doc says what it may read)."""

    def absorb(self, batch: StepBatch, decision: Decision) -> None:
        """After the step's transfer: advance the host-side state of every request from its
        `decision` (host tensors; before structured outputs edit it). Default: nothing."""


def decide_now(strategy: Strategy, batch: StepBatch) -> Decision:
    """`decide`, the transfer and `absorb` for one strategy: the host decision (what the engine
    does for a whole step in engine/decide.py, for tests and tools that drive one strategy)."""
    decision = strategy.decide(batch)
    host = decision.from_tensors([None if t is None else t.cpu() for t in decision.tensors()])
    strategy.absorb(batch, host)
    return host


def block_rows(canvases: list[torch.Tensor],
               blocks: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every request's current block as one [n, B] array (B = the longest block; past a
    block's end the row holds other tokens: mask with `arange(B) < lengths`), with the blocks'
    starts and lengths [n]. Two tensor ops for the batch: one cat, one gather."""
    start, end = np.array(blocks).reshape(-1, 2).T
    lengths = end - start
    sizes = np.array([c.numel() for c in canvases])
    flat = torch.cat(canvases).numpy()
    first = np.cumsum(sizes) - sizes + start
    cols = np.arange(int(lengths.max()))
    return flat[np.minimum(first[:, None] + cols, flat.size - 1)], start, lengths
