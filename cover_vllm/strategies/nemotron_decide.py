"""The device side of Nemotron-Labs-Diffusion's decodings (strategies/nemotron.py): one step's
token picks and confidences for every running request at once, on the logits' device, and one
copy of the small results to the host (issue #50).

A step's logits are one [R, V] tensor, the rows every request asked for laid end to end
(models/nemotron_cache.py `PieceLogits`). What a request decides from its rows needs only, per
row, the picked token and, in some phases, that token's softmax probability, so the device
computes, for the whole batch:

* the argmax of every row; for a request with temperature > 0, the official
  `_add_gumbel_noise` pick instead: argmax of exp(l) / (-log u)^T in float64, u drawn for that
  request's rows only from its own generator, so its draws never depend on the batch;
* when a request wants them (`Loop.wants_confidence`), softmax(l)[pick] of every row;

then `HostTransfer.fetch` copies the [R] ids and the [R] confidences to the host in one copy (no
vocabulary-sized tensor crosses), and each request's `absorb` works from plain Python lists.
On the shapes-only "meta" device the host tokens are zeros and the confidences distinct
(descending), so a dry run takes the common path (no tie to settle) and every decoding still ends
(a zero token is never [MASK], and a draft of zeros is accepted whole), as the engine's dry runs
do (tests/test_nemotron_meta.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.host_transfer import HostTransfer
from cover_vllm.models.nemotron_cache import PieceLogits


@dataclass
class Picks:
    """One request's share of a step's decision, on the host."""

    tokens: list[int]                  # [rows] picked token ids
    confidence: list[float] | None     # [rows] softmax probability of each pick (if asked)


def decide(rows: PieceLogits, loops: list, transfer: HostTransfer) -> list[Picks]:
    """Picks for `loops` from `rows` (run_pieces' logits of their pieces, in the same order)."""
    logits, sizes = rows.flat, [r.shape[0] for r in rows]              # [R, V] fp32
    if logits.shape[0] == 0:
        return [Picks([], None) for _ in loops]
    tokens = logits.argmax(-1)                                          # [R]
    start = 0
    for loop, size in zip(loops, sizes):
        if loop.job.temperature > 0 and size:
            tokens[start:start + size] = _gumbel_pick(logits[start:start + size], loop)
        start += size
    conf = None
    if any(loop.wants_confidence for loop in loops):
        conf = torch.softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]     # [R]
    host_tokens, host_conf = transfer.fetch([tokens, conf])
    ids = host_tokens.tolist()
    probs = None if host_conf is None else host_conf.tolist()
    out, start = [], 0
    for loop, size in zip(loops, sizes):
        end = start + size
        conf = probs[start:end] if loop.wants_confidence else None
        if conf is not None and logits.device.type == "meta":
            conf = [1.0 - j / (size + 1) for j in range(size)]       # distinct: no tie to settle
        out.append(Picks(ids[start:end], conf))
        start = end
    return out


def _gumbel_pick(rows: torch.Tensor, loop) -> torch.Tensor:
    """[rows] argmax of the official float64 Gumbel-max perturbation of `rows` [rows, V], from
    the request's own generator on the logits' device (made on first use from its seed; none on
    the shapes-only "meta" device, which has no generators)."""
    generator = None
    if rows.device.type != "meta":
        if loop.generator is None:
            loop.generator = torch.Generator(device=rows.device).manual_seed(loop.job.seed)
        generator = loop.generator
    noise = torch.rand(rows.shape, dtype=torch.float64, generator=generator, device=rows.device)
    return (rows.double().exp() / (-noise.log()) ** loop.job.temperature).argmax(-1)
