"""Nemotron-Labs-Diffusion under tensor parallelism (#50): TP=2 gives TP=1's tokens and NFE in
fp32 for the engine's decoders inside its blocks and for its own three decodings (`nemotron`,
`ar`, `linear_spec`, run by engine/nemotron_runner.py through `executor.run_pieces`): the
official golden cases mixed in one call with an engine decoder request, longer generations,
the exact causal likelihood, an abort mid-run, the LoRA draft adapter sharded over the ranks,
and a rank that dies mid-decoding (WorkerDiedError)."""

import os
import signal

import pytest
import torch

from cover_vllm import LLM, LoglikelihoodParams, SamplingParams
from cover_vllm.executor import WorkerDiedError
from cover_vllm.models.nemotron_cache import PagedSlots, Piece
from golden_cases import GOLDEN
from test_nemotron import CASES, check, params
from test_nemotron_lora import lora_dir  # noqa: F401  (a fixture)
from test_tensor_parallel import _assert_gone

DIR = GOLDEN / "nemotron"
LONG = str(DIR / "model_long")
DECODINGS = ("nemotron", "ar", "linear_spec")


def _llm(path, tp: int = 1, **kw) -> LLM:
    return LLM(str(path), dtype="float32", num_threads=1, tensor_parallel_size=tp,
               kv_cache_memory_bytes=8 << 20, **kw)


@pytest.fixture(scope="module")
def pair():
    """(TP=1, TP=2) engines over the long-context golden checkpoint (YaRN and the q scale act)."""
    single, sharded = _llm(LONG), _llm(LONG, tp=2)
    yield single, sharded
    sharded.shutdown()


def _prompts(seed: int, lengths) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": [1] + torch.randint(12, 160, (int(n),), generator=gen)
             .tolist()} for n in lengths]


def _summary(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.metrics.nfe, o.metrics.accepted_tokens,
             o.metrics.verifies) for o in outputs]


@pytest.mark.slow   # worker processes
def test_tp2_equals_tp1_engine_decoders(pair):
    single, sharded = pair
    prompts = _prompts(4, (6, 13, 21))
    for name in ("cover", "low_confidence", "wino"):
        sp = SamplingParams(max_tokens=16, block_length=8, decoding=name, ignore_eos=True)
        want = single.generate(prompts, sp, use_tqdm=False)
        got = sharded.generate(prompts, sp, use_tqdm=False)
        assert _summary(got) == _summary(want), name


@pytest.mark.slow   # worker processes
@pytest.mark.parametrize("tag, backend", [("model", "mp"), ("model_long", "mp"),
                                          pytest.param("model_long", "ray",
                                                       marks=pytest.mark.ray)])
def test_tp2_golden_cases_mixed_with_an_engine_decoder(tag, backend, request):
    """Every official case of a checkpoint (three loops) in one TP=2 `generate` call beside a
    `cover` request: the official tokens and NFE; the cover request's are TP=1's."""
    if backend == "ray":
        request.getfixturevalue("ray_session")
    cases = [c for c in CASES if c["model"] == tag]
    prompts = [{"prompt_token_ids": c["prompt_ids"][0]} for c in cases] + _prompts(2, (11,))
    sps = [params(c) for c in cases] + [SamplingParams(max_tokens=16, block_length=8,
                                                       decoding="cover", ignore_eos=True)]
    sharded = _llm(DIR / tag, tp=2, distributed_executor_backend=backend)
    try:
        got = sharded.generate(prompts, sps, use_tqdm=False)
    finally:
        sharded.shutdown()
    check(got[:-1], cases)
    want = _llm(DIR / tag).generate(prompts[-1:], sps[-1:], use_tqdm=False)
    assert _summary(got[-1:]) == _summary(want)


@pytest.mark.slow   # worker processes
def test_tp2_equals_tp1_longer_generations(pair):
    """64 tokens past EOS, the knobs of each decoding, all requests in one batch."""
    single, sharded = pair
    prompts = _prompts(7, (5, 9, 17, 26, 12, 30))
    sps = [SamplingParams(max_tokens=64, block_length=8, decoding="nemotron", ignore_eos=True,
                          decoding_params={"causal_context": False}),
           SamplingParams(max_tokens=64, block_length=8, decoding="nemotron", ignore_eos=True,
                          decoding_params={"threshold": 0.5, "causal_context": True}),
           SamplingParams(max_tokens=64, decoding="ar", ignore_eos=True),
           SamplingParams(max_tokens=64, block_length=4, decoding="linear_spec",
                          ignore_eos=True),
           SamplingParams(max_tokens=64, block_length=8, decoding="linear_spec",
                          ignore_eos=True, decoding_params={"threshold": 0.6}),
           SamplingParams(max_tokens=48, block_length=8, decoding="nemotron",
                          temperature=0.8, seed=3)]
    want = single.generate(prompts, sps, use_tqdm=False)
    got = sharded.generate(prompts, sps, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert all(len(o.outputs[0].token_ids) == 64 for o in got[:5])


@pytest.mark.slow   # worker processes
def test_tp2_loglikelihood_and_prompt_logprobs_equal_tp1(pair):
    single, sharded = pair
    reqs = [{"context_token_ids": [1, 20, 30, 40], "continuation_token_ids": [50, 60, 70]},
            {"context_token_ids": [1] + list(range(12, 60)), "continuation_token_ids": [99]}]
    lp = LoglikelihoodParams(logprobs=2)
    want = single.loglikelihood(reqs, lp, use_tqdm=False)
    got = sharded.loglikelihood(reqs, lp, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
        assert a.is_greedy == b.is_greedy
        assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
    sp = SamplingParams(max_tokens=4, decoding="ar", prompt_logprobs=1)
    a, b = (llm.generate([1, 20, 30, 40, 50], sp, use_tqdm=False)[0] for llm in pair[::-1])
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert {t: v.logprob for t, v in x.items()} == pytest.approx(
            {t: v.logprob for t, v in y.items()}, abs=1e-5)


@pytest.mark.slow   # worker processes
def test_tp2_abort_mid_run(pair):
    """Aborting one of three running requests under TP=2: its pages go back to the pool, the
    others finish with TP=1's tokens."""
    single, sharded = pair
    engine = sharded.engine
    free = engine.pool.num_free
    prompts = _prompts(9, (8, 14, 20))
    sps = [SamplingParams(max_tokens=40, block_length=8, decoding=d, ignore_eos=True)
           for d in DECODINGS]
    for i, (prompt, sp) in enumerate(zip(prompts, sps)):
        engine.add_request(f"abort-{i}", prompt, sp)
    done = {}
    while engine.load().running < 3 or engine.pool.num_free == free:
        done.update((o.request_id, o) for o in engine.step())
    for _ in range(3):
        done.update((o.request_id, o) for o in engine.step())
    assert not done                                    # all three still mid-run
    engine.abort_request("abort-1")
    assert engine.load().running == 2
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sorted(done) == ["abort-0", "abort-2"]
    assert engine.pool.num_free == free
    want = single.generate([prompts[0], prompts[2]], [sps[0], sps[2]], use_tqdm=False)
    assert _summary([done["abort-0"], done["abort-2"]]) == _summary(want)


def _draft_logits(llm: LLM, ids: list[int], adapter: bool) -> torch.Tensor:
    """A causal prefill, then a diffusion-mode (draft) piece through the engine's executor:
    on every rank, over the engine's own pages."""
    engine = llm.engine
    cache = PagedSlots(engine.executor.cache, engine.pool, engine.config.page_size)
    slot = cache.allocate(64)
    try:
        engine.executor.run_pieces(cache, [Piece(slot, ids[:12], True, True, [])])
        return engine.executor.run_pieces(
            cache, [Piece(slot, ids[12:], False, False, list(range(8)), adapter)])[0]
    finally:
        cache.release(slot)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The bound of tests/test_tensor_parallel.py: a row-parallel all-reduce sums the ranks'
    partial products in another order than one GEMM, 1e-5 of the logits' scale."""
    bound = 1e-5 * max(1.0, float(want.abs().max()))
    assert float((got - want).abs().max()) <= bound


@pytest.mark.slow   # worker processes
def test_tp2_lora_draft_adapter_equals_tp1(lora_dir):  # noqa: F811
    """The adapter's A is split over the ranks on o_proj's input dim (its A·x all-reduced), B
    whole: TP=2's draft rows equal TP=1's, other rows are the base model's, and
    self-speculation keeps TP=1's tokens, NFE and acceptance."""
    path, _ = lora_dir
    single, sharded = _llm(path), _llm(path, tp=2)
    try:
        for llm in (single, sharded):
            assert llm.engine.executor.draft_adapter(path) is not None
        ids = list(range(20, 40))
        on, off = _draft_logits(sharded, ids, True), _draft_logits(sharded, ids, False)
        _close(on, _draft_logits(single, ids, True))
        _close(off, _draft_logits(single, ids, False))
        assert (on - off).abs().max() > 1e-3
        prompts = _prompts(5, (10, 10, 10, 10))
        sp = SamplingParams(max_tokens=24, block_length=8, decoding="linear_spec")
        assert _summary(sharded.generate(prompts, sp, use_tqdm=False)) == \
            _summary(single.generate(prompts, sp, use_tqdm=False))
    finally:
        sharded.shutdown()


@pytest.mark.slow   # worker processes
@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_tp2_quantized_with_the_adapter_equals_tp1(lora_dir, quantization):  # noqa: F811
    """Quantized shards (W8A8: TP=1's row scales, exact integer sums) and the sharded adapter
    on the quantized o_proj: TP=2 gives TP=1's tokens, NFE and acceptance."""
    path, _ = lora_dir
    prompts = _prompts(5, (10, 10, 10, 10))
    sps = [SamplingParams(max_tokens=32, block_length=8, decoding=d, ignore_eos=True)
           for d in ("linear_spec", "nemotron", "ar", "linear_spec")]
    runs = []
    for tp in (1, 2):
        llm = _llm(path, tp=tp, quantization=quantization)
        try:
            runs.append(_summary(llm.generate(prompts, sps, use_tqdm=False)))
        finally:
            llm.shutdown()
    assert runs[1] == runs[0]


@pytest.mark.slow   # worker processes
def test_killed_rank_fails_the_causal_decodings():
    """A rank killed between two of the runner's forwards: WorkerDiedError naming it, the
    in-flight requests dropped, and the engine keeps saying so."""
    llm = _llm(LONG, tp=2, distributed_timeout_s=30)
    executor = llm.engine.executor
    (pid,) = executor.ranks.pids
    real, calls = executor.run_pieces, []

    def run_then_kill(cache, pieces):          # the third forward loses rank 1
        calls.append(1)
        if len(calls) == 3:
            os.kill(pid, signal.SIGKILL)
            _assert_gone([pid])
        return real(cache, pieces)
    executor.run_pieces = run_then_kill
    llm.engine.causal._runner().forward = run_then_kill
    sps = [SamplingParams(max_tokens=32, block_length=8, decoding=d) for d in DECODINGS]
    try:
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) died"):
            llm.generate(_prompts(3, (6, 9, 12)), sps, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(WorkerDiedError):
            llm.engine.check_health()
    finally:
        llm.shutdown()
