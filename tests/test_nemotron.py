"""Nemotron-Labs-Diffusion against the official vectors (tests/fixtures/golden/nemotron, README
"Nemotron-Labs-Diffusion"): fp32 logits of both attention modes with and without a cache, and
every greedy case of the official `generate`, `ar_generate` and `linear_spec_generate` token-
and NFE-exact through `LLM(DIR)` with decoding="nemotron" | "ar" | "linear_spec", alone, all
cases of one checkpoint and loop in one call, and every case of a checkpoint mixed in one call.
Self-speculation is batched: at batch 16 each request gets its batch-1 tokens."""

import json

import pytest
import torch
from safetensors.torch import load_file

from cover_vllm import LLM, SamplingParams
from cover_vllm.models.loader import build_model
from cover_vllm.models.nemotron import mode_mask
from cover_vllm.models.nemotron_cache import Piece, SlotCache, run_pieces
from cover_vllm.models.spec import ModelSpec
from golden_cases import GOLDEN

DIR = GOLDEN / "nemotron"
TAGS = ("model", "model_long")
CASES = json.loads((DIR / "generate.json").read_text())
LOOPS = {"nemotron_generate": "nemotron", "nemotron_ar_generate": "ar",
         "nemotron_linear_spec_generate": "linear_spec"}
EOS = 11


@pytest.fixture(scope="module")
def engines():
    return {tag: LLM(str(DIR / tag), dtype="float32", kv_cache_memory_bytes=8 << 20)
            for tag in TAGS}


def golden_model(tag: str):
    spec = ModelSpec.from_dir(DIR / tag)
    model = build_model(spec, torch.float32, "cpu")
    model.load_state_dict(load_file(DIR / tag / "model.safetensors"))
    return model.eval().requires_grad_(False)


def params(case: dict) -> SamplingParams:
    p, decoding = case["params"], LOOPS[case["decoder"]]
    knobs = {}
    if decoding == "nemotron":
        knobs = {"threshold": p["threshold"], "causal_context": p["causal_context"]}
        if "max_thinking_tokens" in p:
            knobs.update(max_thinking_tokens=p["max_thinking_tokens"],
                         end_think_token_id=p["end_think_token_id"])
    elif decoding == "linear_spec":
        knobs = {"threshold": p["threshold"]}
    return SamplingParams(max_tokens=p["max_new_tokens"], block_length=p.get("block_length"),
                          decoding=decoding, decoding_params=knobs)


def expected(case: dict) -> list[int]:
    """Generated tokens through the first EOS, at most max_new_tokens (the official
    linear_spec_generate may run up to a block past it)."""
    prompt = case["prompt_ids"][0]
    out = case["output_ids"][0][len(prompt):]
    if EOS in out:
        out = out[:out.index(EOS) + 1]
    return out[:case["params"]["max_new_tokens"]]


def check(outputs, cases) -> None:
    for out, case in zip(outputs, cases, strict=True):
        got = out.outputs[0].token_ids
        assert got == expected(case), case["name"]
        assert out.metrics.nfe == case["nfe"], case["name"]
        assert len(got) <= case["params"]["max_new_tokens"]
        assert out.outputs[0].finish_reason == ("stop" if EOS in got else "length")


def test_every_case_is_batch_one_and_mapped():
    assert len(CASES) == 44 and {c["decoder"] for c in CASES} == set(LOOPS)
    assert all(len(c["prompt_ids"]) == 1 for c in CASES)


@pytest.mark.parametrize("tag", TAGS)
def test_forward_logits_without_cache(tag):
    ref, model = load_file(DIR / "forward.safetensors"), golden_model(tag)
    ids = ref[f"{tag}.input_ids"]
    p = ref[f"{tag}.logits_prefill_causal"].shape[1]
    n = ids.shape[1]
    torch.testing.assert_close(model(ids), ref[f"{tag}.logits_full_bidirectional"],
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(model(ids, causal=True), ref[f"{tag}.logits_full_causal"],
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(model(ids[:, :p], causal=True),
                               ref[f"{tag}.logits_prefill_causal"], atol=1e-4, rtol=0)
    for causal, name in ((False, "diffusion"), (True, "causal")):   # the block as one mask
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
        allowed[p:] = mode_mask(p, n - p, causal)
        torch.testing.assert_close(model(ids, attention_mask=allowed)[:, p:],
                                   ref[f"{tag}.logits_block_{name}"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("tag", TAGS)
def test_forward_logits_with_cache(tag):
    """The prompt prefilled causally into the slot cache, then the block in each mode (the
    diffusion forward leaves the cache as it was); a second request beside it changes nothing."""
    ref, model = load_file(DIR / "forward.safetensors"), golden_model(tag)
    ids = ref[f"{tag}.input_ids"][0].tolist()
    p = ref[f"{tag}.logits_prefill_causal"].shape[1]
    d = model.dims
    cache = SlotCache(d.num_layers, d.num_kv_heads, d.head_dim, torch.float32, "cpu")
    slot, other = cache.allocate(64), cache.allocate(64)
    pre = run_pieces(model, cache, [Piece(slot, ids[:p], True, True, list(range(p))),
                                    Piece(other, ids[:5], True, True, [4])])[0]
    torch.testing.assert_close(pre, ref[f"{tag}.logits_prefill_causal"][0], atol=1e-4, rtol=0)
    block, rows = ids[p:], list(range(len(ids) - p))
    diff = run_pieces(model, cache, [Piece(slot, block, False, False, rows),
                                     Piece(other, ids[5:9], True, True, [0])])[0]
    torch.testing.assert_close(diff, ref[f"{tag}.logits_block_diffusion"][0], atol=1e-4, rtol=0)
    assert cache.lengths[slot] == p
    causal = run_pieces(model, cache, [Piece(slot, block, True, True, rows)])[0]
    torch.testing.assert_close(causal, ref[f"{tag}.logits_block_causal"][0], atol=1e-4, rtol=0)
    assert cache.lengths[slot] == len(ids)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_at_a_time(engines, case):
    out = engines[case["model"]].generate({"prompt_token_ids": case["prompt_ids"][0]},
                                          params(case), use_tqdm=False)
    check(out, [case])


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_all_cases_of_a_loop_in_one_call(engines, tag, loop):
    cases = [c for c in CASES if c["model"] == tag and c["decoder"] == loop]
    check(engines[tag].generate([{"prompt_token_ids": c["prompt_ids"][0]} for c in cases],
                                [params(c) for c in cases], use_tqdm=False), cases)


@pytest.mark.parametrize("tag", TAGS)
def test_three_decodings_mixed_in_one_batch(engines, tag):
    cases = [c for c in CASES if c["model"] == tag]
    check(engines[tag].generate([{"prompt_token_ids": c["prompt_ids"][0]} for c in cases],
                                [params(c) for c in cases], use_tqdm=False), cases)


def test_linear_spec_batch_16_equals_batch_1(engines):
    """Sixteen self-speculating requests (random prompts, two thresholds, blocks 4 and 8) in
    one batch: each gets its batch-1 tokens and NFE; the metrics report acceptance."""
    llm = engines["model_long"]
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": [1] + torch.randint(12, 160, (int(n),), generator=gen)
                .tolist()} for n in torch.randint(4, 30, (16,), generator=gen)]
    sps = [SamplingParams(max_tokens=40, block_length=(4, 8)[i % 2], decoding="linear_spec",
                          decoding_params={"threshold": (0.0, 0.6)[i // 8]})
           for i in range(16)]
    batched = llm.generate(prompts, sps, use_tqdm=False)
    for prompt, sp, out in zip(prompts, sps, batched):
        alone = llm.generate(prompt, sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.metrics.nfe == alone.metrics.nfe
        assert len(out.outputs[0].token_ids) <= 40
        m = out.metrics
        assert m.verifies >= 1 and m.verifies <= m.accepted_tokens <= m.verifies * sp.block_length


def test_bad_knobs_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        SamplingParams(decoding="nemotron", decoding_params={"threshold": 1.5})
    with pytest.raises(ValueError, match="end_think_token_id"):
        SamplingParams(decoding="nemotron", decoding_params={"max_thinking_tokens": 3})
    with pytest.raises(ValueError, match="not valid"):
        SamplingParams(decoding="ar", decoding_params={"threshold": 0.5})


def test_prefix_caching_saves_rows_and_changes_no_token():
    """Requests sharing a 40-token prefix (three decodings): with the prefix cache on, later
    ones restore its page-aligned K/V and run only the rest; every token and NFE as without."""
    gen = torch.Generator().manual_seed(1)
    shared = [1] + torch.randint(12, 160, (39,), generator=gen).tolist()
    prompts = [{"prompt_token_ids": shared + torch.randint(12, 160, (k,), generator=gen)
                .tolist()} for k in (1, 5, 17, 9)]
    sps = [SamplingParams(max_tokens=16, block_length=4, decoding=d)
           for d in ("nemotron", "ar", "linear_spec", "nemotron")]
    outs = {}
    for on in (True, False):
        llm = LLM(str(DIR / "model_long"), dtype="float32", kv_cache_memory_bytes=8 << 20,
                  enable_prefix_caching=on)
        first = llm.generate(prompts[:1], sps[:1], use_tqdm=False)
        outs[on] = first + llm.generate(prompts[1:], sps[1:], use_tqdm=False)
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.metrics.nfe == b.metrics.nfe
    assert [o.metrics.cached_prompt_tokens for o in outs[True]] == [0, 32, 32, 32]
    assert all(o.metrics.cached_prompt_tokens == 0 for o in outs[False])


def test_loglikelihood_is_the_exact_causal_one(engines):
    """log p(continuation | context) from one causal forward: equal to the dense causal
    logits' log-softmax summed, is_greedy from their argmax; batched equals alone."""
    llm, model = engines["model_long"], golden_model("model_long")
    reqs = [{"context_token_ids": [1, 20, 30, 40], "continuation_token_ids": [50, 60, 70]},
            {"context_token_ids": [1] + list(range(12, 60)), "continuation_token_ids": [99]}]
    from cover_vllm import LoglikelihoodParams
    outs = llm.loglikelihood(reqs, LoglikelihoodParams(logprobs=None), use_tqdm=False)
    for req, out in zip(reqs, outs):
        c, x = req["context_token_ids"], req["continuation_token_ids"]
        logp = torch.log_softmax(model(torch.tensor([c + x]), causal=True)[0], -1)
        rows = logp[len(c) - 1:len(c) + len(x) - 1]
        want = rows.gather(-1, torch.tensor(x)[:, None])[:, 0]
        assert out.logprob == pytest.approx(float(want.sum()), abs=1e-4)
        assert out.is_greedy == bool((rows.argmax(-1) == torch.tensor(x)).all())
        alone = llm.loglikelihood(req, use_tqdm=False)[0]
        assert alone.logprob == pytest.approx(out.logprob, abs=1e-5)
    with pytest.raises(ValueError, match="context"):
        llm.loglikelihood({"context_token_ids": [], "continuation_token_ids": [5]})


def test_unsupported_fields_are_refused(engines):
    llm = engines["model"]
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate([1, 2, 3], SamplingParams(decoding="ar", structured_outputs={
            "regex": "[0-9]+"}), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([1, 2, 3], SamplingParams(decoding="linear_spec", logprobs=2),
                     use_tqdm=False)


def test_sampling_is_seeded_and_lengths_need_no_whole_blocks(engines):
    """temperature > 0 (Gumbel-max in float64): the same seed gives the same tokens, alone or
    batched; max_tokens that is not a multiple of the block is cut to max_tokens."""
    llm = engines["model_long"]
    for decoding in ("nemotron", "ar", "linear_spec"):
        sp = SamplingParams(max_tokens=13, block_length=4, temperature=0.8, seed=3,
                            decoding=decoding, ignore_eos=True)
        a = llm.generate([[1, 20, 30], [1, 40]], sp, use_tqdm=False)
        b = llm.generate([1, 20, 30], sp, use_tqdm=False)[0]
        assert a[0].outputs[0].token_ids == b.outputs[0].token_ids
        assert all(len(o.outputs[0].token_ids) == 13 for o in a)


def test_prompt_logprobs_are_the_causal_ones(engines):
    """SamplingParams.prompt_logprobs on this family: each prompt token's exact causal
    log-probability (the engine's scoring path routes to the causal likelihood)."""
    llm, model = engines["model"], golden_model("model")
    prompt = [1, 20, 30, 40, 50]
    out = llm.generate(prompt, SamplingParams(max_tokens=4, decoding="ar", prompt_logprobs=1),
                       use_tqdm=False)[0]
    logp = torch.log_softmax(model(torch.tensor([prompt]), causal=True)[0], -1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(
            float(logp[i - 1, prompt[i]]), abs=1e-4)


def test_bench_throughput_prints_the_three_decodings_side_by_side():
    from cover_vllm.benchmarks.nemotron import bench_throughput
    from cover_vllm.benchmarks.throughput import ThroughputSpec

    spec = ThroughputSpec(model=str(DIR / "model"), decodings=("low_confidence",),
                          batch_sizes=(2,), num_prompts=2, input_len=8, output_len=8,
                          block_length=4, dtypes=("float32",),
                          kv_cache_memory_bytes=8 << 20)
    lines = []
    report = bench_throughput(spec, "dummy", log=lines.append)
    assert [r["decoding"] for r in report["results"]] == ["nemotron", "ar", "linear_spec"]
    assert all(r["tokens_per_s"] > 0 for r in report["results"])
    assert "linear_spec" in lines[0] and "accepted/verify" in lines[0]


def test_engine_load_counts_the_causal_requests(engines):
    engine = engines["model"].engine
    engine.add_request("load-a", [1, 2, 3], SamplingParams(max_tokens=8, decoding="ar"))
    engine.add_request("load-b", [1, 2, 3], SamplingParams(max_tokens=8, decoding="ar"))
    assert engine.load().waiting == 2 and engine.has_unfinished_requests()
    engine.step()
    assert engine.load().running == 2
    engine.abort_request("load-a")
    assert engine.load().running == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.load().running == 0


def test_pages_come_from_the_engines_pool():
    """The runner's K/V live in the engine's paged pool: a pool of 10 pages (16 tokens each)
    holds two of these requests at a time, the rest wait for pages and get their batch-1
    tokens; a request larger than the whole pool is refused when added."""
    llm = LLM(str(DIR / "model_long"), dtype="float32", kv_cache_memory_bytes=10 * 8192)
    assert llm.engine.pool.num_pages == 10
    prompts = [[1] + list(range(20 + i, 31 + i)) for i in range(6)]
    sp = SamplingParams(max_tokens=24, block_length=8, decoding="linear_spec")
    batched = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.pool.num_free == 10
    for prompt, out in zip(prompts, batched):
        alone = llm.generate(prompt, sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="KV pages"):
        llm.generate(prompts[0], SamplingParams(max_tokens=400, decoding="ar"), use_tqdm=False)
