"""When a request's cached K/V are recomputed: the `cache_refresh` policy and its counters.

With `kv_cache="prefix"` or `"dual"` a step forwards only part of the canvas; every other
position's K/V come from the last forward that computed them. A *refresh* is a step whose window
also covers the cached positions, so their K/V are rewritten; the step drafts (and verifies) like
any other, so a refresh costs no extra NFE, only window rows (model FLOPs, cover_vllm/flops.py).
A refresh is an ordinary work item of one request: the rest of the batch runs its own items in
the same forward and never waits for it.

Policies (`cache_refresh=`, per request in SamplingParams or engine-wide in `LLM(...)`):

* `"block"` (default): a whole-canvas refresh at each block start only (Fast-dLLM).
* `"interval:N"`: also a whole-canvas refresh every N steps (N = 1: every step, the same
  forwards as `kv_cache="none"`).
* `"adaptive"`: with `dual`, a step forwards only the block positions whose cached K/V no longer
  match the canvas (still [MASK], token changed since last computed, COVER's seeds, and their
  predictor rows; `partial`), for strategies whose decision reads only those rows
  (`Strategy.masked_rows_only`). The cached positions are refreshed when
  (`RefreshState.should_refresh`):
  * a verification changed a token since the last refresh (COVER's Replace or ReMask: the
    check says the context the cache was built on was wrong), or
  * `max_stale_steps` (2) steps have changed the canvas since the last refresh, while the
    block's still-masked rows put at least `min_cached_mass` (0.3) of their attention on
    positions outside the block (the drafts lean on the stale part), or
  * optionally, `min_changed_fraction` of the block has changed since the last refresh.
  Such a refresh is partial (`refresh_block=False`): it recomputes the cached positions that
  took `refresh_mass_share` (0.97) of that attention, plus the stale block positions. Beyond
  the first of a block, a triggered refresh is paid for (`budget` 0.5): allowed once the rows
  the sparse windows saved against whole-block windows reach half its rows.
  The block-start refresh stays whole. Signals and bars were chosen by measurement on cover-tiny
  (docs/benchmarks.md, "Verification-driven cache refresh").

This module owns the policy and the per-request counters; the scheduler asks it, per step,
whether the next item is a refresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REFRESH_MODES = ("block", "interval", "adaptive")
_HELP = "choose 'block', 'interval:N' (N >= 1) or 'adaptive'"


@dataclass(frozen=True)
class CacheRefresh:
    """A parsed `cache_refresh` value. The string sets `mode` and `interval`; the adaptive bars
    keep their measured defaults unless set from Python."""

    mode: str = "block"
    interval: int | None = None                # steps between refreshes ("interval" only)
    # adaptive only, from here on
    max_stale_steps: int = 2                   # canvas-changing steps since the last refresh
    on_revision: bool = True                   # a check replaced/remasked a token
    min_changed_fraction: float | None = None  # changed block positions / block length
    min_cached_mass: float | None = 0.3        # the stale-steps trigger fires only while the
                                               # masked rows put this share of attention on
                                               # cached positions (None: always)
    partial: bool = True                       # dual: forward only the stale block positions
    refresh_block: bool = False                # a triggered refresh also recomputes the
                                               # block's unchanged tokens (a whole refresh)
    refresh_mass_share: float | None = 0.97    # ... and only the cached positions holding this
                                               # share of the attention on them (None: all)
    budget: float | None = 0.5                 # a triggered refresh must be paid for: allowed
                                               # once the rows sparse windows saved (against
                                               # the whole block) reach budget x its rows; the
                                               # block's first one is free (None: no budget)

    def __post_init__(self) -> None:
        if self.mode not in REFRESH_MODES:
            raise ValueError(f"cache_refresh mode {self.mode!r}; {_HELP}")
        if self.mode == "interval":
            if isinstance(self.interval, bool) or not isinstance(self.interval, int) \
                    or self.interval < 1:
                raise ValueError(f"cache_refresh='interval:{self.interval}'; {_HELP}")
        elif self.interval is not None:
            raise ValueError(f"cache_refresh mode {self.mode!r} takes no interval; {_HELP}")
        if isinstance(self.max_stale_steps, bool) or not isinstance(self.max_stale_steps, int) \
                or self.max_stale_steps < 1:
            raise ValueError("cache_refresh.max_stale_steps must be an int >= 1, got "
                             f"{self.max_stale_steps!r}")
        for name in ("min_cached_mass", "refresh_mass_share"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"cache_refresh.{name} must be in [0, 1] or None, got {value!r}")
        if self.min_changed_fraction is not None and not 0.0 < self.min_changed_fraction <= 1.0:
            raise ValueError("cache_refresh.min_changed_fraction must be in (0, 1] or None, got "
                             f"{self.min_changed_fraction!r}")

    @property
    def sparse(self) -> bool:
        """Whether dual-cache steps forward only the stale block positions."""
        return self.mode == "adaptive" and self.partial

    @property
    def wants_mass(self) -> bool:
        """Whether the policy reads the attention mass on cached positions (stats layer)."""
        return self.mode == "adaptive" and self.min_cached_mass is not None

    @property
    def label(self) -> str:
        """The string form: 'block', 'interval:N' or 'adaptive'."""
        return f"interval:{self.interval}" if self.mode == "interval" else self.mode


def parse_cache_refresh(value: "str | CacheRefresh") -> CacheRefresh:
    """'block' | 'interval:N' | 'adaptive' (or a CacheRefresh, returned as is) -> CacheRefresh.
    Anything else raises ValueError naming the value and the allowed forms."""
    if isinstance(value, CacheRefresh):
        return value
    if not isinstance(value, str):
        raise ValueError(f"cache_refresh={value!r}; {_HELP}")
    text = value.strip()
    if text in ("block", "adaptive"):
        return CacheRefresh(text)
    head, sep, tail = text.partition(":")
    if head.strip() == "interval" and sep and tail.strip().isdigit() and int(tail) >= 1:
        return CacheRefresh("interval", int(tail))
    raise ValueError(f"cache_refresh={value!r}; {_HELP}")


@dataclass
class RefreshState:
    """One request's refresh counters: what happened to its canvas since its last refresh."""

    policy: CacheRefresh
    pending: bool = True         # a block start (or the first step): refresh unconditionally
    steps_since: int = 0         # forwards since the last refresh
    stale_steps: int = 0         # of those (and the refresh's own decision), steps that
                                 # changed the canvas
    changed: int = 0             # positions whose token changed since the refresh forward
    revisions: int = 0           # of which a verification replaced or remasked
    credit: float = 0.0          # rows saved by sparse windows, minus refreshes paid for
    cached_mass: float | None = None   # last measured share of the masked rows' attention on
                                       # positions outside the block
    column_mass: torch.Tensor | None = None    # [L] that attention per key column

    def should_refresh(self, block_len: int, cached_len: int) -> bool:
        """Whether the next step of this request must be a refresh (`cached_len`: positions
        outside the block, what a refresh recomputes). Called once per scheduled step: a
        budgeted refresh is paid for here."""
        p = self.policy
        if self.pending:
            self.credit = 0.0 if p.budget is None else p.budget * cached_len   # one free
            return True
        if p.mode == "interval":
            return self.steps_since + 1 >= p.interval
        if p.mode != "adaptive" or not self._signal(block_len):
            return False
        if p.budget is None:
            return True
        cost = p.budget * cached_len
        if self.credit < cost:
            return False
        self.credit -= cost
        return True

    def _signal(self, block_len: int) -> bool:
        """Whether an adaptive signal has crossed its bar."""
        p = self.policy
        if p.on_revision and self.revisions > 0:
            return True
        if self.stale_steps >= p.max_stale_steps and (
                p.min_cached_mass is None or self.cached_mass is None
                or self.cached_mass >= p.min_cached_mass):
            return True
        return p.min_changed_fraction is not None and \
            self.changed >= p.min_changed_fraction * block_len

    def save(self, rows: int) -> None:
        """A sparse window ran `rows` fewer rows than the whole block would have."""
        self.credit += rows

    def record(self, is_refresh: bool, changed: int, revisions: int) -> None:
        """After a step that changed `changed` positions (`revisions` of them by a check). The
        refresh forward read the canvas *before* its own decision, so that decision's changes
        already count against the fresh cache."""
        if is_refresh:
            self.pending, self.steps_since = False, 0
            self.stale_steps = self.changed = self.revisions = 0
        else:
            self.steps_since += 1
        self.stale_steps += int(changed > 0)
        self.changed += changed
        self.revisions += revisions
