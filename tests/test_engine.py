"""Engine behaviour: cache modes, continuous batching, KV admission, stops, aborts, bad input."""

import random
import time

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine

STRATEGIES = [("low_confidence", None), ("threshold", {"threshold": 0.7}),
              ("factor", {"factor": 1.0}), ("random", None), ("threshold", {"threshold": None})]


def _prompts(n, seed=0, vocab=290):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(3, 20))]}
            for _ in range(n)]


def _mixed_params(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        block = rng.choice([4, 8, 16])
        name, params = STRATEGIES[i % len(STRATEGIES)]
        max_tokens = block * rng.randint(1, 3)
        kv_cache = rng.choice(["none", "prefix", "dual"])
        steps = block * rng.randint(1, 2) if name == "low_confidence" else None
        out.append(SamplingParams(
            max_tokens=max_tokens, block_length=block, ignore_eos=True, decoding=name,
            decoding_params=params, kv_cache=kv_cache, seed=i,
            steps=None if steps is None else min(steps, max_tokens)))   # steps <= max_tokens
    return out


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cache_modes_equal_none_when_refreshed_every_step(llada_dir, mode):
    prompts, params = _prompts(6, seed=1), _mixed_params(6, seed=1)
    for p in params:
        p.kv_cache = None
    exact = LLM(llada_dir, kv_cache="none").generate(prompts, params, use_tqdm=False)
    cached = LLM(llada_dir, kv_cache=mode, cache_refresh="interval:1").generate(
        prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in exact]
    assert all(o.metrics.refreshes == o.metrics.nfe for o in cached)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_cached_window_equals_full_forward_on_an_unchanged_canvas(llada_dir, dream_dir, mode,
                                                                  model):
    """Right after a refresh, the cached partial forward must give the refresh's block logits."""
    engine = Engine(EngineConfig(model=llada_dir if model == "llada" else dream_dir,
                                 decoding="low_confidence", kv_cache=mode))
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=24, block_length=8))
    req = engine.scheduler.waiting[0]
    full = engine.schedule()
    assert full.items[0].is_refresh and full.items[0].window_len == req.canvas_len
    logits_full = engine.executor.execute_model(full).logits[0]
    req.needs_refresh = False
    part = engine.schedule()
    item = part.items[0]
    assert not item.is_refresh and item.window_len < req.canvas_len
    logits_part = engine.executor.execute_model(part).logits[0]
    assert (logits_full - logits_part).abs().max().item() <= 1e-4


def test_cache_modes_cut_forward_tokens(llada_dir):
    """dual forwards only the block, prefix the block and suffix; all three decode the request."""
    engines = {m: Engine(EngineConfig(model=llada_dir, decoding="low_confidence", kv_cache=m))
               for m in ("none", "prefix", "dual")}
    sizes = {}
    for mode, engine in engines.items():
        engine.add_request("a", list(range(10)), SamplingParams(max_tokens=32, block_length=8))
        engine.step()                      # the refresh
        sizes[mode] = engine.schedule().num_tokens
    assert sizes == {"none": 42, "prefix": 32, "dual": 8}   # canvas 10 + 32; block 0 = 10..17


def test_64_mixed_requests_match_running_alone(llada_dir):
    llm = LLM(llada_dir, decoding="low_confidence")
    prompts, params = _prompts(64, seed=2), _mixed_params(64, seed=2)
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        (alone,) = llm.generate([prompt], p, use_tqdm=False)
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.metrics.nfe == out.metrics.nfe
    assert llm.engine.num_free_pages == llm.engine.pool.num_pages


def test_small_kv_budget_queues_instead_of_failing(llada_dir):
    prompts, params = _prompts(12, seed=3), _mixed_params(12, seed=3)
    roomy = LLM(llada_dir).generate(prompts, params, use_tqdm=False)
    # 64 dims * 2 layers * 2 (K, V) * 4 bytes = 1 KiB per token; 16-token pages: room for 6 pages.
    tight = LLM(llada_dir, kv_cache_memory_bytes=6 * 16 * 1024)
    assert tight.engine.pool.num_pages == 6
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert tight.engine.pool.peak_used <= 6 and tight.engine.num_free_pages == 6
    with pytest.raises(ValueError, match=r"needs \d+ KV pages for a \d+-token canvas but the "
                                         r"pool has 6; raise kv_cache_memory_bytes or lower "
                                         r"max_tokens"):
        tight.generate([{"prompt_token_ids": [1] * 10}], SamplingParams(max_tokens=96))
    assert tight.generate(prompts[:1], params[0], use_tqdm=False)[0].outputs[0].token_ids == \
        roomy[0].outputs[0].token_ids


def test_eos_and_stop_token_ids_end_generation_early(llada_dir):
    llm = LLM(llada_dir, decoding="low_confidence", kv_cache="none")
    prompt = [{"prompt_token_ids": list(range(10))}]
    full = llm.generate(prompt, SamplingParams(max_tokens=32, block_length=8, ignore_eos=True),
                        use_tqdm=False)[0]
    tokens = full.outputs[0].token_ids
    stop = tokens[3]                       # a token produced in the first block
    out = llm.generate(prompt, SamplingParams(max_tokens=32, block_length=8,
                                              stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == tokens[: tokens.index(stop) + 1]
    assert out.metrics.nfe < full.metrics.nfe          # later blocks were never decoded
    assert full.outputs[0].finish_reason == "length"


def test_abort_frees_pages(llada_dir):
    engine = Engine(EngineConfig(model=llada_dir, decoding="low_confidence"))
    total = engine.num_free_pages
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=64, block_length=8))
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=8, block_length=8))
    engine.step()
    assert engine.num_free_pages < total
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_pages == total and not engine.scheduler.running


BAD_PARAMS = [
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=-3), ValueError, "max_tokens"),
    (dict(max_tokens="8"), TypeError, "max_tokens"),
    (dict(block_length=0), ValueError, "block_length"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(steps=0), ValueError, "steps"),
    (dict(kv_cache="paged"), ValueError, "kv_cache"),
    (dict(stop=[""]), TypeError, "stop"),
]


@pytest.mark.parametrize("kwargs,exc,field", BAD_PARAMS)
def test_bad_sampling_params(kwargs, exc, field):
    with pytest.raises(exc, match=field):
        SamplingParams(**kwargs)


BAD_REQUESTS = [
    ("", {}, ValueError, "empty"),
    ([], {}, ValueError, "empty"),
    ({"prompt_token_ids": []}, {}, ValueError, "empty"),
    ({"ids": [1]}, {}, ValueError, "prompt_token_ids"),
    (5, {}, TypeError, "prompt"),
    ({"prompt_token_ids": [1, "a"]}, {}, TypeError, "prompt"),
    ({"prompt_token_ids": [1, 10_000]}, {}, ValueError, "outside"),
    ({"prompt_token_ids": [1] * 10}, dict(max_tokens=5000), ValueError, "max length"),
    ({"prompt_token_ids": [1]}, dict(decoding="greedy"), ValueError, "low_confidence"),
    ({"prompt_token_ids": [1]}, dict(decoding="threshold", decoding_params={"tau": 1}),
     ValueError, "threshold"),
    ({"prompt_token_ids": [1]}, dict(decoding="threshold", decoding_params={"threshold": 2.0}),
     ValueError, "threshold"),
    ({"prompt_token_ids": [1]}, dict(decoding="threshold", decoding_params=[0.9]),
     TypeError, "decoding_params"),
    ("text prompt", {}, ValueError, "tokenizer"),
    ({"prompt_token_ids": [1]}, dict(stop_token_ids=[5, 10_000]), ValueError, "stop_token_ids"),
    ({"prompt_token_ids": [1]}, dict(max_tokens=8, steps=1000), ValueError, "steps"),
]


@pytest.mark.parametrize("prompt,kwargs,exc,match", BAD_REQUESTS)
def test_bad_requests_raise_and_lose_nothing(llada_dir, prompt, kwargs, exc, match):
    llm = LLM(llada_dir, decoding="low_confidence")
    good = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(exc, match=match):
        llm.generate([good, prompt], SamplingParams(**{"max_tokens": 8, **kwargs}),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_pages == llm.engine.pool.num_pages
    (out,) = llm.generate([good], SamplingParams(max_tokens=8), use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize("kwargs,match", [(dict(decoding="beam"), "decoding"),
                                          (dict(kv_cache="paged"), "kv_cache"),
                                          (dict(max_num_seqs=0), "max_num_seqs"),
                                          (dict(dtype="int8"), "dtype"),
                                          (dict(load_format="pt"), "load_format")])
def test_bad_engine_config(llada_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(llada_dir, **kwargs)


def test_unknown_model_names_the_choices():
    with pytest.raises(FileNotFoundError, match="cover-tiny"):
        LLM("no/such/model")


def test_mismatched_params_list(llada_dir):
    llm = LLM(llada_dir, decoding="low_confidence")
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=8)], use_tqdm=False)


def test_seeded_sampling_is_reproducible(llada_dir):
    llm = LLM(llada_dir, decoding="low_confidence")
    p = SamplingParams(max_tokens=16, block_length=8, temperature=1.0, seed=7)
    a = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, block_length=8),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and a != greedy
    assert torch.tensor(a).lt(300).all()


@pytest.mark.parametrize("decoding", ["low_confidence", "threshold", "cover", "saber", "wino"])
def test_mask_is_never_proposed_even_when_it_is_the_argmax(llada_dir, decoding):
    """A model whose favourite token is [MASK] must still finish (no endless block)."""
    llm = LLM(llada_dir, decoding=decoding)
    model = llm.engine.executor.model
    with torch.no_grad():
        model.model.transformer.ff_out.weight[llm.engine.spec.mask_token_id] = \
            model.model.transformer.ff_out.weight.abs().max(dim=0).values * 50
        canvas = torch.tensor([[1, 2, 3] + [llm.engine.spec.mask_token_id] * 16])
        assert (model(canvas).argmax(-1) == llm.engine.spec.mask_token_id).float().mean() > 0.5
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, block_length=8,
                                                      ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 16
    assert llm.engine.spec.mask_token_id not in out.outputs[0].token_ids


def test_replica_step_limit_holds_requests_until_lifted(llada_dir):
    from cover_vllm.entrypoints.server.dp_replica import EngineReplica

    replica = EngineReplica(EngineConfig(model=llada_dir, decoding="low_confidence"), 0)
    try:
        with pytest.raises(ValueError, match="steps"):
            replica.limit_steps(-1)
        replica.limit_steps(3)
        replica.add_request("r", [5, 6, 7], SamplingParams(max_tokens=16, block_length=8,
                                                            ignore_eos=True))
        deadline = time.monotonic() + 30
        while not replica.stats()["held"]:
            assert time.monotonic() < deadline, "the replica never held"
            time.sleep(0.01)
        assert replica.poll(0.0)[0] == []           # 3 steps: no block finished yet
        assert replica.stats()["running"] == 1
        replica.limit_steps(None)
        outs, handled = [], 0
        while not (outs and outs[-1][2].finished):
            assert time.monotonic() < deadline, "the request never finished"
            new = replica.poll(1.0, handled)[0]
            if new:
                last_batch, last_after, handled = new, handled, new[-1][0]
                outs += new
        assert [n for n, _, _ in outs] == list(range(1, len(outs) + 1))
        assert len(outs[-1][2].outputs[0].token_ids) == 16
        assert replica.poll(0.0, last_after)[0] == last_batch    # not acknowledged: sent again
        assert replica.poll(0.0, handled)[0] == []               # acknowledged: dropped
    finally:
        replica.shutdown()


def test_replica_fails_only_the_request_its_steps_fail_on(llada_dir):
    """A DP replica follows the server's failure rule (engine/driver.py): the failed batch is
    replayed in halves and only the request that fails alone gets the error."""
    from cover_vllm.entrypoints.server.dp_replica import EngineReplica

    replica = EngineReplica(EngineConfig(model=llada_dir, decoding="low_confidence"), 0)
    real = replica.engine.executor.execute_model

    def execute(out):
        if any(item.request_id == "poisoned" for item in out.items):
            raise RuntimeError("injected fault")
        return real(out)

    replica.engine.executor.execute_model = execute
    params = SamplingParams(max_tokens=8, block_length=8, ignore_eos=True)
    try:
        replica.limit_steps(0)                       # all three join the same first batch
        for rid in ("a", "poisoned", "b"):
            replica.add_request(rid, [5, 6, 7], params)
        replica.limit_steps(None)
        final, handled, deadline = {}, 0, time.monotonic() + 30
        while len(final) < 3:
            assert time.monotonic() < deadline, f"only {sorted(final)} ended"
            for number, rid, item in replica.poll(1.0, handled)[0]:
                handled = number
                if isinstance(item, str) or item.finished:
                    final[rid] = item
        assert "injected fault" in final["poisoned"]
        assert all(len(final[r].outputs[0].token_ids) == 8 for r in ("a", "b"))
        assert replica.driver.num_failed_steps >= 1 and replica.stats()["fatal"] is None
    finally:
        replica.shutdown()


def test_steps_beyond_max_tokens_are_fine_where_they_size_a_time_grid(dream_dir):
    out = LLM(dream_dir, decoding="saber").generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8, steps=512), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 8


def test_weightless_builtin_shape_is_refused_before_building_the_model():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM("llada-8b", dtype="bfloat16")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000   # KiB


def test_default_sampling_params_take_the_checkpoint_generation_length(llada_dir):
    assert LLM("cover-tiny", kv_cache="none").get_default_sampling_params().max_tokens == 32
    llm = LLM(llada_dir)            # no generation_config.json: SamplingParams' own default
    assert llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    out = LLM("cover-tiny", kv_cache="none").generate({"prompt_token_ids": [5, 6]},
                                                      use_tqdm=False)
    assert out[0].metrics.decoded_tokens == 32      # one block of the 32 declared slots
