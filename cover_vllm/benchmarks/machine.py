"""What a benchmark needs to know about the machine and the model: the peak matmul rate and
memory rate of the device the model runs on, and FLOPs.

On the CPU the probes time on the host clock; on CUDA they time the device's own work with CUDA
events (a bench that divided CUDA work by the CPU's peaks printed MFU 3,237 %, issue #42). A
share of a peak above 100 % means the peak or the FLOP count is wrong: `utilization` warns,
naming both numbers, and never clamps.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from cover_vllm.device_check import check_device
from cover_vllm.flops import FlopModel
from cover_vllm.layers.base import ModelDims
from cover_vllm.layers.quantization.format import QuantConfig
from cover_vllm.logger import init_logger

logger = init_logger(__name__)

PEAK_GEMM_SIZE = 2048     # the square GEMM whose rate is the MFU denominator (CPU)
CUDA_GEMM_SIZE = 8192     # on CUDA: ~1 ms of bf16 work, so launch gaps do not count
STREAM_BYTES = 256 << 20  # the tensor read by the bandwidth probe: well past any cache
CUDA_COPY_BYTES = 1 << 30  # the buffer a CUDA copy probe moves: well past L2


def probe_device(device: str | torch.device) -> torch.device:
    """Where the probes run for a model on `device`: CUDA on CUDA, the CPU otherwise (the
    shapes-only "meta" device included: its rows report no rates)."""
    device = torch.device(device)
    return device if device.type == "cuda" else torch.device("cpu")


def _on(device: torch.device):
    """CUDA: `device` made current, so the probe's events and kernels share its stream; else a
    no-op."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(torch.cuda.current_device() if device.index is None else device)


def gemm_size(device: str | torch.device = "cpu") -> int:
    """The side of the square GEMM the peak probe times on `device`."""
    return CUDA_GEMM_SIZE if probe_device(device).type == "cuda" else PEAK_GEMM_SIZE


def measure_matmul_gflops(dtype: torch.dtype = torch.float32, size: int | None = None,
                          seconds: float = 0.5, device: str | torch.device = "cpu") -> float:
    """Sustained rate of a size³ GEMM in `dtype` on `device` (the MFU denominator of rows in
    that dtype) with the current torch thread count (CPU) or matmul precision settings (CUDA):
    the best of repeated timings over about `seconds`."""
    device = probe_device(device)
    size = size or gemm_size(device)
    with _on(device):
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        return 2 * size ** 3 / _best_seconds(lambda: a @ b, seconds, device) / 1e9


def measure_int8_gops(size: int | None = None, seconds: float = 0.5,
                      device: str | torch.device = "cpu") -> float | None:
    """Sustained rate (GOP/s, 2 per multiply-accumulate) of W8A8's int8 GEMM, size³, codes
    already quantized: the MFU denominator of W8A8 rows. On the CPU oneDNN's kernel
    (layers/quantization/w8a8_kernels.py `OnednnKernel.matmul_codes`; None where it is unusable),
    on CUDA `torch._int_mm` (the `IntMMKernel` the engine runs there)."""
    device = probe_device(device)
    size = size or gemm_size(device)
    if device.type == "cuda":
        with _on(device):
            a = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=device)
            b = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=device)
            return 2 * size ** 3 / _best_seconds(lambda: torch._int_mm(a, b), seconds,
                                                 device) / 1e9
    from cover_vllm.layers.quantization.w8a8_kernels import OnednnKernel, onednn_problem

    if onednn_problem() is not None:
        return None
    q = torch.randint(-127, 128, (size, size), dtype=torch.int8)
    codes = torch.randint(1, 256, (size, size), dtype=torch.uint8)
    kernel = OnednnKernel(q, torch.ones(size), None)
    return 2 * size ** 3 / _best_seconds(lambda: kernel.matmul_codes(codes, kernel.w_scale),
                                         seconds) / 1e9


def host_seconds(fn) -> float:
    """Wall seconds of `fn()` on the host clock (CPU work is done when it returns)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cuda_seconds(fn) -> float:
    """Seconds the current CUDA stream took for the work `fn()` queued: CUDA events recorded
    around it, read after the end event completed (the device's clock, not the host's)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _best_seconds(fn, seconds: float, device: torch.device = torch.device("cpu")) -> float:
    timed = cuda_seconds if device.type == "cuda" else host_seconds
    timed(fn)                                              # warm-up (and oneDNN's plan)
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        took = timed(fn)
        best, spent = min(best, took), spent + took
    return best


def measure_read_gbps(nbytes: int | None = None, seconds: float = 0.5,
                      device: str | torch.device = "cpu") -> float:
    """Sustained memory rate (GB/s) of `device`, the MBU denominator. CPU: the best of repeated
    fp32 sums over `nbytes` with the current torch thread count (bytes read). CUDA: the best
    device-to-device copy of `nbytes` (bytes read plus bytes written: a copy's full traffic, the
    rate a streaming read approaches). A forward streams every weight once, so at small
    batches this, not the GEMM peak, bounds the step (`mfu_bound`)."""
    device = probe_device(device)
    if device.type == "cuda":
        nbytes = nbytes or CUDA_COPY_BYTES
        with _on(device):
            src = torch.ones(nbytes // 4, device=device)
            dst = torch.empty_like(src)
            return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), seconds, device) / 1e9
    nbytes = nbytes or STREAM_BYTES
    x = torch.ones(nbytes // 4)
    return nbytes / _best_seconds(x.sum, seconds) / 1e9


def utilization(rate: float, peak: float, what: str) -> float:
    """`rate` / `peak` (both in the same unit). Above 1 it is a bug in the peak (measured on
    another device, or under other settings) or in the count: warn, naming both, and return
    it unclamped."""
    share = rate / peak
    if share > 1.0:
        logger.warning("%s %.1f%% > 100%%: %.4g measured against a peak of %.4g; the peak or "
                       "the count is wrong", what, 100 * share, rate, peak)
    return share


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
    scales (layers/quantization/format.py) for the quantized projections."""
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


def machine_info(dtypes: tuple[torch.dtype, ...] = (torch.float32,), read_rate: bool = True,
                 int8: bool = False, device: str | torch.device = "cpu") -> dict:
    """The peaks of the device a model on `device` runs on (`probe_device`): its name, the
    GEMM side probed, the peak GEMM rate (GFLOP/s) in fp32 and in every dtype of `dtypes`,
    keyed by dtype name (`int8`: also W8A8's int8 GEMM, GOP/s, key "int8"), and the memory
    rate (GB/s; `read_rate=False` skips its probe, e.g. where peak memory is being measured);
    with cores, torch threads and torch version. ValueError in one line for a device this
    process cannot use (CUDA on a CPU-only torch)."""
    check_device(device)
    device = probe_device(device)
    peaks = {}
    for dtype in dict.fromkeys((torch.float32, *dtypes)):
        peaks[dtype_name(dtype)] = round(measure_matmul_gflops(dtype, device=device), 1)
    if int8 and (rate := measure_int8_gops(device=device)) is not None:
        peaks["int8"] = round(rate, 1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "gemm_size": gemm_size(device), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "matmul_gflops": peaks,
            "read_gbps": round(measure_read_gbps(device=device), 1) if read_rate else None}


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
