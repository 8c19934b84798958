"""The uniform-state decoders' part of the engine (DiffusionGemma): which decoders a model takes,
the first canvas of the requests admitted in a step, and each step's decisions on the logits'
device, one copy to the host, then each decoder's `absorb`.

Per decoder instance, one vectorised `decide` over its requests' canvases ([n, C, V] processed
logits, a view of the runner's tensor), then, for requests with `logprobs`, the log-probabilities
of the step's argmax canvas under the raw logits (engine/logprobs.py `logprob_rows`: the top k
and the rank; a canvas's output is its last step's argmax, so the last step's entries are the
ones kept). Every tensor crosses in one `HostTransfer.fetch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.engine.decide import stack_logits
from cover_vllm.engine.logprobs import logprob_rows
from cover_vllm.host_transfer import HostTransfer
from cover_vllm.scheduler.canvas_request import CanvasRequest
from cover_vllm.scheduler.output import CanvasItem
from cover_vllm.models.spec import ModelSpec
from cover_vllm.step_plan import TokenLogprobs
from cover_vllm.strategies import CANVAS_DECODERS, STRATEGIES
from cover_vllm.strategies.canvas import CanvasBatch, CanvasDecision, CanvasDecoder


CANVAS_STRUCTURED_REFUSAL = (
    "structured_outputs is not supported with a uniform-state decoder (decoding="
    "'diffusion_gemma'): its canvas has no [MASK] to hold back, every position not accepted is "
    "re-drawn at random at every step, and the output is the last step's argmax, so a "
    "grammar-valid prefix cannot be kept without changing the reference sampler; generate "
    "unconstrained and validate, or use a masked-diffusion model")


def check_decoder(decoder, spec: ModelSpec, what: str) -> None:
    """ValueError when the decoder and the model disagree on [MASK]: a masked decoder commits
    into [MASK] slots a uniform-state model does not have, and the reverse."""
    uniform = isinstance(decoder, CanvasDecoder)
    if uniform and not spec.uniform_state:
        raise ValueError(f"{what}={decoder.name!r} decodes uniform-state canvases (no [MASK]); "
                         f"{spec.family!r} is a masked-diffusion model: choose one of "
                         f"{sorted(STRATEGIES)}")
    if spec.uniform_state and not uniform:
        raise ValueError(f"{what}={decoder.name!r} commits tokens into [MASK] slots, but "
                         f"{spec.family!r} has no [MASK] token (uniform-state diffusion): use "
                         f"one of {sorted(CANVAS_DECODERS)} (the default)")


def check_canvas_length(spec: ModelSpec, prompt_len: int, max_tokens: int) -> None:
    """ValueError naming the field at fault when the prompt and max_tokens' whole canvases
    exceed max_model_len."""
    block, limit = spec.default_block_length, spec.max_model_len
    room = (limit - prompt_len) // block * block
    if room < 1:
        raise ValueError(f"prompt ({prompt_len} tokens) leaves no room for a {block}-token "
                         f"canvas within max_model_len={limit}: shorten the prompt")
    if max_tokens > room:
        raise ValueError(f"max_tokens ({max_tokens}) needs {-(-max_tokens // block)} canvases "
                         f"of {block} tokens after the prompt ({prompt_len} tokens), beyond "
                         f"max_model_len={limit}: give max_tokens <= {room}")


def first_canvases(reqs: list[CanvasRequest], device: torch.device,
                   transfer: HostTransfer) -> None:
    """Draw each newly admitted request's first canvas from its generator (on `device`) and
    bring them to the host in one copy."""
    if not reqs:
        return
    draws = [r.strategy.initial_canvas(r.generator, r.canvas_length, device) for r in reqs]
    for req, tokens in zip(reqs, transfer.fetch(draws)):
        req.tokens = tokens


@dataclass
class _Group:
    decoder: CanvasDecoder
    reqs: list[CanvasRequest]
    batch: CanvasBatch
    decision: CanvasDecision
    logprobs: dict[int, tuple]          # row -> logprob_rows' tensors

    def tensors(self) -> list[torch.Tensor | None]:
        return self.decision.tensors() + [t for rows in self.logprobs.values() for t in rows]


def run_canvas_decoders(items: list[CanvasItem], requests: dict, result,
                        transfer: HostTransfer
                        ) -> dict[str, tuple[CanvasDecision, TokenLogprobs | None]]:
    """Every denoised canvas's decision (host, its row) and, if asked, its logprobs."""
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        if result.canvas_logits[i] is not None:
            groups.setdefault(id(requests[item.request_id].strategy), []).append(i)
    decided = [_decide([requests[items[i].request_id] for i in idx],
                       [result.canvas_logits[i] for i in idx],
                       [result.canvas_raw[i] for i in idx]) for idx in groups.values()]
    host = iter(transfer.fetch([t for g in decided for t in g.tensors()]))
    out = {}
    for g in decided:
        fixed = len(g.decision.tensors())
        parts = [next(host) for _ in g.tensors()]
        g.decision = g.decision.from_tensors(parts[:fixed])
        rest = iter(parts[fixed:])
        lps = {row: tuple(next(rest) for _ in t) for row, t in g.logprobs.items()}
        g.decoder.absorb(g.batch, g.decision)
        for row, req in enumerate(g.reqs):
            out[req.request_id] = (g.decision.row(row), _token_logprobs(lps.get(row)))
    return out


def _decide(reqs: list[CanvasRequest], logits: list[torch.Tensor],
            raw: list[torch.Tensor | None]) -> _Group:
    decoder = reqs[0].strategy
    batch = CanvasBatch(stack_logits(logits, logits[0].shape[0]), [r.state for r in reqs],
                        [r.generator for r in reqs], [r.has_next_canvas for r in reqs])
    decision = decoder.decide(batch)
    logprobs = {}
    for row, (req, rows) in enumerate(zip(reqs, raw)):
        if req.params.logprobs is not None:
            every = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
            logprobs[row] = logprob_rows(rows, every, decision.argmax[row], req.params.logprobs)
    return _Group(decoder, reqs, batch, decision, logprobs)


def _token_logprobs(rows: tuple | None) -> TokenLogprobs | None:
    if rows is None:
        return None
    ids, values, ranks = rows
    return TokenLogprobs(torch.arange(ids.shape[0]), ids, values, ranks)
