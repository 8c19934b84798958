"""Executors: how a SchedulerOutput reaches the model — in-process (`Worker`) or tensor-parallel
(`TPExecutor` over "mp" processes or "ray" actors); `make_executor` picks one from the config."""

from __future__ import annotations

from cover_vllm.config import EngineConfig
from cover_vllm.executor.base import ExecutorError, WorkerDiedError
from cover_vllm.models.builtin import ResolvedModel
from cover_vllm.models.spec import ModelSpec


def make_executor(config: EngineConfig, resolved: ResolvedModel, spec: ModelSpec):
    """tensor_parallel_size=1 runs in-process whatever the backend (the driver is the only
    rank); more ranks use "mp" (also the default) or "ray"."""
    from cover_vllm.worker.worker import Worker

    backend = config.distributed_executor_backend
    if config.tensor_parallel_size == 1:
        return Worker(config, resolved, spec)
    if backend == "uni":
        raise ValueError("distributed_executor_backend='uni' runs a single process, so "
                         f"tensor_parallel_size must be 1 (got {config.tensor_parallel_size}); "
                         "use 'mp' or 'ray'")
    from cover_vllm.executor.tp_executor import TPExecutor

    if backend == "ray":
        from cover_vllm.executor.ray_ranks import RayRanks, ray_module

        ray_module()                                 # a clear ImportError before anything
        return TPExecutor(config, resolved, spec, RayRanks())
    from cover_vllm.executor.mp_ranks import MPRanks

    return TPExecutor(config, resolved, spec, MPRanks())


__all__ = ["ExecutorError", "WorkerDiedError", "make_executor"]
