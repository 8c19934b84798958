"""The runner of Nemotron-Labs-Diffusion's own decodings (`nemotron`, `ar`, `linear_spec`;
strategies/nemotron.py): continuous batching over a slot KV cache (models/nemotron_cache.py).

Each step forwards one piece of every running request in one batch (a prefill, a diffusion
step, a block's causal commit, an AR token, a draft or a verify, mixed), decides every request's
picks at once on the logits' device with one copy to the host (strategies/nemotron_decide.py),
hands each request its share, and admits waiting requests into freed slots (at most
`max_num_seqs` run). A request's tokens do not depend on the batch: its pieces see only its own
cache slot.

It reuses the engine's loaded model (the same weights, dtype and device) and is driven by
the engine (`Engine.add_request` / `step` / `abort_request`), so `LLM`, the server and the
benchmarks reach it like any decoder. Its slots are pages of the engine's own pool; its forward
goes through the engine's executor (`executor.run_pieces`), so under tensor parallelism every
rank runs its shard of it over the same pages (executor/tp_executor.py, #50).
"""

from __future__ import annotations

import time
import weakref
from collections import deque

import torch

from cover_vllm.engine.setup import prompt_ids
from cover_vllm.engine.setup import prefix_caching
from cover_vllm.engine.nemotron_scoring import causal_loglikelihood, check_scoring
from cover_vllm.scoring.params import LoglikelihoodParams
from cover_vllm.models.nemotron_cache import PagedSlots, SlotCache, causal_page_keys
from cover_vllm.outputs import CompletionOutput, RequestOutput, RequestMetrics
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.strategies import make_params
from cover_vllm.strategies.nemotron import LOOPS, Job, Loop
from cover_vllm.strategies.nemotron_decide import decide

CAUSAL_DECODINGS = tuple(LOOPS)


class NemotronRunner:
    """`generate(requests)` for requests whose decoding is one of CAUSAL_DECODINGS."""

    def __init__(self, engine, model_path=None):
        self.engine, self.spec = engine, engine.spec
        self.model = engine.executor.model              # the driver's (a shard under TP)
        # forward(cache, pieces) -> logits: in-process, or on every tensor-parallel rank
        self.forward = engine.executor.run_pieces
        param = next(self.model.parameters())
        dims = self.model.dims
        # the engine's own pages: one KV budget, admission by free pages
        self.cache = PagedSlots(engine.executor.cache, engine.pool, engine.config.page_size)
        # likelihood forwards write nothing: an empty slot of a tiny standalone cache
        self.scratch = SlotCache(dims.num_layers, dims.num_kv_heads, dims.head_dim,
                                 param.dtype, param.device)
        self.max_num_seqs = engine.config.max_num_seqs
        self.waiting: deque[tuple[str, str | None, Loop]] = deque()
        self.running: list[tuple[str, str | None, Loop]] = []
        self._known: set[str] = set()
        self.scoring: list[tuple] = []                   # (request id, pair, params)
        # the checkpoint's PEFT draft adapter (linear_spec_lora/), on for draft rows only
        self.adapter = engine.executor.draft_adapter(model_path)
        self.prefix_caching = prefix_caching(engine.config, self.spec)

    def make_loop(self, prompt, params: SamplingParams, default: str) -> tuple[str | None, Loop]:
        """The state machine of one request (ValueError / TypeError for bad input)."""
        name = params.decoding or default
        _refuse_unsupported(name, params)
        text, ids = prompt_ids(prompt, self.spec.vocab_size, self.engine.tokenize)
        knobs = make_params(name, params.decoding_params)
        block = params.block_length or self.spec.default_block_length
        if params.max_tokens < 1 or block < 1:
            raise ValueError("max_tokens and block_length must be >= 1")
        if len(ids) + params.max_tokens + 2 * block > self.spec.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"+ two blocks exceed max_model_len={self.spec.max_model_len}")
        seed = params.seed if params.seed is not None else self.engine.config.seed
        eos = () if params.ignore_eos else self.spec.eos_token_ids
        job = Job(ids, params.max_tokens, block, self.spec.mask_token_id,
                  tuple(eos) + tuple(params.stop_token_ids or ()), params.temperature, seed)
        return text, LOOPS[name](job, knobs)

    def add(self, request_id: str, text: str | None, loop: Loop) -> None:
        """Queue a request (built by `make_loop`)."""
        if request_id in self._known:
            raise ValueError(f"request_id {request_id!r} is already running")
        need = self.cache.pages_for(loop.capacity())
        self.engine.pool.check_fits(f"request {request_id!r}", need,
                                    f"a {loop.capacity()}-token cache", "lower max_tokens")
        loop.arrival = time.perf_counter()
        self._known.add(request_id)
        self.waiting.append((request_id, text, loop))

    def abort(self, request_id: str) -> bool:
        """Drop a request; whether it was one of this runner's."""
        if request_id not in self._known:
            return False
        self._known.discard(request_id)
        self.waiting = deque(r for r in self.waiting if r[0] != request_id)
        self.scoring = [r for r in self.scoring if r[0] != request_id]
        for item in [r for r in self.running if r[0] == request_id]:
            self.cache.release(item[2].slot)
            self.running.remove(item)
        return True

    def score(self, request_id: str, prompt, params) -> None:
        """Queue a likelihood request: scored by one causal forward in the next step
        (engine/nemotron_scoring.py)."""
        if request_id in self._known:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not isinstance(params, LoglikelihoodParams):
            raise TypeError("params must be LoglikelihoodParams")
        check_scoring(self, prompt, params)              # ValueError now, nothing queued
        self._known.add(request_id)
        self.scoring.append((request_id, prompt, params))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.scoring)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests into free slots, forward one piece of every running request
        in one batch, and return the outputs of those that finished."""
        scored = []
        if self.scoring:
            batch, self.scoring = self.scoring[:self.max_num_seqs], self.scoring[self.max_num_seqs:]
            scored = causal_loglikelihood(self, [p for _, p, _ in batch],
                                          [q for _, _, q in batch], [r for r, _, _ in batch])
            self._known.difference_update(r for r, _, _ in batch)
        while self.waiting and len(self.running) < self.max_num_seqs:
            item = self.waiting[0]
            loop = item[2]
            keys = (causal_page_keys(loop.job.prompt, self.cache.page_size)
                    if self.prefix_caching and loop.causal_prefill else [])
            slot = self.cache.allocate(loop.capacity(), keys)
            if slot is None:
                break                           # FCFS: wait for pages to free up
            self.waiting.popleft()
            loop.slot, loop.cached = slot, self.cache.cached[slot]
            self.cache.lengths[slot] = loop.cached
            self.running.append(item)
        if not self.running:
            return scored
        logits = self.forward(self.cache, [r[2].next_piece() for r in self.running])
        picks = decide(logits, [r[2] for r in self.running], self.engine.transfer)
        still, finished = [], []
        for item, pick in zip(self.running, picks):
            loop = item[2]
            loop.absorb(pick.tokens, pick.confidence, self.cache)
            if self.prefix_caching and loop.causal_prefill and not loop.indexed \
                    and self.cache.lengths[loop.slot] >= len(loop.job.prompt):
                self.cache.index(loop.slot, causal_page_keys(loop.job.prompt,
                                                             self.cache.page_size))
                loop.indexed = True
            if loop.finished:
                self.cache.release(loop.slot)
                self._known.discard(item[0])
                finished.append(self._output(item, time.perf_counter() - loop.arrival))
            else:
                still.append(item)
        self.running = still
        return scored + finished

    def generate(self, requests: list[tuple[str, str | None, Loop]]) -> list[RequestOutput]:
        """Run (request id, prompt text, loop) to completion; outputs in the given order."""
        for item in requests:
            self.add(*item)
        done = {}
        while self.has_unfinished():
            done.update((o.request_id, o) for o in self.step())
        return [done[rid] for rid, _, _ in requests]

    def _output(self, item: tuple[str, str | None, Loop], latency: float) -> RequestOutput:
        rid, text, loop = item
        tokens = loop.output()
        tok = self.engine.tokenizer
        out_text = tok.decode(tokens, skip_special_tokens=True) if tok is not None else ""
        metrics = RequestMetrics(nfe=loop.nfe, steps=loop.nfe, decoded_tokens=len(tokens),
                                 tokens_per_step=len(tokens) / max(loop.nfe, 1),
                                 latency_s=latency, cached_prompt_tokens=loop.cached,
                                 prefix_query_tokens=len(loop.job.prompt) if
                                 self.prefix_caching and loop.causal_prefill else 0)
        if loop.accepted:
            metrics.accepted_tokens = sum(loop.accepted)
            metrics.verifies = len(loop.accepted)
        reason = "stop" if loop.stopped else "length"
        return RequestOutput(rid, text, list(loop.job.prompt),
                             [CompletionOutput(0, out_text, tokens, reason)], True, metrics)


def _refuse_unsupported(name: str, params: SamplingParams) -> None:
    """ValueError naming a SamplingParams field these decodings do not honour (rather than
    ignoring it)."""
    if params.structured_outputs is not None:
        raise ValueError(
            f"structured_outputs is not supported with decoding={name!r}: its blocks (or "
            "speculative drafts) fill several positions per forward and commit them causally, "
            "so a grammar would have to be enforced inside the official unmasking and "
            "acceptance rules, which changes their tokens; generate unconstrained and validate")
    unsupported = {"n > 1": params.n != 1, "logprobs": params.logprobs is not None,
                   "stop (strings)": bool(params.stop),
                   "min_tokens": params.min_tokens > 0,
                   "steps (a block takes at most block_length forwards)": params.steps is not None,
                   "top_p / top_k / min_p": (params.top_p, params.top_k, params.min_p)
                   != (1.0, -1, 0.0),
                   "penalties": (params.presence_penalty, params.frequency_penalty,
                                 params.repetition_penalty) != (0.0, 0.0, 1.0)}
    given = [k for k, v in unsupported.items() if v]
    if given:
        raise ValueError(f"decoding={name!r} does not support {', '.join(given)} yet; use "
                         "stop_token_ids, or a masked-diffusion decoder")


class CausalSide:
    """The engine's side door to the runner (`Engine.causal`): takes the requests whose
    decoding is one of CAUSAL_DECODINGS, and likelihood requests on a causal-commit model;
    builds the runner on first use, so other models never pay for it."""

    def __init__(self, engine, model_path):
        # a proxy: the engine owns this side, and a strong reference back would be a cycle that
        # keeps the engine (weights, KV pool) alive after `del llm` until a full collection
        self.engine, self.model_path = weakref.proxy(engine), model_path
        self.runner: NemotronRunner | None = None

    def take(self, request_id: str, prompt, params) -> bool:
        """Queue the request here when it is this side's (True), else leave it (False)."""
        engine = self.engine
        if isinstance(params, LoglikelihoodParams) and engine.spec.attention.causal_commit:
            self._runner().score(request_id, prompt, params)        # exact, causal
            return True
        if not isinstance(params, SamplingParams) or \
                (params.decoding or engine.config.decoding) not in CAUSAL_DECODINGS:
            return False
        runner = self._runner()
        runner.add(request_id, *runner.make_loop(prompt, params, engine.config.decoding))
        return True

    def _runner(self) -> NemotronRunner:
        if self.runner is None:
            self.runner = NemotronRunner(self.engine, self.model_path)
        return self.runner

    def abort(self, request_id: str) -> bool:
        return self.runner is not None and self.runner.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.runner is not None and self.runner.has_unfinished()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests, for Engine.load()."""
        if self.runner is None:
            return 0, 0
        return len(self.runner.running), len(self.runner.waiting) + len(self.runner.scoring)

    def step(self) -> list:
        return self.runner.step() if self.has_unfinished() else []
