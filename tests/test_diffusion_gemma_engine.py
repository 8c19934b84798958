"""DiffusionGemma through the engine (issue 32, phase 2): uniform-state canvases, the
`diffusion_gemma` decoder, and what a user gets around them.

* The slow reference (tests/dg_reference.py, a plain loop over the dense forward written from the
  golden README) reproduces every engine-comparable golden case, step by step through its trace.
* `LLM(...)` reproduces every such case token- and NFE-exact with its seed, alone, with all cases
  of the same max_new_tokens in one call, and all of them in one call; also with prompts encoded
  in chunks and sliding-window rings small enough to wrap, and against the reference on requests
  the golden set does not have.
* Continuous batching (requests joining and aborted mid-flight), tensor parallelism, the KV
  plan of the released shape and the sampler's one code path on every device. What a request
  can ask for and every refusal: test_diffusion_gemma_requests.py.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.models.loader import load_model
from dg_reference import LOGIT_TOL, reference_generate
from golden_cases import GOLDEN, load_cases

DIR = GOLDEN / "diffusion_gemma"
CASES = load_cases("diffusion_gemma", ("DiffusionGemmaGenerationMixin.generate",))
COMPARABLE = [c for c in CASES if c["engine_comparable"]]
IDS = [c["name"] for c in COMPARABLE]


def dg_params(case: dict, **changes) -> SamplingParams:
    """The engine request equivalent to the case's generate call, seeded as it was."""
    p = case["params"]
    knobs = {"max_denoising_steps": p["max_denoising_steps"],
             "entropy_bound": p["sampler_config"]["entropy_bound"], "t_min": p["t_min"],
             "t_max": p["t_max"], "stability_threshold": p["stability_threshold"],
             "confidence_threshold": p["confidence_threshold"]}
    return SamplingParams(**{"max_tokens": p["max_new_tokens"], "seed": case["seed"],
                             "decoding_params": knobs, **changes})


def expected(case: dict) -> list[int]:
    """The golden tokens up to and including the first EOS, at most max_new_tokens."""
    tokens, eos = case["new_tokens"][0], case["eos_index"][0]
    return (tokens if eos is None else tokens[:eos + 1])[:case["params"]["max_new_tokens"]]


def prompt(case: dict) -> dict:
    return {"prompt_token_ids": case["prompt_ids"][0]}


def check(outs, cases) -> None:
    for out, case in zip(outs, cases, strict=True):
        assert out.outputs[0].token_ids == expected(case), case["name"]
        assert out.metrics.nfe == case["nfe"], case["name"]
        finish = "stop" if case["eos_index"][0] is not None else "length"
        assert out.outputs[0].finish_reason == finish, case["name"]


@pytest.fixture(scope="module")
def model():
    return load_model(DIR / "model")


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DIR / "model"), num_threads=1)


# ---- the slow reference ----------------------------------------------------------------------
@pytest.mark.parametrize("case", COMPARABLE, ids=IDS)
def test_the_reference_reproduces_the_golden_trace(model, case):
    """Every draw and decision of every step: the initial canvas, the canvas fed, the sample,
    the accepted set, the renoise draw and the argmax (what the README says an engine can be
    compared on, step by step)."""
    ref = reference_generate(model, case["prompt_ids"][0], case["params"], case["seed"])
    assert ref.new_tokens == expected(case) or ref.new_tokens[:len(expected(case))] == \
        expected(case)
    assert ref.nfe == case["nfe"]
    assert [len(s) for s in ref.steps] == case["steps_per_canvas"]
    for canvas, steps, initial in zip(case["trace"], ref.steps, ref.initial, strict=True):
        assert canvas["initial_canvas"][0] == initial
        for want, got in zip(canvas["steps"], steps, strict=True):
            for name in ("decoder_input_ids", "sample", "accepted", "renoise", "argmax"):
                assert want[name][0] == getattr(got, name), (case["name"], name)
            # The logged entropy inherits the forward's error: the golden logits' bar
            # (LOGIT_TOL) times the entropy's first-order slope, plus fp32 rounding of the sum.
            # A fixed rel_tol of 1e-4 failed on a Xeon with AMX (1.16e-4 at H = 0.0127, where
            # the bound is 1.4e-5); measured on an AMD EPYC, the errors imply logit errors of
            # at most 1.03e-5 (2026-11-27).
            tol = LOGIT_TOL * got.entropy_slope + 1e-6
            assert abs(want["mean_entropy"][0] - got.mean_entropy) <= tol, (case["name"], tol)


# ---- the engine on the golden cases ----------------------------------------------------------
@pytest.mark.parametrize("case", COMPARABLE, ids=IDS)
def test_golden_case_alone(llm, case):
    check(llm.generate([prompt(case)], dg_params(case), use_tqdm=False), [case])


def test_golden_cases_of_one_length_in_one_call(llm):
    groups = defaultdict(list)
    for case in COMPARABLE:
        groups[case["params"]["max_new_tokens"]].append(case)
    assert sorted(groups) == [16, 20, 32, 48]
    for cases in groups.values():
        check(llm.generate([prompt(c) for c in cases], [dg_params(c) for c in cases],
                           use_tqdm=False), cases)


def test_every_golden_case_in_one_call(llm):
    """18 requests of 1 to 3 canvases, different knobs, stopping at different steps: each
    request joins and leaves the batch on its own schedule."""
    check(llm.generate([prompt(c) for c in COMPARABLE], [dg_params(c) for c in COMPARABLE],
                       use_tqdm=False), COMPARABLE)


def test_chunked_prompts_and_wrapping_rings(monkeypatch):
    """Encoder chunks of one canvas (16 tokens) and rings of window - 1 + 16 = 23 slots: the
    17- to 21-token prompts are encoded in two calls and every ring wraps around (positions up
    to 69); the tokens are the golden ones."""
    monkeypatch.setattr("cover_vllm.worker.kv_cache.MIN_ENCODE_CHUNK", 1)
    small = LLM(str(DIR / "model"), num_threads=1, page_size=4)
    assert small.engine.memory.ring_len == 23
    long = [c for c in COMPARABLE if len(c["prompt_ids"][0]) > 16]
    assert len(long) >= 4
    check(small.generate([prompt(c) for c in COMPARABLE], [dg_params(c) for c in COMPARABLE],
                         use_tqdm=False), COMPARABLE)


def test_the_released_config_form_generates_the_same(tmp_path):
    """config.json as the released checkpoint writes it (`global_head_dim`,
    `num_global_key_value_heads`; the hidden set's form) with generation_config.json: the
    engine's per-layer pools and rings follow it, and every comparable case is exact."""
    from test_diffusion_gemma import released_form

    config = json.loads((DIR / "model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(released_form(config)))
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copy(DIR / "model" / name, tmp_path)
    released = LLM(str(tmp_path), num_threads=1)
    assert released.engine.spec.hf_config.get("per_layer_config") is None
    check(released.generate([prompt(c) for c in COMPARABLE], [dg_params(c) for c in COMPARABLE],
                            use_tqdm=False), COMPARABLE)


def test_engine_equals_the_reference_on_other_requests(llm, model):
    """Prompts and settings the golden set does not have (a prompt over three windows, 1 to 4
    canvases, hot and cold schedules), batched, against the slow reference one by one."""
    gen = torch.Generator().manual_seed(7)
    requests = []
    for i, (length, tokens, steps, t_min, t_max, bound) in enumerate(
            [(3, 16, 6, 0.4, 0.8, 0.1), (25, 64, 5, 0.2, 0.6, 0.5), (9, 40, 4, 0.9, 1.2, 2.0),
             (1, 30, 7, 0.3, 0.5, 0.3)]):
        ids = torch.randint(3, 290, (length,), generator=gen).tolist()
        params = {"max_new_tokens": tokens, "max_denoising_steps": steps,
                  "sampler_config": {"entropy_bound": bound}, "t_min": t_min, "t_max": t_max,
                  "stability_threshold": 1, "confidence_threshold": 0.01}
        requests.append(({"prompt_ids": [ids], "params": params, "seed": 100 + i}))
    outs = llm.generate([prompt(r) for r in requests], [dg_params(r) for r in requests],
                        use_tqdm=False)
    for out, req in zip(outs, requests):
        ref = reference_generate(model, req["prompt_ids"][0], req["params"], req["seed"])
        assert out.outputs[0].token_ids == ref.new_tokens[:req["params"]["max_new_tokens"]]
        assert out.metrics.nfe == ref.nfe


def test_continuous_batching_with_arrivals_and_aborts(llm):
    """Requests join while others are mid-canvas, one is aborted mid-flight: every finished
    request has its golden tokens and NFE, and the engine ends empty (pages, rings freed)."""
    engine = llm.engine
    free_pages, free_rings = engine.num_free_pages, len(engine.scheduler.canvases.free_rings)
    cases = COMPARABLE[:6]
    done = {}
    engine.add_request("victim", prompt(cases[0]), dg_params(cases[0]))
    for step in range(200):
        if step < len(cases):
            engine.add_request(cases[step]["name"], prompt(cases[step]), dg_params(cases[step]))
        if step == 3:
            engine.abort_request("victim")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert "victim" not in done and sorted(done) == sorted(c["name"] for c in cases)
    check([done[c["name"]] for c in cases], cases)
    assert engine.num_free_pages == free_pages
    assert len(engine.scheduler.canvases.free_rings) == free_rings


# ---- tensor parallelism --------------------------------------------------------------------
def test_tensor_parallel_2_equals_1_on_the_golden_generate_cases(llm):
    """TP=2 (mp ranks, fp32): q heads and the sliding layers' kv heads split, the full layer's
    single kv head copied, experts split; each rank keeps its own self-conditioning logits.
    Every comparable golden case in one call: the golden tokens and NFE, as TP=1."""
    sharded = LLM(str(DIR / "model"), tensor_parallel_size=2, num_threads=1)
    try:
        outs = sharded.generate([prompt(c) for c in COMPARABLE],
                                [dg_params(c) for c in COMPARABLE], use_tqdm=False)
        check(outs, COMPARABLE)
        single = llm.generate([prompt(c) for c in COMPARABLE],
                              [dg_params(c, logprobs=2) for c in COMPARABLE], use_tqdm=False)
        both = sharded.generate([prompt(c) for c in COMPARABLE[:4]],
                                [dg_params(c, logprobs=2) for c in COMPARABLE[:4]],
                                use_tqdm=False)
        for a, b in zip(single, both):
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    finally:
        sharded.shutdown()


# ---- the KV plan and the device path ---------------------------------------------------------
def test_the_released_shape_plans_pages_and_a_ring_per_sequence():
    """26B-A4B (int4, meta: nothing allocated): full layers 5 x 2 kv heads x 512 in pages
    (20 KiB a position in bf16), the 25 sliding layers in rings of 1023 + 256 slots (200 KiB a
    slot): a 1.3 GB budget holds 4 rings beside the pages of 4 1024-token sequences."""
    from cover_vllm.worker.kv_cache import KVLayout

    llm = LLM("diffusion-gemma-26b-a4b", load_format="dummy", device="meta",
              quantization="int4", kv_cache_memory_bytes=1_300_000_000, num_threads=1)
    plan = llm.engine.memory
    assert plan.kv_bytes_per_token == 5 * 2 * 2 * 512 * 2
    assert (plan.ring_len, plan.num_rings) == (1279, 4)
    layout = KVLayout.of(llm.engine.executor.model)
    assert layout.ring_bytes(torch.bfloat16) == 25 * 2 * 8 * 256 * 2 * 1279
    assert plan.num_pages * 16 * plan.kv_bytes_per_token + 4 * layout.ring_bytes(
        torch.bfloat16) <= 1_300_000_000
    assert plan.num_pages * 16 >= 4 * 1024 and plan.canvases == 4
    assert len(llm.engine.scheduler.canvases.free_rings) == 4


def test_the_sampler_has_one_code_path_on_every_device(llm):
    """The decoder never branches on the device (no compact CPU rows: every [C, V] row of a
    canvas is read on any device), so the device path is the CPU path: under `dense_rows` the
    same tokens, NFE and logprobs."""
    from cover_vllm.strategies.sampling import dense_rows

    cases = COMPARABLE[:5]
    params = [dg_params(c, logprobs=2) for c in cases]
    want = llm.generate([prompt(c) for c in cases], params, use_tqdm=False)
    with dense_rows():
        got = llm.generate([prompt(c) for c in cases], params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.metrics.nfe == b.metrics.nfe and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_bf16_against_fp32():
    """bf16 (measured on the six golden forward calls: mean |d| 0.021-0.055 fp32 logit standard
    deviations, argmax agreement 0.875-0.979; the maximum is not bounded: as LLaDA-MoE's, a token
    whose router scores nearly tie picks other experts in bf16; this random checkpoint's sharp
    attention, scale 1.0 with unit-free q/k norms, makes it the least forgiving golden model),
    and the engine generating in bf16 through the paged route and the packed bf16 kernels:
    its first decoder step's logits equal the dense bf16 forward's."""
    from safetensors.torch import load_file

    from test_diffusion_gemma import golden_calls

    golden = load_file(str(DIR / "forward.safetensors"))
    full, half = load_model(DIR / "model"), load_model(DIR / "model", dtype="bfloat16")
    for name, call in golden_calls(golden).items():
        low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in call.items()}
        with torch.no_grad():
            a, b = full(**call), half(**low).float()
        diff = (a - b).abs()
        assert diff.mean() <= 0.06 * a.std(), name
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85, name
    llm = LLM(str(DIR / "model"), dtype="bfloat16", num_threads=1)
    case = COMPARABLE[0]
    captured = []
    runner = llm.engine.executor.runner.canvas
    real = runner._decode

    def spy(items):
        out = real(items)
        captured.append([None if t is None else t.clone() for t in out[0]])
        return out
    runner._decode = spy
    (out,) = llm.generate([prompt(case)], dg_params(case), use_tqdm=False)
    assert out.metrics.nfe >= 1 and len(out.outputs[0].token_ids) == 16
    ids = torch.tensor([case["prompt_ids"][0]])
    temperature = 0.8                                   # the first step's: t_max
    canvas = torch.tensor(case["trace"][0]["initial_canvas"])      # the seed's first draw
    with torch.no_grad():
        dense = half(input_ids=ids, decoder_input_ids=canvas).float()
    first = captured[0][0] * temperature
    assert (first - dense[0]).abs().max() <= 1e-4       # measured 1e-6: x 0.8 / 0.8 rounding
