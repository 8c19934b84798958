"""When a request's cached K/V are recomputed: the `cache_refresh` policy and its signals.

With `kv_cache="prefix"` or `"dual"` a step forwards only the current block (and, for `prefix`,
the suffix); every other position's K/V come from the last forward that computed them. A
*refresh* is a step whose window is the whole canvas: every position's K/V are rewritten, and the
step drafts (and verifies) like any other, so it costs no extra NFE, only a wider window. A
refresh is an ordinary work item of one request: it never stalls the rest of the batch.

Policies (`cache_refresh=`, per request in SamplingParams or engine-wide in `LLM(...)`):

* `"block"` (default): refresh at each block start only (Fast-dLLM).
* `"interval:N"`: also every N steps (N = 1: every step, i.e. the same forwards as
  `kv_cache="none"`).
* `"adaptive"`: also when the canvas has moved far enough from the one the cached K/V were
  computed on (`RefreshState.should_refresh`): the number of block positions whose token changed
  since the last refresh (drafts, replacements, remasks) reaches `min_changed_fraction` of the
  block, or, for strategies that verify (COVER), a verification changed a token (Replace or
  ReMask) — the check just said the context the cache was built on was wrong. The bars were
  chosen by measurement (docs/benchmarks.md, "Verification-driven cache refresh").

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
    """A parsed `cache_refresh` value. Only `mode`/`interval` come from the string; the
    adaptive bars are fixed defaults (measured), settable from Python."""

    mode: str = "block"
    interval: int | None = None          # steps between refreshes ("interval" only)
    min_changed_fraction: float = 0.5    # adaptive: changed block positions / block length
    on_revision: bool = True             # adaptive: a verification replaced/remasked a token
    before_final_check: bool = False     # adaptive: the block has no [MASK] left but is not
                                         # done (a verification-only step follows)
    max_surprise: float | None = None    # adaptive: sum of (1 - p(token)) over commits
    max_drift: float | None = None       # adaptive: summed mean key drift of the window (COVER)
    max_commit_surprise: float | None = None   # EXP: any single commit with 1 - p above this
    refreshes_per_block: int | None = None      # EXP: refresh the first N steps of a block
    max_mass_change: float | None = None        # EXP: |outside mass - at refresh|
    hard_below: float | None = None             # EXP: best remaining masked conf below this
    rel_changed: float | None = None            # EXP: changed / masked at refresh
    max_versions: int | None = None             # EXP: canvas-changing steps since refresh

    def __post_init__(self) -> None:
        if self.mode not in REFRESH_MODES:
            raise ValueError(f"cache_refresh mode {self.mode!r}; {_HELP}")
        if self.mode == "interval":
            if isinstance(self.interval, bool) or not isinstance(self.interval, int) \
                    or self.interval < 1:
                raise ValueError(f"cache_refresh='interval:{self.interval}'; {_HELP}")
        elif self.interval is not None:
            raise ValueError(f"cache_refresh mode {self.mode!r} takes no interval; {_HELP}")
        if not 0.0 < self.min_changed_fraction <= 1.0:
            raise ValueError("cache_refresh.min_changed_fraction must be in (0, 1], got "
                             f"{self.min_changed_fraction!r}")

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
    if head == "interval" and sep and tail.strip().isdigit() and int(tail) >= 1:
        return CacheRefresh("interval", int(tail))
    raise ValueError(f"cache_refresh={value!r}; {_HELP}")


@dataclass
class StepSignals:
    """What one step did to a request's canvas, as the refresh policy sees it."""

    changed: int = 0             # positions whose token changed (drafts, replaces, remasks)
    revisions: int = 0           # of which a verification replaced or remasked
    surprise: float = 0.0        # sum over this step's commits of 1 - p(committed token)
    top_surprise: float = 0.0
    drift: float = 0.0           # mean key drift of the window rows (strategies with stats)
    outside_mass: float | None = None
    next_conf: float = 1.0       # best confidence among positions still masked after the step
    masked_before: int = 0       # [MASK] positions of the view before the step


@dataclass
class RefreshState:
    """One request's refresh counters: what happened to its canvas since its last refresh."""

    policy: CacheRefresh
    steps_since: int = 0         # forwards since the last refresh
    changed: int = 0             # block positions whose token changed since then
    revisions: int = 0           # verification replaces + remasks since then
    pending: bool = True         # a block start (or the first step): refresh unconditionally
    surprise: float = 0.0
    drift: float = 0.0
    top_surprise: float = 0.0
    block_refreshes: int = 0
    mass_ref: float | None = None
    next_conf: float = 1.0
    mass_change: float = 0.0

    def should_refresh(self, block_len: int, masked_left: int) -> bool:
        """Whether the next step of this request must be a refresh (`masked_left`: [MASK]
        positions left in the block)."""
        p = self.policy
        if self.pending:
            return True
        if p.mode == "interval":
            return self.steps_since + 1 >= p.interval
        if p.mode == "adaptive":
            if p.on_revision and self.revisions > 0:
                return True
            if p.before_final_check and masked_left == 0 and self.changed > 0:
                return True
            if p.max_surprise is not None and self.surprise >= p.max_surprise:
                return True
            if p.max_drift is not None and self.drift >= p.max_drift:
                return True
            if p.max_commit_surprise is not None and self.top_surprise >= p.max_commit_surprise:
                return True
            if p.refreshes_per_block is not None and self.block_refreshes < p.refreshes_per_block:
                return True
            if p.max_mass_change is not None and self.mass_change >= p.max_mass_change:
                return True
            if p.max_versions is not None and self.versions >= p.max_versions:
                return True
            if p.rel_changed is not None and self.changed > 0 and \
                    self.changed >= p.rel_changed * max(self.masked_at_refresh, 1):
                return True
            if p.hard_below is not None and masked_left > 0 and self.next_conf < p.hard_below \
                    and self.changed > 0:
                return True
            return self.changed >= p.min_changed_fraction * block_len
        return False

    def record(self, is_refresh: bool, step: StepSignals) -> None:
        """After a step: add what it changed (a refresh restarts the counts)."""
        if is_refresh:
            # the refresh forward read the canvas as it was *before* this step's decision, so
            # the changes it made are already stale in the cache
            self.block_refreshes = 1 if self.pending else self.block_refreshes + 1
            self.top_surprise = 0.0
            self.mass_ref, self.mass_change = step.outside_mass, 0.0
            self.masked_at_refresh = step.masked_before
            self.versions = 0
            self.pending, self.steps_since = False, 0
            self.changed = self.revisions = 0
            self.surprise = self.drift = 0.0
        else:
            self.steps_since += 1
            self.drift += step.drift
            if step.outside_mass is not None and self.mass_ref is not None:
                self.mass_change = abs(step.outside_mass - self.mass_ref) / max(self.mass_ref, 1e-6)
        self.changed += step.changed
        self.versions += int(step.changed > 0)
        self.revisions += step.revisions
        self.surprise += step.surprise
        self.next_conf = step.next_conf
        self.top_surprise = max(self.top_surprise, step.top_surprise)


def step_signals(out, result, decisions: dict, requests: dict) -> dict[str, StepSignals]:
    """Per request, what the forward measured: the surprise of its commits (from the view
    logits) and its window's mean key drift (when its strategy asked for statistics)."""
    signals = {}
    for i, item in enumerate(out.items):
        d = decisions[item.request_id]
        step = StepSignals()
        if bool(d.commit.any()):
            logits = result.logits[i][d.commit].double()          # [C, V]
            probs = torch.softmax(logits, dim=-1)
            own = probs.gather(-1, d.tokens[d.commit][:, None])[:, 0]
            step.surprise = float((1.0 - own).sum())
            step.top_surprise = float((1.0 - own).max())
        req = requests[item.request_id]
        tokens = req.canvas[item.view_start:item.view_end]
        left = (tokens == req.mask_id) & ~d.commit
        step.masked_before = int((tokens == req.mask_id).sum())
        if bool(left.any()):
            probs = torch.softmax(result.logits[i][left].double(), dim=-1)
            probs[:, req.mask_id] = 0.0
            step.next_conf = float(probs.max())
        if getattr(result, "outside_mass", None) is not None:
            step.outside_mass = result.outside_mass[i]
        if result.drift is not None and result.drift[i] is not None:
            step.drift = float(result.drift[i].mean())
        signals[item.request_id] = step
    return signals
