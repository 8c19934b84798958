"""Loading at scale: slice reads under tensor parallelism, dummy weights per tensor, checkpoints
written by `make-checkpoint` or by anyone else, the memory budget and its startup line, and
(slow) the peak resident memory of a fresh process at TP=1 and per rank at TP=2."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cover_vllm import LLM, SamplingParams
from cover_vllm.distributed.tensor_parallel import param_slices
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.checkpoint_writer import CheckpointSpec, write_checkpoint
from cover_vllm.models.loader import build_model, load_into, materialize, weight_source
from cover_vllm.models.spec import ModelSpec
from cover_vllm.models.weights import CheckpointWeights, DummyWeights
from golden_cases import GOLDEN

SMALL_MOE = {
    "model_type": "lladamoe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
    "expert_intermediate_size": 32, "dense_intermediate_size": 96,
    "shared_expert_intermediate_size": 48, "moe_layer_freq": [0, 1], "attention_bias": True,
    "rope_theta": 50000.0, "vocab_size": 100, "mask_token_id": 99, "eos_token_id": 98,
    "pad_token_id": 98, "rms_norm_eps": 1e-5, "moe_router_enable_expert_bias": True,
}
DREAM = json.loads((GOLDEN / "dream" / "model" / "config.json").read_text())


def _full_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    spec = ModelSpec.from_config(config)
    meta = build_model(spec, torch.float32, "meta")
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    model = materialize(meta, "cpu")
    load_into(model, DummyWeights(shapes, seed, std=0.3))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank_state(config: dict, source_of, rank: int, world: int,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Build rank `rank`'s shard on meta, then fill it from `source_of(meta_model)`."""
    meta = build_model(ModelSpec.from_config(config), dtype, "meta")
    source = source_of(meta)
    slices = param_slices(meta, rank, world)
    for name, sl in slices.items():                   # what TensorParallel.shard does on meta
        module_name, attr = name.rsplit(".", 1)
        module = meta.get_submodule(module_name)
        old = getattr(module, attr)
        setattr(module, attr, torch.nn.Parameter(old.narrow(sl.dim, 0, sl.size).clone()))
    model = materialize(meta, "cpu")
    load_into(model, source, slices)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, slices


@pytest.mark.parametrize("config", [SMALL_MOE, DREAM], ids=["moe-with-biases", "dream"])
def test_dummy_shard_is_the_same_slice_of_the_tp1_dummy_tensor(config):
    full = _full_state(config, seed=5)
    for rank in range(2):
        got, slices = _rank_state(
            config, lambda m: DummyWeights({n: tuple(p.shape) for n, p in m.named_parameters()},
                                           5, std=0.3), rank, 2)
        assert slices, "nothing was sharded"
        for name, t in got.items():
            sl = slices.get(name)
            if sl is None:
                want = full[name]
            elif sl.zero:
                want = torch.zeros_like(full[name])
            else:
                want = full[name].narrow(sl.dim, sl.start, sl.size)
            assert torch.equal(t, want), name


def _save_sharded(path: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """A checkpoint written the plain way: safetensors.torch.save_file shards and an index."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(state)
    weight_map = {}
    for i in range(3):
        shard = f"part-{i}.safetensors"
        save_file({n: state[n].contiguous() for n in names[i::3]}, str(path / shard))
        weight_map.update({n: shard for n in names[i::3]})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_reads_its_slice_of_any_checkpoint_and_converts_dtype(tmp_path, dtype):
    full = _full_state(SMALL_MOE, seed=3)
    ckpt = _save_sharded(tmp_path / "ckpt", SMALL_MOE, full)
    for rank in range(2):
        got, slices = _rank_state(SMALL_MOE, lambda m: CheckpointWeights(ckpt), rank, 2, dtype)
        for name, t in got.items():
            sl = slices.get(name)
            want = full[name] if sl is None else (
                torch.zeros_like(full[name]) if sl.zero
                else full[name].narrow(sl.dim, sl.start, sl.size))
            assert t.dtype == dtype and torch.equal(t, want.to(dtype)), name


def test_make_checkpoint_writes_the_official_layout_with_dummy_values(tmp_path):
    from safetensors import safe_open

    config = resolve_model("llada-50m").config
    index = write_checkpoint(CheckpointSpec(config, torch.bfloat16, seed=7,
                                            max_shard_bytes=30_000_000, progress=False),
                             tmp_path)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all((tmp_path / s).stat().st_size <= 30_000_000 + 10_000 for s in shards)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    written = {}
    for shard in shards:                           # readable by the safetensors library
        with safe_open(str(tmp_path / shard), framework="pt") as f:
            written.update({k: f.get_tensor(k) for k in f.keys()})
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in written.values())
    meta = build_model(ModelSpec.from_config(config), torch.bfloat16, "meta")
    assert set(written) == {n for n, _ in meta.named_parameters()}
    source = weight_source(resolve_model("llada-50m"), meta, "dummy", seed=7)
    model = materialize(meta, "cpu")
    load_into(model, source)
    for name, p in model.named_parameters():
        assert torch.equal(p, written[name]), name


@pytest.mark.slow   # worker processes
def test_tp2_equals_tp1_on_dummy_weights():
    params = SamplingParams(max_tokens=8, block_length=8, ignore_eos=True,
                            decoding="low_confidence", seed=0)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    kw = dict(load_format="dummy", num_threads=1, kv_cache_memory_bytes=8 << 20, seed=3,
              dtype="float32")              # fp32: the ranks' partial sums are exact
    want = LLM("llada-50m", **kw).generate(prompt, params, use_tqdm=False)
    sharded = LLM("llada-50m", tensor_parallel_size=2, **kw)
    try:
        got = sharded.generate(prompt, params, use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
        peaks = sharded.engine.peak_memory_bytes()
        assert len(peaks) == 2 and all(p > 0 for p in peaks)
    finally:
        sharded.shutdown()


def test_budget_error_names_the_numbers_before_loading():
    with pytest.raises(ValueError, match=r"weights need .* GiB .*canvas.*memory_utilization="
                                         r"1e-06.*allows"):
        LLM("llada-8b", load_format="dummy", dtype="bfloat16", memory_utilization=1e-6)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=.*exceed memory_utilization"):
        LLM("cover-tiny", kv_cache_memory_bytes=1 << 50)
    with pytest.raises(ValueError, match="memory_utilization must be a fraction"):
        LLM("cover-tiny", memory_utilization=1.5)


def test_startup_line_and_default_budget(caplog):
    caplog.set_level(logging.INFO, logger="cover_vllm")
    llm = LLM("cover-tiny", num_threads=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:")]
    assert len(lines) == 1, lines
    plan = llm.engine.memory
    assert f"{plan.num_pages} pages of 16 tokens" in lines[0]
    assert f"fits {plan.canvases} canvases of {plan.canvas_tokens} tokens" in lines[0]
    assert "weights 0.00 GiB" in lines[0]
    # the default for a small model is unchanged: max_num_seqs full canvases (under 2 GiB)
    per_token, max_len = plan.kv_bytes_per_token, llm.engine.spec.max_model_len
    assert plan.kv_bytes == 64 * max_len * per_token
    assert llm.engine.num_free_pages == plan.num_pages


SUBPROCESS = """
import json, sys, torch
from cover_vllm import LLM, SamplingParams
from cover_vllm.worker.memory import peak_rss_bytes
torch.set_num_threads(1)
llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), kv_cache_memory_bytes=32 << 20,
          num_threads=1, decoding="cover", kv_cache="dual")
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                   SamplingParams(max_tokens=8, block_length=8, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 8
print(json.dumps({"peaks": llm.engine.peak_memory_bytes(), "weights": llm.engine.memory.weight_bytes}))
llm.shutdown()
"""
SLACK_BYTES = 900 << 20       # interpreter + torch + KV pool + activations, independent of size


@pytest.mark.slow
def test_peak_memory_of_a_written_checkpoint_is_the_weights(tmp_path):
    """A 0.31 B-parameter fp32 checkpoint (1.24 GB) loads in a fresh process at a peak of at
    most 1.3 x weight bytes + a fixed slack, at TP=1 and per rank at TP=2."""
    config = resolve_model("llada-300m").config
    index = write_checkpoint(CheckpointSpec(config, torch.float32, max_shard_bytes=400_000_000,
                                            progress=False), tmp_path)
    weights = index["metadata"]["total_size"]
    results = {}
    for world in (1, 2):
        proc = subprocess.run([sys.executable, "-c", SUBPROCESS, str(tmp_path), str(world)],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[world] = json.loads(proc.stdout.strip().splitlines()[-1])
    (tp1,) = results[1]["peaks"]
    assert tp1 <= 1.3 * weights + SLACK_BYTES, (tp1, weights)
    meta = build_model(ModelSpec.from_config(config), torch.float32, "meta")
    sliced = param_slices(meta, 0, 2)
    rank_bytes = sum(p.numel() * 4 // (2 if n in sliced else 1) for n, p in meta.named_parameters())
    for peak in results[2]["peaks"]:
        assert peak <= 1.3 * rank_bytes + SLACK_BYTES, (peak, rank_bytes)


def test_make_checkpoint_and_bench_scale_commands(tmp_path):
    """The two commands end to end on a small shape: the written checkpoint loads through the
    real path and `bench scale` reports load time, memory, steps and tokens as JSON."""
    from cover_vllm.entrypoints.cli import main

    ckpt = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--shape", "llada-50m", "--dtype", "float32", "--out",
                 str(ckpt), "--max-shard-bytes", "80000000"]) == 0
    assert len(list(ckpt.glob("model-*-of-*.safetensors"))) == 3
    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--model", str(ckpt), "--threads", "1", "--output-len", "8",
                 "--batch-size", "1,2", "--kv-cache-memory-bytes", str(8 << 20), "--json",
                 str(out), "--dump-logits", str(tmp_path / "logits.pt")]) == 0
    report = json.loads(out.read_text())
    assert report["load_format"] == "auto" and report["weight_bytes"] == 203466752
    assert [r["batch_size"] for r in report["generate"]] == [1, 2]
    assert all(r["tokens"] == 8 * r["batch_size"] and r["step_s"] > 0
               for r in report["generate"])
    assert report["peak_rss"][0] >= report["weight_bytes"]
    from cover_vllm.benchmarks.scale import compare_logits

    assert compare_logits(str(tmp_path / "logits.pt"), str(tmp_path / "logits.pt")) == 0.0


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_make_checkpoint_and_bench_scale_on_a_block_causal_model(tmp_path, family, tp):
    """`make-checkpoint --shape <dir>` writes random weights for a golden block-causal config
    (LLaDA2's fused QKV and experts, SDAR's q/k norm) and `bench scale` generates with it, at
    TP=1 and (slow, worker processes) TP=2."""
    from cover_vllm.entrypoints.cli import main

    ckpt, out = tmp_path / "ckpt", tmp_path / "scale.json"
    assert main(["make-checkpoint", "--shape", str(GOLDEN / family / "model"), "--dtype",
                 "float32", "--out", str(ckpt)]) == 0
    assert main(["bench", "scale", "--model", str(ckpt), "--threads", "1", "--output-len", "8",
                 "--batch-size", "1,2", "--kv-cache-memory-bytes", str(8 << 20),
                 "--tensor-parallel-size", str(tp), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["load_format"] == "auto" and len(report["peak_rss"]) == tp
    assert [r["batch_size"] for r in report["generate"]] == [1, 2]
    for r in report["generate"]:
        assert r["tokens"] == 8 * r["batch_size"] and r["step_s"] > 0 and r["nfe"] > 0
