"""How fast the projections of one forward run on this CPU, with one layer's weights warm (its
GEMMs repeated) and streamed from memory (every layer's, then the LM head, the way a
forward reads them), against the 2048³ GEMM peak the bench divides by.

    .venv/bin/python scripts/gemm_stream.py [--model llada-50m] [--tokens 32,512] [--threads 2]

Prints GFLOP/s and the share of the peak per case: at a small window (batch 1) the streamed rate
is the ceiling of a step's MFU, whatever runs between the GEMMs. bf16 weights are prepacked for
oneDNN as the engine's CPU workers pack them (layers/common.py, `FusedLinears.pack`).
"""

from __future__ import annotations

import argparse
import time

import torch

from cover_vllm.benchmarks.machine import measure_matmul_gflops, measure_read_gbps
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.spec import ModelSpec
from cover_vllm.worker.allocator import keep_activations_on_heap


def _linear(dtype: torch.dtype):
    """(pack, run): oneDNN-prepacked weights in bf16, plain `F.linear` otherwise."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return (lambda w: w), torch.nn.functional.linear

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    return (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None)), run


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llada-50m")
    ap.add_argument("--tokens", default="32,512", help="window rows, comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_activations_on_heap()
    dtype = getattr(torch, args.dtype)
    cfg = resolve_model(args.model).config
    d = ModelSpec.from_config(cfg).hidden_size
    mlp = cfg.get("mlp_hidden_size") or cfg.get("intermediate_size")
    heads = cfg.get("n_heads") or cfg.get("num_attention_heads")
    kv_heads = cfg.get("n_kv_heads") or cfg.get("num_key_value_heads") or heads
    head_dim = d // heads
    layers = cfg.get("n_layers") or cfg.get("num_hidden_layers")
    vocab = cfg.get("embedding_size") or cfg.get("vocab_size")
    shapes = [((heads + 2 * kv_heads) * head_dim, d), (d, heads * head_dim), (2 * mlp, d),
              (d, mlp)]                                   # qkv, out, gate/up, down: [out, in]
    pack, run = _linear(dtype)
    weights = [[pack(torch.randn(o, i).to(dtype)) for o, i in shapes] for _ in range(layers)]
    head = pack(torch.randn(vocab, d).to(dtype))
    params = layers * sum(o * i for o, i in shapes) + vocab * d
    peak = measure_matmul_gflops(dtype)
    read = measure_read_gbps()
    print(f"{args.model}: {layers} layers, {params / 1e6:.1f} M projection parameters, {dtype}, "
          f"{args.threads} threads; peak 2048³ GEMM {peak:.0f} GFLOP/s, memory read "
          f"{read:.1f} GB/s")
    for t in (int(x) for x in args.tokens.split(",")):
        xs = {i: torch.randn(t, i).to(dtype) for i in {i for _, i in shapes}}

        def one_layer(ws=weights[0]):
            for (_, i), w in zip(shapes, ws):
                run(xs[i], w)

        def forward():
            for ws in weights:
                one_layer(ws)
            run(xs[d], head)

        hot = 2 * t * sum(o * i for o, i in shapes) / _best(one_layer, 50) / 1e9
        cold = 2 * t * params / _best(forward, 10) / 1e9
        bound = min(peak, 2 * t / torch.empty((), dtype=dtype).element_size() * read)
        print(f"  {t:>5} tokens: one layer repeated {hot:7.0f} GFLOP/s ({hot / peak:4.0%} "
              f"of peak)   streamed {cold:7.0f} GFLOP/s ({cold / peak:4.0%})   read-rate bound "
              f"{bound:7.0f} ({bound / peak:4.0%})")


if __name__ == "__main__":
    main()
