"""Engine: add_request / abort_request / step; a step is schedule -> execute -> decide -> update."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from cover_vllm.cache_refresh import parse_cache_refresh
from cover_vllm.config import EngineConfig
from cover_vllm.engine.decide import run_strategies
from cover_vllm.engine.timing import StepClock
from cover_vllm.engine.output_processor import OutputProcessor
from cover_vllm.executor import make_executor
from cover_vllm.flops import FlopModel, item_shape
from cover_vllm.logger import init_logger
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.loader import build_model, resolve_dtype
from cover_vllm.models.spec import ModelSpec
from cover_vllm.outputs import RequestOutput
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.scheduler.page_pool import PagePool
from cover_vllm.scheduler.request import Request
from cover_vllm.scheduler.scheduler import Scheduler
from cover_vllm.strategies import Strategy, make_params, strategy_class
from cover_vllm.worker.memory import plan_memory

logger = init_logger(__name__)


def _load_tokenizer(path):
    if path is None:
        return None
    from cover_vllm.tokenizer import has_tokenizer, load_tokenizer

    return load_tokenizer(path) if has_tokenizer(path) else None


class Engine:
    def __init__(self, config: EngineConfig):
        resolved = resolve_model(config.model)
        if resolved.path is None and config.load_format != "dummy":
            raise ValueError(f"model={resolved.name!r} is a built-in shape without weights; pass "
                             "load_format='dummy' (--load-format dummy) for random weights, or "
                             "a checkpoint directory")
        self.spec = ModelSpec.from_config(resolved.config)
        strategy_class(config.decoding)                        # fail early on a bad default
        self.default_max_tokens = resolved.max_new_tokens()    # None: the checkpoint sets none
        # one meta build (all heads, no storage) sizes memory before loading and counts FLOPs
        meta = build_model(self.spec, resolve_dtype(config.dtype, self.spec, config.device), "meta")
        self.memory = plan_memory(config, self.spec, meta)     # raises before anything loads
        self.flop_model = FlopModel.of(meta, meta.dims)
        # the resolved KV budget travels to every rank (the same page count everywhere)
        self.config = config = config.with_overrides(kv_cache_memory_bytes=self.memory.kv_bytes)
        self.tokenizer = _load_tokenizer(resolved.path)
        if self.tokenizer is None:
            logger.warning("model %r has no tokenizer: prompts must be token ids and outputs "
                           "carry token ids only (text is empty)", resolved.name)
        self.executor = make_executor(config, resolved, self.spec)
        logger.info(self.memory.startup_line())
        self.pool = PagePool(self.executor.num_pages)
        self.scheduler = Scheduler(config, self.pool, self.spec.logit_shift)
        self.outputs = OutputProcessor(self.tokenizer, self.spec.eos_token_ids)
        self.refresh_policy = config.refresh_policy
        self._strategies: dict[tuple[str, Any], Strategy] = {}
        self._requests: dict[str, Request] = {}
        self._counter = itertools.count()
        self.step_times: list[dict] | None = None    # set to [] to record per-phase timings

    # ---- requests --------------------------------------------------------------------------
    def _strategy(self, params: SamplingParams) -> Strategy:
        name = params.decoding or self.config.decoding
        typed = make_params(name, params.decoding_params)
        key = (name, typed)
        if key not in self._strategies:
            self._strategies[key] = strategy_class(name)(typed, self.spec)
        return self._strategies[key]

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer; pass "
                             "{'prompt_token_ids': [...]} instead of a string prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt)
        strategy = self._strategy(params)
        strategy.check_steps(params.steps, params.max_tokens)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.spec.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.spec.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{total} exceeds the model's max length {self.spec.max_model_len}")
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + next(
            self._counter)
        generator = torch.Generator().manual_seed(seed)
        refresh = (self.refresh_policy if params.cache_refresh is None
                   else parse_cache_refresh(params.cache_refresh))
        req = Request(request_id, text, ids, params, strategy, generator,
                      params.kv_cache or self.config.kv_cache, refresh)
        self.scheduler.add_request(req)
        self._requests[request_id] = req

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs the key 'prompt_token_ids'")
            prompt = prompt["prompt_token_ids"]
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError("prompt must be a string, a list of token ids, or "
                            "{'prompt_token_ids': [int, ...]}")
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside [0, {self.spec.vocab_size})")
        return None, list(prompt)

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.abort_request(request_id)
        if req is not None:
            req.finish_reason = "abort"
            self._requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. Returns an output for every request that finished in it
        (`finished=True`) or whose current block became FINAL (`finished=False`, partial)."""
        clock = StepClock()
        out = self.scheduler.schedule()
        if not out.items:
            return []
        clock.lap("schedule")
        result = self.executor.execute_model(out)
        clock.lap("forward")
        self._account(out, result)
        decisions = run_strategies(out, self._requests, result)
        clock.lap("strategy")
        finished = self._update(out, decisions)
        clock.lap("update")
        if self.step_times is not None:
            timing = clock.laps
            timing["prepare"] = result.prepare_s
            timing["forward"] -= result.prepare_s
            shapes = [item_shape(i) for i in out.items]       # cover_vllm/flops.py
            timing["num_tokens"] = sum(t for t, _, _ in shapes)
            timing["num_seqs"] = len(out.items)
            timing["num_refresh"] = sum(i.is_refresh for i in out.items)
            timing["attn_pairs"] = sum(p for _, p, _ in shapes)
            timing["logit_rows"] = sum(r for _, _, r in shapes)
            self.step_times.append(timing)
        return finished

    def _account(self, out, result) -> None:
        """Charge every request the model rows and FLOPs of its own work item; hand the
        measured attention mass on cached positions to its refresh policy."""
        masses = result.cached_mass or [None] * len(out.items)
        columns = result.column_mass or [None] * len(out.items)
        for item, mass, column in zip(out.items, masses, columns):
            tokens, pairs, rows = item_shape(item)
            req = self._requests[item.request_id]
            req.metrics.forward_tokens += tokens
            req.metrics.flops += self.flop_model.forward(tokens, pairs, rows)
            if mass is not None:
                req.refresh.cached_mass, req.refresh.column_mass = mass, column

    def _update(self, out, decisions) -> list[RequestOutput]:
        """Apply decisions; a request whose block became FINAL yields an output (finished or a
        partial one whose text can never change: streaming sends only FINAL text)."""
        outputs = []
        for req in self.scheduler.update_from_output(out, decisions):
            last = req.block_idx + 1 == len(req.blocks)
            if req.strategy.revises_done_blocks and not last:
                req.block_idx += 1                   # nothing is FINAL before the request ends
                req.begin_block()
                continue
            req.final_end = req.block[1]
            reason = self.outputs.check_stop(req)
            if reason is None and last:
                reason = "length"
            if reason is None:
                req.block_idx += 1
                req.begin_block()
                outputs.append(self.outputs.make_output(req))
                continue
            self.scheduler.finish(req, reason)
            self._requests.pop(req.request_id)
            outputs.append(self.outputs.make_output(req))
        return outputs

    def peak_memory_bytes(self) -> list[int]:
        """Peak resident memory (VmHWM) per tensor-parallel rank, the driver (this process)
        first."""
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
