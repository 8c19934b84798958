"""Engine: add_request / abort_request / step, and what a driver needs (load, health, shutdown).

A step is schedule (admit, each strategy's plan, pack) -> execute -> decide -> apply (each request
applies its decision and completes or advances its block) -> outputs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from cover_vllm.cache_refresh import parse_cache_refresh
from cover_vllm.config import EngineConfig
from cover_vllm.engine.load import EngineLoad
from cover_vllm.engine.nemotron_runner import CausalSide
from cover_vllm.engine.canvas_decide import (CANVAS_STRUCTURED_REFUSAL, check_decoder,
                                              first_canvases, run_canvas_decoders)
from cover_vllm.engine.observer import StepObserver, StepRecord, StepTimes
from cover_vllm.engine.output_processor import OutputProcessor
from cover_vllm.engine.parallel_sampling import ParentRequest
from cover_vllm.engine.request_hints import RequestHints
from cover_vllm.engine.setup import (check_length, load_tokenizer_if_any,
                                     log_trust_remote_code, prefix_caching, prompt_ids,
                                     request_generator, with_max_tokens)
from cover_vllm.engine.strategy_stage import StrategyStage
from cover_vllm.engine.timing import StepClock
from cover_vllm.executor import make_executor
from cover_vllm.flops import FlopModel, canvas_item_flops, item_shape
from cover_vllm.host_transfer import HostTransfer
from cover_vllm.logger import init_logger
from cover_vllm.models.builtin import resolve_engine_model
from cover_vllm.models.loader import build_model, resolve_dtype
from cover_vllm.models.quantization import (check_quantization, parse_quantization,
                                            quantize_model)
from cover_vllm.models.spec import ModelSpec
from cover_vllm.outputs import RequestOutput
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.scheduler.canvas_request import CanvasRequest
from cover_vllm.scheduler.canvas_table import DecisionWrites
from cover_vllm.scheduler.page_pool import PagePool
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.scheduler.request import Request, block_masked_counts
from cover_vllm.scheduler.scheduler import Scheduler
from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams
from cover_vllm.scheduler.score_request import scoring_request
from cover_vllm.step_plan import RowDecision
from cover_vllm.strategies.canvas import CanvasDecoder
from cover_vllm.structured_output import GrammarBackend
from cover_vllm.worker.memory import plan_memory
from cover_vllm.worker.worker import rank_device

logger = init_logger(__name__)


class Engine:
    def __init__(self, config: EngineConfig):
        resolved = resolve_engine_model(config)     # a hub id is fetched here, once
        if resolved.path is None and config.load_format != "dummy":
            raise ValueError(f"model={resolved.name!r} is a built-in shape without weights; pass "
                             "load_format='dummy' (--load-format dummy) for random weights, or "
                             "a checkpoint directory")
        self.spec = ModelSpec.from_config(resolved.config).with_max_model_len(
            config.max_model_len).with_generation_config(resolved.generation_config())
        if config.trust_remote_code:
            log_trust_remote_code(self.spec.family)
        config = config.with_overrides(decoding=config.decoding or self.spec.default_decoding)
        self.stage = StrategyStage(self.spec, config.decoding)   # fails early on a bad default
        check_decoder(self.stage.strategy(None, None), self.spec, "the engine's decoding")
        self.default_max_tokens = resolved.max_new_tokens()    # None: the checkpoint sets none
        meta = build_model(self.spec, resolve_dtype(config.dtype, self.spec, config.device), "meta")
        self.dims = meta.dims      # the meta build (no storage) sizes memory and counts FLOPs
        self.flop_model = FlopModel.of(meta, meta.dims)
        self.quantization = parse_quantization(config.quantization)   # ValueError names it
        check_quantization(meta, self.quantization, config.tensor_parallel_size)
        quantize_model(meta, self.quantization)                # the plan counts quantized bytes
        self.memory = plan_memory(config, self.spec, meta)     # raises before anything loads
        self.config = config = config.with_overrides(    # the budget travels to every rank
            kv_cache_memory_bytes=self.memory.budget_bytes)   # (the same pages everywhere)
        self.tokenizer_dir = resolved.tokenizer_dir
        self.causal = CausalSide(self, resolved.path)     # Nemotron's decodings and likelihood
        self.tokenizer = load_tokenizer_if_any(self.tokenizer_dir,
                                               required=config.tokenizer is not None)
        if self.tokenizer is None:
            logger.warning("model %r has no tokenizer: prompts must be token ids; outputs carry "
                           "the generated token ids (token_ids) and empty text", resolved.name)
        self.executor = make_executor(config, resolved, self.spec)
        logger.info(self.memory.startup_line())
        self.hints = RequestHints(self.memory.scratch_slots, paged=not self.memory.ring_len)
        self.pool = PagePool(self.executor.num_pages)
        self.scheduler = Scheduler(config, self.pool, self.spec.logit_shift,
                                   prefix_caching=prefix_caching(config, self.spec),
                                   num_rings=self.memory.num_rings)
        self.outputs = OutputProcessor(self.tokenizer, self.spec.eos_token_ids)
        self.refresh_policy = config.refresh_policy
        self._requests: dict[str, Request] = {}
        self._parents: dict[str, ParentRequest] = {}      # n > 1: parent id -> its children
        self._parent_of: dict[str, ParentRequest] = {}    # child id -> its parent
        self._counter = itertools.count()
        self._observers: list[StepObserver] = []
        self._times: StepTimes | None = None
        self._grammar_backend: GrammarBackend | None = None
        self.device = torch.device(rank_device(config.device, 0))   # where the logits live
        self.transfer = HostTransfer()           # the decisions' copy to the host, counted

    # ---- requests --------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer; pass "
                             "{'prompt_token_ids': [...]} instead of a string prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams) -> None:
        """Queue a request (with params.n > 1: n child requests, engine/parallel_sampling.py;
        their outputs come back under `request_id`). Raises ValueError / TypeError for bad
        input, having queued nothing. With LoglikelihoodParams it is a scoring request: the
        prompt is {"context_token_ids", "continuation_token_ids"} or a (context,
        continuation) text pair, and its output a LoglikelihoodOutput (cover_vllm/scoring/)."""
        if request_id in self._requests or request_id in self._parents \
                or self.scheduler.scoring.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already running")
        if self.causal.take(request_id, prompt, params):
            return
        if isinstance(params, LoglikelihoodParams):
            if self.spec.uniform_state:
                raise ValueError(f"{self.spec.family} has no [MASK] token, so the masked "
                                 "likelihood estimator (LoglikelihoodParams) does not apply")
            seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 \
                + next(self._counter)
            self.scheduler.scoring.add(scoring_request(self.spec, self.tokenizer, request_id,
                                                       prompt, params, seed))
            return
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = prompt_ids(prompt, self.spec.vocab_size, self.tokenize)
        params = with_max_tokens(self.spec, len(ids), params)     # None: up to max length
        strategy = self.stage.strategy(params.decoding, params.decoding_params)
        check_decoder(strategy, self.spec, "decoding")
        if isinstance(strategy, CanvasDecoder):
            strategy.check_request(params)
            if params.structured_outputs is not None:
                raise ValueError(CANVAS_STRUCTURED_REFUSAL)
        else:
            strategy.check_steps(params.steps, params.max_tokens)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.spec.vocab_size})")
        check_length(self.spec, self.config, len(ids), params)
        self.hints.check(strategy, params.kv_cache or self.config.kv_cache, len(ids))
        if params.n == 1:
            self._queue([self._request(request_id, text, ids, params, strategy)])
            return
        parent = ParentRequest(request_id, params)
        taken = [c for c in parent.child_ids if c in self._requests or c in self._parents]
        if taken:
            raise ValueError(f"request_id {request_id!r}: its child id {taken[0]!r} is running")
        self._queue([self._request(cid, text, ids, parent.child_params(i), strategy)
                     for i, cid in enumerate(parent.child_ids)])
        self._parents[request_id] = parent
        self._parent_of.update(dict.fromkeys(parent.child_ids, parent))

    def _request(self, request_id: str, text: str | None, ids: list[int],
                 params: SamplingParams, strategy) -> Request:
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + next(
            self._counter)
        generator = request_generator(self.device, seed)
        if isinstance(strategy, CanvasDecoder):
            return CanvasRequest(request_id, text, ids, params, strategy, generator,
                                 self.spec.default_block_length)
        refresh = (self.refresh_policy if params.cache_refresh is None
                   else parse_cache_refresh(params.cache_refresh))
        req = Request(request_id, text, ids, params, strategy, generator,
                      params.kv_cache or self.config.kv_cache, refresh)
        if params.structured_outputs is not None:   # one grammar state per canvas (n > 1)
            req.grammar = self._grammars().new_state(params.structured_outputs, len(ids))
            shortest = req.grammar.close_estimate + 1           # + its end-of-sequence token
            if shortest > params.max_tokens:
                logger.warning("request %s: the shortest value structured_outputs allows takes "
                               "about %d tokens, max_tokens is %d: its output will be cut",
                               request_id, shortest, params.max_tokens)
        return req

    def _queue(self, requests: list[Request]) -> None:
        """Hand requests to the scheduler: all of them, or (it refused one) none."""
        try:
            for req in requests:
                self.scheduler.add_request(req)
                self._requests[req.request_id] = req
        except Exception:
            for req in requests:
                if self._requests.pop(req.request_id, None) is not None:
                    self.scheduler.abort_request(req.request_id)
            raise

    def _grammars(self) -> GrammarBackend:
        """The structured-output compiler, built on the first request that needs it."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer (the grammar is over "
                             "text); this model directory has none")
        if self._grammar_backend is None:
            self._grammar_backend = GrammarBackend(
                self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids,
                forbidden_ids=() if self.spec.uniform_state else (self.spec.mask_token_id,))
        return self._grammar_backend

    def abort_request(self, request_id: str) -> None:
        """Drop a request (a parent, or one of its children: all of them); unknown ids: no-op."""
        if self.causal.abort(request_id) or self.scheduler.scoring.abort(request_id):
            return
        parent = self._parents.get(self._user_id(request_id))
        for rid in parent.child_ids if parent is not None else [request_id]:
            if self.scheduler.abort_request(rid) is not None:
                self._requests.pop(rid, None)
        if parent is not None:
            self._forget(parent)

    def _forget(self, parent: ParentRequest) -> None:
        del self._parents[parent.request_id]
        for rid in parent.child_ids:
            del self._parent_of[rid]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self.scheduler.scoring.has_unfinished() or \
            self.causal.has_unfinished()

    def running_request_ids(self) -> list[str]:
        """The requests (as added: a parent, not its children) in the batch the next step runs
        (admitted, not finished), scoring requests included."""
        ids = [self._user_id(r.request_id)
               for r in (*self.scheduler.running, *self.scheduler.canvases.running)]
        ids += [r.request_id for r in self.scheduler.scoring.running]
        return list(dict.fromkeys(ids))

    def _user_id(self, request_id: str) -> str:
        parent = self._parent_of.get(request_id)
        return request_id if parent is None else parent.request_id

    def load(self) -> EngineLoad:
        scoring, canvases = self.scheduler.scoring, self.scheduler.canvases
        causal_running, causal_waiting = self.causal.counts()
        return EngineLoad(
            len(self.scheduler.running) + len(scoring.running) + len(canvases.running)
            + causal_running,
            len(self.scheduler.waiting) + len(scoring.waiting) + len(canvases.waiting)
            + causal_waiting,
            self.pool.num_used, self.pool.num_pages)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | LoglikelihoodOutput]:
        """One engine step. Returns an output for every request that finished in it
        (`finished=True`; a scoring request's LoglikelihoodOutput) or whose current block became
        FINAL (`finished=False`, partial)."""
        causal = self.causal.step()      # the causal-commit decodings' step (nemotron_runner.py)
        clock = StepClock.observed(self.device, self._observers, self.spec.vocab_size)
        copies, moved = self.transfer.copies, self.transfer.bytes
        out = self.schedule()
        if not out.items and not out.score_items and not out.canvas_items:
            return causal
        clock.lap("schedule")
        self._notify("on_schedule", out)
        clock.start_device()
        result = self.executor.execute_model(out)
        clock.stop_device()                   # observed on CUDA: waits for the forward
        clock.lap("forward")
        self._account(out, result)
        with clock.deciding():                # observed: the decoders' work on the logits
            decisions = self.stage.decide(out, self._requests, result, self._observers,
                                          self.transfer)
            canvas = (run_canvas_decoders(out.canvas_items, self._requests, result,
                                          self.transfer) if out.canvas_items else {})
        clock.lap("strategy")
        outputs = self._apply(out, decisions) + self._apply_canvases(out, canvas)
        if out.score_items:                 # likelihood scoring: fold in the forward's totals
            outputs += self.scheduler.scoring.update(out.score_items, result.scores)
        clock.lap("update")
        if self._observers:
            self._notify("on_step", StepRecord.of(
                clock, result.prepare_s, out,
                host_copies=result.host_copies + self.transfer.copies - copies,
                host_bytes=result.host_bytes + self.transfer.bytes - moved))
        return outputs + causal

    def schedule(self) -> SchedulerOutput:
        """Admit what the pages allow, ask every running request's strategy for its plan
        (seeds, extra rows, embedding edits, cfg), and pack the work items."""
        running = self.scheduler.admit()
        first_canvases(self.scheduler.canvases.take_admitted(), self.device, self.transfer)
        return self.scheduler.pack(running, self.stage.plan(running))

    def _account(self, out: SchedulerOutput, result) -> None:
        """Charge every request the model rows and FLOPs of its own work item, with the
        attention mass it measured on cached positions."""
        masses = result.cached_mass or [None] * len(out.items)
        columns = result.column_mass or [None] * len(out.items)
        for item, mass, column in zip(out.items, masses, columns):
            tokens, pairs, rows = item_shape(item)
            self._requests[item.request_id].charge(
                tokens, self.flop_model.forward(tokens, pairs, rows), mass, column)
        for item in out.canvas_items:
            self._requests[item.request_id].charge(*canvas_item_flops(self.flop_model, item))

    def _apply(self, out: SchedulerOutput,
               decisions: dict[str, RowDecision]) -> list[RequestOutput]:
        """Each request applies its decision; a request whose block became FINAL yields an
        output (finished, or a partial one whose text can never change: streaming sends only
        FINAL text)."""
        reqs = [self._requests[item.request_id] for item in out.items]
        rows = [decisions[req.request_id] for req in reqs]
        writes = None                           # rows outside the table write themselves
        if reqs and all(req.slot is not None for req in reqs):
            writes = DecisionWrites(self.scheduler.table, reqs,
                                    [it.view_start for it in out.items], rows)
        for i, (req, item) in enumerate(zip(reqs, out.items)):
            req.apply_step(item, rows[i], writes and writes.per_request[i])  # counters
        if writes is not None:
            writes.write()                      # every remask, commit, replacement: one write
        events = [(req, req.end_step(row, self.outputs.check_stop, masked))
                  for req, row, masked in zip(reqs, rows, block_masked_counts(reqs))]
        for req in reqs:
            self.scheduler.index_prefix(req)
        return self._report(events)

    def _apply_canvases(self, out: SchedulerOutput, decisions: dict) -> list[RequestOutput]:
        """Each canvas request applies its decision; a stopped canvas yields an output."""
        events = []
        for item in out.canvas_items:
            if item.request_id in decisions:            # else it only encoded this step
                req = self._requests[item.request_id]
                events.append((req, req.finish_step(*decisions[item.request_id],
                                                    self.outputs.check_stop)))
        return self._report(events)

    def _report(self, events: list) -> list[RequestOutput]:
        """Outputs of the requests whose step ended a block / canvas or the request (finished
        ones leave the scheduler); n > 1 children's merged into one per parent."""
        outputs, parents = [], {}
        for req, event in events:
            if event is None:
                continue
            if event != "block":
                self.scheduler.finish(req, event)
                del self._requests[req.request_id]
            parent = self._parent_of.get(req.request_id)
            if parent is None:
                outputs.append(self.outputs.make_output(req))
                continue
            parent.add(self.outputs.make_output(req, parent.index[req.request_id]))
            parents[parent.request_id] = parent
        for parent in parents.values():             # one output per parent and step
            outputs.append(parent.output())
            if parent.finished:
                self._forget(parent)
        return outputs

    # ---- observers -------------------------------------------------------------------------
    def add_observer(self, observer: StepObserver) -> None:
        """Call `observer`'s hooks on every step from now on (engine/observer.py)."""
        self._observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        self._observers.remove(observer)

    def _notify(self, hook: str, *args) -> None:
        for observer in self._observers:
            getattr(observer, hook)(*args)

    @property
    def step_times(self) -> list[dict] | None:
        """Every step's phase timings while recording: set to [] to start, None to stop (a
        StepTimes observer)."""
        return None if self._times is None else self._times.rows

    @step_times.setter
    def step_times(self, rows: list[dict] | None) -> None:
        if self._times is not None:
            self.remove_observer(self._times)
        self._times = None if rows is None else StepTimes(rows)
        if self._times is not None:
            self.add_observer(self._times)

    def peak_memory_bytes(self) -> list[int]:
        """Peak resident memory (VmHWM) per tensor-parallel rank, the driver's first."""
        return self.executor.peak_memory_bytes()

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    # ---- life cycle ------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise the executor's error (cover_vllm.executor.ExecutorError) if it can no longer
        run forwards, e.g. a tensor-parallel worker died."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's worker processes (idempotent; an in-process engine has none)."""
        self.executor.shutdown()
