"""Step observers: the official hook for timing or recording engine steps (benchmarks, tests).

`Engine.add_observer(obs)` / `remove_observer(obs)`. Each step the engine calls, in order:

    on_schedule(out)             the packed SchedulerOutput, before the forward
    on_decide(strategy, batch)   before each vectorised `decide` (batch.states not yet updated)
    on_step(record)              after the step: its StepRecord (phase laps and batch shape)

An observer reads what it is handed and changes nothing; the engine pays for the record only
while an observer is attached.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cover_vllm.flops import canvas_item_shapes, item_shape

PHASES = ("schedule", "prepare", "forward", "strategy", "update")


@dataclass
class StepRecord:
    """One step's wall-clock phases (seconds) and the shape of its batch."""

    schedule: float       # admission, the strategies' plans, packing
    prepare: float        # the runner laying out the batch (its share of the executor call)
    forward: float        # the model forward (the executor call minus `prepare`)
    strategy: float       # the strategies' decisions (`decide_device` of it on the logits)
    update: float         # applying them: canvases, blocks, stop checks, outputs
    num_tokens: int       # query rows of the forward
    num_seqs: int         # work items
    num_refresh: int      # of which refreshes
    attn_pairs: int       # (query, key) pairs attended
    logit_rows: int       # rows through the LM head
    host_copies: int = 0  # device-to-host copies (0 on a CPU engine: nothing moves)
    host_bytes: int = 0   # bytes they brought to the host
    device_forward: float | None = None   # CUDA: the executor call's span on the device
                                          # (CUDA events); None on any other device
    decide_device: float | None = None    # of `strategy`, the decoders' work on the logits'
                                          # device (engine/timing.py: CUDA events; on the CPU
                                          # the time inside the aten ops on the logits); None
                                          # on meta

    @classmethod
    def of(cls, clock, prepare_s: float, out, host_copies: int = 0,
           host_bytes: int = 0) -> "StepRecord":
        """The record of a step timed by `clock` (engine/timing.py StepClock)."""
        laps = clock.laps
        shapes = [item_shape(i) for i in out.items]       # cover_vllm/flops.py
        for item in out.canvas_items:                     # uniform-state: encoder + decoder
            (n, enc), (c, dec) = canvas_item_shapes(item)
            shapes.append((n + c, enc + dec, c))
        return cls(schedule=laps["schedule"], prepare=prepare_s,
                   forward=laps["forward"] - prepare_s, strategy=laps["strategy"],
                   update=laps["update"], num_tokens=sum(t for t, _, _ in shapes),
                   num_seqs=len(out.items) + len(out.canvas_items),
                   num_refresh=sum(i.is_refresh for i in out.items),
                   attn_pairs=sum(p for _, p, _ in shapes), logit_rows=sum(r for _, _, r in shapes),
                   host_copies=host_copies, host_bytes=host_bytes,
                   device_forward=clock.device_s(), decide_device=clock.decide_s())

    @property
    def host_s(self) -> float:
        """Seconds of the step the device would wait for the host: everything outside the
        model forward and the decoders' work on the logits (engine/timing.py)."""
        return (self.schedule + self.prepare + self.strategy - (self.decide_device or 0.0)
                + self.update)

    def as_dict(self) -> dict:
        return asdict(self)


class StepObserver:
    """Base of step observers: every hook does nothing; override the ones you need. With
    `times_logits` a CPU engine times the decoders' ops on the logits (`decide_device`) at a
    cost to the host's share of those steps (engine/timing.py LogitsOpTimer)."""

    times_logits = False

    def on_schedule(self, out) -> None:
        """The step's packed SchedulerOutput, before the forward."""

    def on_decide(self, strategy, batch) -> None:
        """A strategy is about to decide for `batch` (a StepBatch)."""

    def on_step(self, record: StepRecord) -> None:
        """The step ended; `record` holds its timings."""


class StepTimes(StepObserver):
    """Collects every step's record as a dict (phase seconds and batch shape) in `rows`."""

    def __init__(self, rows: list[dict] | None = None, times_logits: bool = False):
        self.rows = [] if rows is None else rows
        self.times_logits = times_logits

    def on_step(self, record: StepRecord) -> None:
        self.rows.append(record.as_dict())
