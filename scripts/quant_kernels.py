"""Which quantized kernel to run on this CPU: time every candidate on LLaDA-8B's projection
shapes (each matrix far larger than the caches, so the weight streams from memory on every
call) at a batch-1 dual-cache window (32 rows) and at batch 8 (256 rows).

    .venv/bin/python scripts/quant_kernels.py [--rows 32,256] [--threads 1] [--torchao]

Candidates: the bf16 / fp32 GEMM the engine runs unquantized (bf16 prepacked for oneDNN, as
`FusedLinears.pack` does), torch's packed weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`), the dequantize-per-call formula `F.linear(x, q.to(dtype)) * s`,
W8A8 (int8 weights x int8 activations quantized per row inside the call: oneDNN's u8 x s8
`qlinear_pointwise` with and without the input rotation w8a8 runs, and `torch._int_mm`,
w8a8_kernels.py), and (--torchao, if importable)
torchao's Int8/Int4WeightOnlyConfig on an nn.Linear. Prints ms per call, the weight bytes
read per second and the multiply-accumulate rate (GOP/s, 2 ops a MAC).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cover_vllm.layers.quantization.format import QuantConfig, quantize_rows, rotation_block
from cover_vllm.layers.quantization.kernels import Int4CpuKernel, Int8Kernel, TiledKernel
from cover_vllm.layers.quantization.w8a8_kernels import IntMMKernel, OnednnKernel

SHAPES = {"qkv": (12288, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "head": (126464, 4096)}


def best_ms(fn, seconds: float = 1.0) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best * 1e3


def candidates(w: torch.Tensor, dtype: torch.dtype, use_torchao: bool, slow: bool) -> dict:
    """name -> (weight bytes, callable of x)."""
    wd = w.to(dtype)
    out = {f"{dtype_name(dtype)} F.linear": (wd.numel() * wd.element_size(),
                                             lambda x: F.linear(x, wd))}
    if dtype == torch.bfloat16:
        packed = torch.ops.mkldnn._reorder_linear_weight(wd, None)
        out["bf16 oneDNN packed"] = (wd.numel() * 2, lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""))
    q8 = quantize_rows(w, QuantConfig("int8"), dtype)
    n8 = sum(t.numel() * t.element_size() for t in q8.values())
    if dtype == torch.bfloat16 or slow:
        out["int8 _weight_int8pack_mm"] = (n8, Int8Kernel(q8, None))
    out["int8 dequant F.linear"] = (n8, lambda x: F.linear(x, q8["qweight"].to(dtype))
                                    * q8["weight_scale"])
    out["int8 tiled dequant + GEMM"] = (n8, TiledKernel(q8, QuantConfig("int8"), None))
    out["w8a8 oneDNN qlinear_pointwise"] = (n8, OnednnKernel(q8["qweight"], q8["weight_scale"],
                                                             None))
    block = rotation_block(w.shape[1])
    out[f"w8a8 oneDNN, input rotated (blocks of {block})"] = (n8, OnednnKernel(
        q8["qweight"], q8["weight_scale"], None, None, block))
    out["w8a8 torch._int_mm"] = (n8, IntMMKernel(q8["qweight"], q8["weight_scale"], None))
    q4 = quantize_rows(w, QuantConfig("int4"), dtype)
    n4 = sum(t.numel() * t.element_size() for t in q4.values())
    out["int4 tiled dequant + GEMM"] = (n4, TiledKernel(q4, QuantConfig("int4"), None))
    if dtype == torch.bfloat16 or slow:       # fp32: seconds per call (scalar code in torch)
        out["int4 _weight_int4pack_mm_for_cpu"] = (n4, Int4CpuKernel({k: v.clone() for k, v in q4.items()}, 128, None))
    if use_torchao:
        out.update(_torchao(w, dtype))
    return out


def _torchao(w: torch.Tensor, dtype: torch.dtype) -> dict:
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    out = {}
    for name, config in (("torchao int8 weight-only", Int8WeightOnlyConfig()),
                         ("torchao int4 weight-only", Int4WeightOnlyConfig(group_size=128))):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
        lin.weight.data.copy_(w)
        try:
            quantize_(lin, config)
            lin(torch.zeros(1, w.shape[1], dtype=dtype))
        except Exception as exc:                 # noqa: BLE001 - report and go on
            print(f"  {name}: unavailable ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        nbytes = w.numel() * (1 if "int8" in name else 0.5)
        out[name] = (int(nbytes), lin)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="32,256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--shapes", default="qkv,gate_up,down")
    p.add_argument("--only", default="", help="comma-separated substrings of the candidate "
                   "names to time (default: all)")
    p.add_argument("--torchao", action="store_true")
    p.add_argument("--slow", action="store_true", help="also time torch's packed kernels on "
                   "fp32 activations (seconds per call here)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}, torch {torch.__version__}")
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        w = torch.randn(n, k) * 0.02
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            for name, (nbytes, fn) in candidates(w, dtype, args.torchao, args.slow).items():
                if args.only and not any(o in name for o in args.only.split(",")):
                    continue
                cells = []
                for m in rows:
                    x = torch.randn(m, k).to(dtype)
                    with torch.no_grad():
                        ms = best_ms(lambda: fn(x))
                    gops = 2 * m * n * k / ms / 1e6
                    cells.append(f"M={m}: {ms:7.2f} ms {nbytes / ms / 1e6:5.1f} GB/s "
                                 f"{gops:5.0f} GOP/s")
                print(f"{shape:8} {dtype_name(dtype):9} {name:36} " + "  ".join(cells))


if __name__ == "__main__":
    main()
