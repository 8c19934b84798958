"""What a benchmark needs to know about the machine and the model: peak matmul rate, FLOPs."""

from __future__ import annotations

import os
import time

import torch

from cover_vllm.flops import FlopModel
from cover_vllm.models.base import ModelDims


PEAK_GEMM_SIZE = 2048     # the square GEMM whose rate is the MFU denominator


def measure_matmul_gflops(dtype: torch.dtype = torch.float32, size: int = PEAK_GEMM_SIZE,
                          seconds: float = 0.5) -> float:
    """Sustained rate of a size³ GEMM in `dtype` with the current torch thread count (the MFU
    denominator of rows in that dtype): the best of repeated timings over about `seconds`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b                                                  # warm-up (and oneDNN's plan)
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        start = time.perf_counter()
        a @ b
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return 2 * size ** 3 / best / 1e9


def pin_threads(model: str, requested: int | None) -> int:
    """Set the torch threads a benchmark of `model` runs with (`requested`, else the engine's
    default for that model and the machine's load) before the peak-rate probe, so the probe
    and the engine use the same count; returns it (pass it on as the engine's num_threads)."""
    from cover_vllm.models.builtin import resolve_model
    from cover_vllm.models.spec import ModelSpec
    from cover_vllm.worker.threads import apply_num_threads

    spec = ModelSpec.from_config(resolve_model(model).config)
    return apply_num_threads(requested, spec.hidden_size)


def machine_info(dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> dict:
    """Cores, threads, torch version and the peak GEMM rate (GFLOP/s) in fp32 and in every
    dtype of `dtypes`, keyed by dtype name."""
    peaks = {}
    for dtype in dict.fromkeys((torch.float32, *dtypes)):
        peaks[dtype_name(dtype)] = round(measure_matmul_gflops(dtype), 1)
    return {"cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "matmul_gflops": peaks}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def step_flops(dims: ModelDims, params_per_token: int, timing: dict) -> float:
    """Model FLOPs of one engine step from its recorded shape (cover_vllm/flops.py)."""
    model = FlopModel(params_per_token, 4 * dims.num_layers * dims.num_heads * dims.head_dim,
                      2 * dims.hidden_size * dims.vocab_size)
    return model.forward(timing["num_tokens"], timing["attn_pairs"], timing["logit_rows"])


def dense_forward_flops(dims: ModelDims, params_per_token: int, length: int) -> float:
    """Model FLOPs of one full forward over `length` tokens with logits on every row (what the
    dense reference loop runs each step)."""
    return step_flops(dims, params_per_token, {"num_tokens": length, "logit_rows": length,
                                               "attn_pairs": length * length})
