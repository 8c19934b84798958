"""Worker: owns the model weights, the KV cache and the model runner on one device."""

from __future__ import annotations

import torch

from cover_vllm.attention import get_backend
from cover_vllm.config import EngineConfig
from cover_vllm.models.builtin import ResolvedModel
from cover_vllm.models.loader import instantiate, resolve_dtype
from cover_vllm.models.spec import ModelSpec
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.worker.kv_cache import KVCache, kv_bytes_per_token
from cover_vllm.worker.model_runner import ModelRunner, ModelRunnerOutput


class Worker:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, spec: ModelSpec):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype = resolve_dtype(config.dtype, spec, config.device)
        self.model = model = instantiate(resolved, spec, dtype, config.load_format, config.seed,
                                         config.device)
        per_token = kv_bytes_per_token(model.dims, dtype)
        budget = config.kv_budget_bytes(per_token, spec.max_model_len)
        num_pages = max(1, budget // (per_token * config.page_size))
        self.cache = KVCache(model.dims, num_pages, config.page_size, dtype, config.device)
        self.runner = ModelRunner(self.model, get_backend(config.attention_backend), self.cache)

    @property
    def num_pages(self) -> int:
        return self.cache.num_pages

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(out)
