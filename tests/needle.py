"""The needle check of the batch-invariant mode (issue #51): one request run alone, then inside
random batches; its logits at every step (hooked at the worker's output), tokens, NFE and
logprobs compared bitwise. Used by tests/test_batch_invariant.py."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from cover_vllm import SamplingParams

NEEDLE = "needle"


@dataclass
class NeedleRun:
    """What one run recorded of the needle: per step its logits (and extra rows / canvas raw
    logits), and its final output."""

    steps: list[tuple[torch.Tensor | None, ...]] = field(default_factory=list)
    tokens: list[int] | None = None
    nfe: int | None = None
    logprobs: list | None = None


class NeedleSpy:
    """Wraps the engine's in-process Worker.execute_model (the mode is entered inside it) and
    copies the needle's rows of every step's output."""

    def __init__(self, llm):
        self.worker = llm.engine.executor
        self.inner = self.worker.execute_model
        self.worker.execute_model = self
        self.run: NeedleRun | None = None

    def __call__(self, out):
        result = self.inner(out)
        if self.run is not None:
            for i, item in enumerate(out.items):
                if item.request_id == NEEDLE:
                    extra = result.extra_logits[i] if result.extra_logits else None
                    self.run.steps.append(tuple(_copy(t) for t in (result.logits[i], extra)))
            for i, item in enumerate(getattr(out, "canvas_items", None) or []):
                if item.request_id == NEEDLE:
                    self.run.steps.append(tuple(_copy(t) for t in (
                        result.canvas_logits[i], (result.canvas_raw or [None] * (i + 1))[i])))
        return result


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


@dataclass(frozen=True)
class Family:
    """A model of the needle test and the requests that may share its steps."""

    options: dict                       # LLM(**options)
    decoders: tuple                     # the others' decoding (None: the model's default)
    vocab: tuple[int, int] = (5, 250)   # prompt token ids drawn from [lo, hi)
    base: dict = field(default_factory=dict)    # SamplingParams of every request
    caches: tuple = ("none", "prefix", "dual")  # the others' kv_cache
    needle_decoding: str | None = "cover"
    batch_sizes: tuple = (2, 7, 19, 33, 64)     # five batches of 2-64 requests (needle included)
    prompt_len: tuple[int, int] = (2, 40)       # the others' prompt lengths, [lo, hi)
    max_tokens: tuple = (4, 8, 12, 16)          # the others' max_tokens


def run_needle(llm, spy: NeedleSpy, needle: tuple, others: list[tuple]) -> NeedleRun:
    """Add the others and the needle (at a random place among them) as (prompt, params) pairs,
    step the engine until all finish (aborting the first other after one step), and return
    what the needle did."""
    engine = llm.engine
    spy.run = run = NeedleRun()
    place = random.Random(len(others)).randrange(len(others) + 1)
    requests = others[:place] + [needle] + others[place:]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(NEEDLE if i == place else f"other-{i}", prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 2 and place > 0:            # an abort in the needle's batch
            engine.abort_request("other-0")
        for out in engine.step():
            if out.finished and out.request_id == NEEDLE:
                first = out.outputs[0]
                run.tokens, run.nfe = list(first.token_ids), out.metrics.nfe
                run.logprobs = first.logprobs
    spy.run = None
    return run


def differences(solo: NeedleRun, batched: NeedleRun) -> list[str]:
    """What differs bitwise between two needle runs (empty: identical)."""
    found = []
    if len(solo.steps) != len(batched.steps):
        found.append(f"steps {len(solo.steps)} != {len(batched.steps)}")
    for step, (a, b) in enumerate(zip(solo.steps, batched.steps)):
        for name, x, y in zip(("logits", "extra"), a, b):
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                gap = (float((x - y).abs().max()) if x is not None and y is not None
                       and x.shape == y.shape else "shape")
                found.append(f"step {step} {name} differ (max {gap})")
                break
    if solo.tokens != batched.tokens:
        found.append("tokens")
    if solo.nfe != batched.nfe:
        found.append(f"nfe {solo.nfe} != {batched.nfe}")
    if solo.logprobs != batched.logprobs:
        found.append("logprobs")
    return found


def random_others(rng: random.Random, count: int, family: "Family") -> list[tuple]:
    """`count` requests of random prompt length, max_tokens, decoder, cache mode and `n`."""
    decoders, vocab, base, caches = family.decoders, family.vocab, family.base, family.caches
    others = []
    for _ in range(count):
        prompt = [rng.randrange(*vocab) for _ in range(rng.randrange(*family.prompt_len))]
        knobs = dict(base)
        knobs.update(max_tokens=rng.choice(family.max_tokens), decoding=rng.choice(decoders),
                     seed=rng.randrange(1000), n=rng.choice((1, 1, 2)))
        if knobs["decoding"] is None:
            knobs.pop("decoding")
        if caches:
            knobs["kv_cache"] = rng.choice(caches)
        others.append((prompt, SamplingParams(**knobs)))
    return others
