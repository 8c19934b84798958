"""`EngineLoad`: what a driver or router reads from an engine to balance and report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """What a driver or router reads to balance and report: requests and KV pages."""

    running: int
    waiting: int
    pages_used: int
    pages_total: int
