"""DiffusionGemma through the engine (issue 32, phase 2): what a request can ask for (n,
logprobs from each canvas's final step, stop ids, ignore_eos, metrics, the decoder's defaults
from generation_config.json) and every refusal (knobs that mean nothing here, bad decoder knobs,
masked decoders, structured outputs, likelihood scoring, too long for the model).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from cover_vllm import LLM, LoglikelihoodParams, SamplingParams
from cover_vllm.sampling_params import StructuredOutputsParams
from dg_reference import reference_generate
from test_diffusion_gemma_engine import (COMPARABLE, DIR, dg_params, expected, llm,  # noqa: F401
                                         model, prompt)

# ---- what a request can ask for ------------------------------------------------------------
def test_n_children_draw_from_seed_plus_i(llm):
    case = COMPARABLE[3]
    (out,) = llm.generate([prompt(case)], dg_params(case, n=3), use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == expected(case)
    for i, child in enumerate(out.outputs):
        (alone,) = llm.generate([prompt(case)], dg_params(case, seed=case["seed"] + i),
                                use_tqdm=False)
        assert child.token_ids == alone.outputs[0].token_ids
    assert out.metrics.nfe == sum(
        llm.generate([prompt(case)], dg_params(case, seed=case["seed"] + i),
                     use_tqdm=False)[0].metrics.nfe for i in range(3))


def test_logprobs_come_from_each_canvas_s_final_step(llm, model):
    """Every returned token is its canvas's final argmax, so it is rank 1, and its value and
    the top k are log_softmax of that step's raw logits (as the reference computes them)."""
    case = next(c for c in COMPARABLE if c["name"] == "dg_cold_t0.1-0.3_adaptive")
    (out,) = llm.generate([prompt(case)], dg_params(case, logprobs=3), use_tqdm=False)
    ref = reference_generate(model, case["prompt_ids"][0], case["params"], case["seed"])
    comp = out.outputs[0]
    assert comp.token_ids == expected(case) and len(comp.logprobs) == len(comp.token_ids)
    want = torch.cat([lg.log_softmax(-1) for lg in ref.final_logits])
    for pos, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert entry[token].rank == 1
        top = want[pos].topk(3)
        assert list(entry)[0] == token and set(top.indices.tolist()) <= set(entry)
        for t, lp in entry.items():
            assert abs(lp.logprob - float(want[pos, t])) < 1e-4
    assert comp.cumulative_logprob == pytest.approx(
        sum(float(want[i, t]) for i, t in enumerate(comp.token_ids)), abs=1e-3)
    (plain,) = llm.generate([prompt(case)], dg_params(case), use_tqdm=False)
    assert plain.outputs[0].token_ids == comp.token_ids and plain.outputs[0].logprobs is None


def test_stop_token_ids_end_at_a_finished_canvas(llm):
    """A stop id in canvas 2 of 3: the output ends right after it, canvas 3 never runs."""
    case = next(c for c in COMPARABLE if c["name"] == "dg_bound2_steps12_3canvas")
    tokens = expected(case)
    at = next(i for i in range(16, 32) if tokens[i] not in tokens[:i])    # first new in canvas 2
    stop = tokens[at]
    (out,) = llm.generate([prompt(case)], dg_params(case, stop_token_ids=[stop]),
                          use_tqdm=False)
    comp = out.outputs[0]
    assert comp.token_ids == tokens[:at + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert out.metrics.nfe == 24 and out.metrics.canvases == 2


def test_ignore_eos_runs_every_canvas(llm):
    case = next(c for c in COMPARABLE if c["name"] == "dg_eos_in_canvas2_of3")
    (out,) = llm.generate([prompt(case)], dg_params(case, ignore_eos=True), use_tqdm=False)
    comp = out.outputs[0]
    assert comp.token_ids[:len(expected(case))] == expected(case)
    assert len(comp.token_ids) == 48 and comp.finish_reason == "length"
    assert out.metrics.canvases == 3


def test_metrics_count_canvases_acceptances_and_encoder_flops(llm):
    case = next(c for c in COMPARABLE if c["name"] == "dg_bound2_steps12_3canvas")
    (out,) = llm.generate([prompt(case)], dg_params(case), use_tqdm=False)
    m = out.metrics
    accepted = json.loads(case["accepted_per_step"]) if isinstance(
        case["accepted_per_step"], str) else case["accepted_per_step"]
    assert m.canvases == 3 and m.steps == m.nfe == 36
    assert m.accepted_tokens == sum(step[0] for canvas in accepted for step in canvas)
    assert 0 < m.encoder_flops < m.flops and m.decoded_tokens == 48


def test_generation_config_sets_the_decoder_defaults(tmp_path):
    """A checkpoint's generation_config.json is the decoder's default: 3 steps a canvas, an
    adaptive stop that never fires (confidence 0)."""
    shutil.copytree(DIR / "model", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    config.update(max_denoising_steps=3, confidence_threshold=0.0, max_new_tokens=32)
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path / "m"), num_threads=1)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert out.metrics.nfe == 6 and len(out.outputs[0].token_ids) == 32
    assert llm.engine.config.decoding == "diffusion_gemma"


# ---- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("temperature", 0.7), ("top_p", 0.9), ("top_k", 5),
                                          ("steps", 8), ("block_length", 8),
                                          ("kv_cache", "none"), ("cache_refresh", "adaptive")])
def test_knobs_that_mean_nothing_here_are_refused_by_name(llm, field, value):
    with pytest.raises(ValueError, match=rf"\['{field}'\].*diffusion_gemma"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(**{field: value}),
                     use_tqdm=False)


@pytest.mark.parametrize("knobs, name", [({"t_max": 0}, "t_max"), ({"entropy_bound": -1},
                                         "entropy_bound"), ({"max_denoising_steps": 0},
                                         "max_denoising_steps"), ({"stability_threshold": 1.5},
                                         "stability_threshold"), ({"sampler": 1}, "sampler")])
def test_bad_decoder_knobs_are_refused_by_name(llm, knobs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(decoding_params=knobs),
                     use_tqdm=False)


def test_masked_decoders_and_uniform_state_decoders_stay_with_their_models(llm):
    with pytest.raises(ValueError, match=r"decoding='cover' commits tokens into \[MASK\]"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(decoding="cover"),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="the engine's decoding='low_confidence'"):
        LLM(str(DIR / "model"), decoding="low_confidence")
    tiny = LLM("cover-tiny", num_threads=1)
    assert tiny.engine.config.decoding == "cover"
    with pytest.raises(ValueError, match="diffusion_gemma.*uniform-state.*masked-diffusion"):
        tiny.generate(["hi"], SamplingParams(decoding="diffusion_gemma"), use_tqdm=False)


def test_structured_outputs_and_likelihoods_are_refused_with_the_reason(llm):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(ValueError, match="not supported with a uniform-state decoder.*re-drawn"):
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"no \[MASK\] token.*LoglikelihoodParams"):
        llm.loglikelihood([{"context_token_ids": [5], "continuation_token_ids": [6]}],
                          LoglikelihoodParams())


def test_too_long_for_the_model_is_refused_in_whole_canvases(llm):
    limit = llm.engine.spec.max_model_len
    with pytest.raises(ValueError, match=r"max_tokens \(\d+\) needs \d+ canvases of 16"):
        llm.generate([{"prompt_token_ids": [5] * 10}], SamplingParams(max_tokens=limit - 12),
                     use_tqdm=False)
    ok = dataclasses.replace(SamplingParams(), max_tokens=16)
    assert llm.generate([{"prompt_token_ids": [5] * 10}], ok, use_tqdm=False)[0].finished
