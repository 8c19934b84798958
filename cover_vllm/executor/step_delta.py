"""What a tensor-parallel step sends to the other ranks: the SchedulerOutput minus what they hold.

A canvas's page table (`CanvasInput.key_slots`: the cache slot of every canvas position) is
fixed from a request's admission to its end, yet it is the bulk of a step's message (an int64
per canvas position per request). Each rank keeps the page tables it has been sent, keyed by
(request id, canvas index); the driver sends one only when a rank does not hold it yet or it
changed. Everything that does change per step — window tokens, overrides, extra rows, edits —
is sent as before. Both sides keep exactly the canvases of the last step (every running request
has a work item every step), so a request that finishes or is aborted is forgotten by both at
the next step, and one that returns is sent again.
"""

from __future__ import annotations

import dataclasses

import torch

from cover_vllm.scheduler.output import CanvasInput, SchedulerOutput

_Key = tuple[str, int]


def _with_canvases(out: SchedulerOutput, canvases: list[list[CanvasInput]]) -> SchedulerOutput:
    items = [dataclasses.replace(item, canvases=c) for item, c in zip(out.items, canvases)]
    return dataclasses.replace(out, items=items)


class StepEncoder:
    """Driver side: drops the page tables the ranks already hold."""

    def __init__(self) -> None:
        self._sent: dict[_Key, torch.Tensor] = {}

    def encode(self, out: SchedulerOutput) -> SchedulerOutput:
        sent, canvases = {}, []
        for item in out.items:
            row = []
            for c, canvas in enumerate(item.canvases):
                key, slots = (item.request_id, c), canvas.key_slots
                held = self._sent.get(key)
                known = held is not None and (held is slots or torch.equal(held, slots))
                row.append(dataclasses.replace(canvas, key_slots=None) if known else canvas)
                sent[key] = slots
            canvases.append(row)
        self._sent = sent
        return _with_canvases(out, canvases)


class StepDecoder:
    """Rank side: puts back the page tables the driver left out."""

    def __init__(self) -> None:
        self._held: dict[_Key, torch.Tensor] = {}

    def decode(self, message: SchedulerOutput) -> SchedulerOutput:
        held, canvases = {}, []
        for item in message.items:
            row = []
            for c, canvas in enumerate(item.canvases):
                key = (item.request_id, c)
                if canvas.key_slots is None:
                    canvas = dataclasses.replace(canvas, key_slots=self._held[key])
                held[key] = canvas.key_slots
                row.append(canvas)
            canvases.append(row)
        self._held = held
        return _with_canvases(message, canvases)
