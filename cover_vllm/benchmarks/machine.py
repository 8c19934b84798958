"""What a benchmark needs to know about the machine and the model: peak matmul rate, FLOPs."""

from __future__ import annotations

import os
import time

import torch

from cover_vllm.flops import FlopModel
from cover_vllm.models.base import ModelDims
from cover_vllm.models.quant_format import QuantConfig


PEAK_GEMM_SIZE = 2048     # the square GEMM whose rate is the MFU denominator
STREAM_BYTES = 256 << 20  # the tensor read by the bandwidth probe: well past any cache


def measure_matmul_gflops(dtype: torch.dtype = torch.float32, size: int = PEAK_GEMM_SIZE,
                          seconds: float = 0.5) -> float:
    """Sustained rate of a size³ GEMM in `dtype` with the current torch thread count (the MFU
    denominator of rows in that dtype): the best of repeated timings over about `seconds`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size ** 3 / _best_seconds(lambda: a @ b, seconds) / 1e9


def measure_int8_gops(size: int = PEAK_GEMM_SIZE, seconds: float = 0.5) -> float | None:
    """Sustained rate (GOP/s, 2 per multiply-accumulate) of W8A8's int8 GEMM, size³, codes
    already quantized (models/w8a8_kernels.py `OnednnKernel.matmul_codes`): the MFU
    denominator of W8A8 rows. None where oneDNN's int8 ops are unusable."""
    from cover_vllm.models.w8a8_kernels import OnednnKernel, onednn_problem

    if onednn_problem() is not None:
        return None
    q = torch.randint(-127, 128, (size, size), dtype=torch.int8)
    codes = torch.randint(1, 256, (size, size), dtype=torch.uint8)
    kernel = OnednnKernel(q, torch.ones(size), None)
    return 2 * size ** 3 / _best_seconds(lambda: kernel.matmul_codes(codes, kernel.w_scale),
                                         seconds) / 1e9


def _best_seconds(fn, seconds: float) -> float:
    fn()                                                   # warm-up (and oneDNN's plan)
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def measure_read_gbps(nbytes: int = STREAM_BYTES, seconds: float = 0.5) -> float:
    """Sustained memory read rate (GB/s): the best of repeated fp32 sums over `nbytes`, with
    the current torch thread count. A forward streams every weight once, so at small batches
    this, not the GEMM peak, bounds the step (`mfu_bound`)."""
    x = torch.ones(nbytes // 4)
    return nbytes / _best_seconds(x.sum, seconds) / 1e9


def mfu_bound(flops: float, weight_bytes: float, peak_gflops: float, read_gbps: float) -> float:
    """The highest MFU a run that spent `flops` while streaming `weight_bytes` of weights can
    reach on this machine (the roofline): its arithmetic intensity times the read rate, over
    the GEMM peak, capped at 1."""
    if weight_bytes <= 0:
        return 1.0
    return min(1.0, flops / weight_bytes * read_gbps / peak_gflops)


def forward_weight_bytes(model: FlopModel, dtype: torch.dtype,
                         quantization: QuantConfig | None = None) -> float:
    """Bytes of weights one forward reads: every matrix a token multiplies through and the LM
    head (the embedding table is only gathered from), as stored: `quantization`'s codes and
    scales (models/quant_format.py) for the quantized projections."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    body = head = float(itemsize)
    if quantization is not None:
        body = quantization.bytes_per_weight(itemsize)
        head = body if quantization.lm_head else head
    return model.params_per_token * body + model.head_per_row // 2 * head


def pin_threads(model: str, requested: int | None) -> int:
    """Set the torch threads a benchmark of `model` runs with (`requested`, else the engine's
    default for that model and the machine's load) before the peak-rate probe, so the probe
    and the engine use the same count; returns it (pass it on as the engine's num_threads)."""
    from cover_vllm.models.builtin import resolve_model
    from cover_vllm.models.spec import ModelSpec
    from cover_vllm.worker.threads import apply_num_threads

    spec = ModelSpec.from_config(resolve_model(model).config)
    return apply_num_threads(requested, spec.hidden_size)


def machine_info(dtypes: tuple[torch.dtype, ...] = (torch.float32,),
                 read_rate: bool = True, int8: bool = False) -> dict:
    """Cores, threads, torch version, the peak GEMM rate (GFLOP/s) in fp32 and in every dtype
    of `dtypes`, keyed by dtype name (`int8`: also W8A8's int8 GEMM, GOP/s, key "int8"), and
    the memory read rate (GB/s; `read_rate=False` skips its 256 MiB probe, e.g. where peak
    memory is being measured)."""
    peaks = {}
    for dtype in dict.fromkeys((torch.float32, *dtypes)):
        peaks[dtype_name(dtype)] = round(measure_matmul_gflops(dtype), 1)
    if int8 and (rate := measure_int8_gops()) is not None:
        peaks["int8"] = round(rate, 1)
    return {"cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "matmul_gflops": peaks,
            "read_gbps": round(measure_read_gbps(), 1) if read_rate else None}


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
