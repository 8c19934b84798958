"""CUDA graphs of the forward (issue #42, worker/cuda_graphs.py). On CPU the `Rerun` backend
stands in for `torch.cuda.CUDAGraph`: the padding, bucketing, keying and static buffers all run,
and every replay is checked op by op against its capture (what a graph would have frozen).
Tokens and NFE equal the eager engine's for every decoder and cache mode; the real backend is
checked the same way wherever CUDA exists."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import cover_vllm.worker.worker as worker_module
from cover_vllm import LLM, SamplingParams
from cover_vllm.attention import build_metadata
from cover_vllm.worker.cuda_graphs import (CAPTURE_SIZES, GraphRunner, StaticInputs, bucket,
                                           capture_backend_for, metadata_key, pad_batch)
from cover_vllm.worker.graph_backends import CudaGraphs, GraphMismatch, Rerun
from tests.test_attention import OVERRIDES, _backend, _random_batch

SMALL_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160)   # 4 full canvases exceed them
DECODERS = {"low_confidence": {}, "threshold": {"threshold": 0.6},
            "cover": {"w_influence": 0.0, "w_drift": 0.0},   # no statistics: graphs engage
            "wino": {}}


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(200) for _ in range(rng.randint(3, 30))]}
            for _ in range(n)]


def _llm(monkeypatch, backend, **kwargs) -> LLM:
    """cover-tiny, with `backend` as its capture backend (None: eager)."""
    with monkeypatch.context() as patch:
        patch.setattr(worker_module, "capture_backend_for", lambda config, device: backend)
        return LLM("cover-tiny", num_threads=1, max_num_seqs=4, **kwargs)


def _generate(llm: LLM, decoding: str, max_tokens: int = 40) -> list[tuple]:
    params = SamplingParams(max_tokens=max_tokens, block_length=8, decoding=decoding,
                            decoding_params=DECODERS[decoding])
    outs = llm.generate(_prompts(5), params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.metrics.nfe) for o in outs]


@pytest.mark.parametrize("kv_cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("decoding", list(DECODERS))
def test_graph_replays_give_the_eager_tokens_and_nfe(monkeypatch, decoding, kv_cache):
    """Five requests on four slots: batches of 1-4 sequences whose token counts fall between
    buckets; with kv_cache=none the whole-canvas windows of a full batch exceed the largest
    bucket (here 160 tokens) and run eagerly."""
    eager = _generate(_llm(monkeypatch, None, kv_cache=kv_cache), decoding)
    llm = _llm(monkeypatch, Rerun(verify=True), kv_cache=kv_cache)
    llm.engine.executor.runner.graphs.sizes = SMALL_SIZES
    assert _generate(llm, decoding) == eager
    counts = llm.engine.executor.runner.graphs.counts
    assert counts.captures > 0 and counts.padded_rows > 0   # some steps fell between buckets
    if kv_cache == "none":
        assert counts.eager > 0                        # beyond the largest bucket
    else:                                              # a graph serves later steps
        assert counts.replays > counts.captures


def test_the_cap_on_graphs_sends_other_shapes_to_eager(monkeypatch):
    eager = _generate(_llm(monkeypatch, None, kv_cache="dual"), "low_confidence")
    llm = _llm(monkeypatch, Rerun(verify=True), kv_cache="dual")
    graphs = llm.engine.executor.runner.graphs
    graphs.max_graphs = 2
    assert _generate(llm, "low_confidence") == eager
    assert len(graphs.graphs) == 2 and graphs.counts.eager > 0 and graphs.counts.replays > 2


def test_steps_reading_statistics_run_eagerly(monkeypatch):
    """COVER's default score reads drift and attention in-mass: measured per step, off-graph."""
    llm = _llm(monkeypatch, Rerun(verify=True), kv_cache="dual")
    params = SamplingParams(max_tokens=16, block_length=8, decoding="cover")
    llm.generate(_prompts(2), params, use_tqdm=False)
    assert llm.engine.executor.runner.graphs.counts.replays == 0


def test_graphs_engage_on_cuda_only_without_enforce_eager():
    config = lambda **kw: SimpleNamespace(**{"enforce_eager": False,  # noqa: E731
                                             "tensor_parallel_size": 1, **kw})
    assert isinstance(capture_backend_for(config(), "cuda:0"), CudaGraphs)
    assert capture_backend_for(config(enforce_eager=True), "cuda") is None
    assert capture_backend_for(config(), "cpu") is None
    assert capture_backend_for(config(), "meta") is None
    assert capture_backend_for(config(tensor_parallel_size=2), "cuda") is None


def test_eager_engines_have_no_graphs_and_no_pad_slot():
    runner = LLM("cover-tiny", num_threads=1, enforce_eager=False).engine.executor.runner
    assert runner.graphs is None and runner.cache.pad_slot is None


def test_buckets():
    assert [bucket(n, CAPTURE_SIZES) for n in (1, 3, 5, 8, 9, 100, 512)] == \
        [1, 4, 8, 8, 16, 104, 512]
    assert bucket(513, CAPTURE_SIZES) is None


@pytest.mark.parametrize("backend", ["sdpa/mask", "sdpa/closed_form", "reference"])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("scratch", [False, True])
def test_pad_rows_change_no_real_row_and_no_real_slot(backend, extra, scratch):
    """The pad sequence (its rows, its key columns, its writes to the pad slot) leaves every real
    row's output and every real cache slot as the unpadded batch has them."""
    seqs, q, k, v, cache = _random_batch(4, 2, OVERRIDES, seed=3)
    gen = torch.Generator().manual_seed(4)
    if extra:                               # WINO-style extra rows on the second sequence
        length = int(seqs[1].key_slots.numel())
        seqs[1].extra_allowed = torch.rand(3, length + 3, generator=gen) < 0.7
        seqs[1].extra_allowed[:, 0] = True
        q, k, v = (torch.cat([x, torch.randn(3, *x.shape[1:], generator=gen)])
                   for x in (q, k, v))
    num_slots, t = cache[0].shape[0], q.shape[0]
    region = (num_slots, 16) if scratch else None
    pad_slot = num_slots + (16 if scratch else 0)
    plain = tuple(torch.cat([c, torch.full((pad_slot + 1 - num_slots, *c.shape[1:]), 9.0)])
                  for c in cache)
    padded_cache = tuple(c.clone() for c in plain)
    want = _backend(backend).forward(q, k, v, plain, build_metadata(seqs, scratch=region))
    ids = torch.arange(t)
    padded = pad_batch(seqs, ids, ids.clone(), pad_slot, ((8, 48, 64), 16))
    assert padded.ids.numel() == 48 and padded.num_pad == 48 - t
    assert padded.seqs[-1].key_slots.numel() == 32          # Kmax 30 -> 32 key columns
    rows = padded.ids                 # every real row's flat index, pad rows -> a real one's q
    pad_q = lambda x: x[torch.where(rows < t, rows, 0)]     # noqa: E731
    meta = build_metadata(padded.seqs, scratch=region)
    got = _backend(backend).forward(pad_q(q), pad_q(k), pad_q(v), padded_cache, meta)
    torch.testing.assert_close(padded.unpad(got), want, rtol=1e-4, atol=2e-5)
    for new, old in zip(padded_cache, plain):
        assert torch.equal(new[:pad_slot], old[:pad_slot])   # pages and scratch slots


def test_static_inputs_pack_one_buffer_per_dtype():
    host = {"a": torch.arange(6).view(2, 3), "b": torch.tensor([True, False]),
            "c": torch.arange(4) + 10}
    static = StaticInputs(host, torch.device("cpu"))
    assert len(static.flat) == 2 and static.views["a"].shape == (2, 3)
    assert static.views["c"].data_ptr() == static.flat[torch.long].data_ptr() + 6 * 8
    static.load({"a": host["a"] * 2, "b": ~host["b"], "c": host["c"]})
    assert torch.equal(static.views["a"], host["a"] * 2) and torch.equal(static.views["b"],
                                                                         ~host["b"])


def test_the_key_holds_every_shape_and_flag_of_the_metadata():
    seqs, *_ = _random_batch(4, 2, OVERRIDES, seed=3)
    base = metadata_key(build_metadata(seqs))
    assert metadata_key(build_metadata(seqs)) == base
    assert metadata_key(build_metadata(seqs, scratch=(1000, 16))) != base   # store_slots
    seqs[0].override = seqs[0].override[:1]
    assert metadata_key(build_metadata(seqs)) != base                       # fewer overrides


def test_rerun_fails_where_a_graph_would_replay_stale_work():
    """A replay whose ops differ from the capture's (a Python branch the key misses, a scalar
    baked in, a buffer swapped) is refused."""
    buffers = {"x": torch.ones(4), "scale": 2.0, "n": 4}
    replay = Rerun(verify=True).capture(lambda: buffers["x"][:buffers["n"]] * buffers["scale"])
    buffers["x"].copy_(torch.arange(4.0))
    assert torch.equal(replay(), torch.arange(4.0) * 2)          # new values: fine
    for change in ({"scale": 3.0}, {"n": 3}, {"x": torch.ones(4)}):
        saved = dict(buffers)
        buffers.update(change)
        with pytest.raises(GraphMismatch):
            replay()
        buffers.update(saved)


def test_graph_runner_runs_oversized_steps_eagerly():
    seqs, *_ = _random_batch(4, 2, OVERRIDES, seed=3)
    t = sum(s.window_len for s in seqs)
    runner = GraphRunner(lambda *a: None, Rerun(), 0, torch.device("cpu"), ((8,), 16, 4))
    assert runner.prepare(seqs, torch.zeros(t, dtype=torch.long),
                          torch.zeros(t, dtype=torch.long), None) is None
    assert runner.counts.eager == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decoding", list(DECODERS))
def test_cuda_graphs_give_the_eager_tokens_and_nfe(decoding):
    """The real thing: graphs are on by default on CUDA, off with enforce_eager."""
    eager = LLM("cover-tiny", device="cuda", max_num_seqs=4, enforce_eager=True)
    assert eager.engine.executor.runner.graphs is None
    llm = LLM("cover-tiny", device="cuda", max_num_seqs=4)
    graphs = llm.engine.executor.runner.graphs
    assert isinstance(graphs.backend, CudaGraphs)
    assert _generate(llm, decoding) == _generate(eager, decoding)
    assert graphs.counts.replays > graphs.counts.captures > 0


@pytest.mark.parametrize("key_align", [1, 64])
def test_scoring_through_graphs_gives_the_eager_loglikelihood(monkeypatch, key_align):
    """Scoring sequences are windows too: their rows come back unpadded to the scoring pass.
    Pad rows and static buffers change no bit (key_align=1); padded key columns, masked, may
    change the last bits of a log-prob (as eager batching with a longer canvas does)."""
    requests = [{"context_token_ids": [5, 6, 7, 8], "continuation_token_ids": [9, 10]},
                {"context_token_ids": [11] * 9, "continuation_token_ids": [12, 13, 14]}]
    eager = [o.logprob for o in _llm(monkeypatch, None).loglikelihood(requests, use_tqdm=False)]
    llm = _llm(monkeypatch, Rerun(verify=True))
    graphs = llm.engine.executor.runner.graphs
    graphs.sizes, graphs.key_align = (7, 50, 100, 200, 512), key_align
    got = [o.logprob for o in llm.loglikelihood(requests, use_tqdm=False)]
    assert graphs.counts.replays > 0 and graphs.counts.padded_rows > 0
    if key_align == 1:
        assert got == eager
    else:
        assert got == pytest.approx(eager, rel=1e-6)
