"""vLLM's SamplingParams surface (#41): every field constructs at vLLM's default, a value this
engine cannot honour is a ValueError naming the field, decoders and their knobs are checked on
construction, and the logits processors compute what vLLM defines (checked against a direct
formula on hand-made logits; their effect on real requests: test_logits_processors.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

from cover_vllm import SamplingParams, StructuredOutputsParams
from cover_vllm.engine.logits_processors import process_logits

# vLLM's SamplingParams fields at vLLM's defaults (max_tokens and temperature keep this engine's
# own defaults; vLLM's 16 and 1.0 are valid values here too; top_k 0 is vLLM's "off", as -1)
VLLM_DEFAULTS = dict(
    n=1, best_of=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
    temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=None, stop_token_ids=None,
    bad_words=None, ignore_eos=False, max_tokens=16, min_tokens=0, logprobs=None,
    prompt_logprobs=None, detokenize=True, skip_special_tokens=True,
    spaces_between_special_tokens=True, logits_processors=None,
    include_stop_str_in_output=False, truncate_prompt_tokens=None, output_kind=None,
    guided_decoding=None, structured_outputs=None, logit_bias=None, allowed_token_ids=None,
    extra_args=None, flat_logprobs=False, logprob_token_ids=None, prompt_logprob_token_ids=None,
    prompt_logprob_start=None, stream_interval=None, thinking_token_budget=None,
    repetition_detection=None, trace_decode_token_ids=None, routed_experts_prompt_start=0,
    skip_clone=False, skip_reading_prefix_cache=None)


def test_every_vllm_field_constructs_at_its_default():
    params = SamplingParams(**VLLM_DEFAULTS)
    assert params.stop == [] and params.stop_token_ids == []
    assert params.top_k == -1                       # 0 means off, as in vLLM
    assert SamplingParams(output_kind="final_only").output_kind == "final_only"


@pytest.mark.parametrize("field,value", [
    ("best_of", 2), ("bad_words", ["x"]),
    ("spaces_between_special_tokens", False), ("logits_processors", [lambda ids, x: x]),
    ("truncate_prompt_tokens", 8), ("output_kind", "delta"), ("logit_bias", {5: 1.0}),
    ("allowed_token_ids", [5, 6]), ("extra_args", {"k": 1}), ("flat_logprobs", True),
    ("logprob_token_ids", [5]), ("prompt_logprob_token_ids", [5]), ("prompt_logprob_start", 3),
    ("stream_interval", 4), ("thinking_token_budget", 64), ("repetition_detection", {"x": 1}),
    ("trace_decode_token_ids", [5]), ("routed_experts_prompt_start", 2)])
def test_a_refused_field_names_itself_and_the_reason(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*is not supported: \w+"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs,words", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2.0, 2.0]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in"),
    (dict(frequency_penalty="1"), "frequency_penalty must be a finite number"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(min_tokens=-1), "min_tokens must be an int from 0 to max_tokens"),
    (dict(min_tokens=20, max_tokens=16), "min_tokens must be an int from 0 to max_tokens (16)"),
    (dict(skip_special_tokens=0), "skip_special_tokens must be a bool"),
    (dict(detokenize=False, stop=["\n"]), "stop strings need detokenize=True"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be None (off) or an int from 0 to 20"),
])
def test_out_of_range_values_name_the_field(kwargs, words):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert words in str(exc.value)


def test_an_unknown_decoder_is_refused_on_construction_with_the_valid_names():
    with pytest.raises(ValueError, match=r"decoding='beam'.*valid: \[.*'cover'.*'threshold'"):
        SamplingParams(decoding="beam")


def test_a_bad_decoder_knob_is_refused_on_construction():
    with pytest.raises(ValueError, match=r"decoding_params \['bogus'\] not valid for "
                                         r"'threshold'; allowed: \['threshold'\]"):
        SamplingParams(decoding="threshold", decoding_params={"bogus": 1})
    with pytest.raises(ValueError, match="decoding_params.threshold"):
        SamplingParams(decoding="threshold", decoding_params={"threshold": "high"})
    assert SamplingParams(decoding="threshold", decoding_params={"threshold": 0.8}).decoding


def test_guided_decoding_is_structured_outputs_under_its_older_name():
    params = SamplingParams(guided_decoding={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    assert params.guided_decoding is None
    old = SimpleNamespace(regex=None, json=None, choice=["a", "b"], grammar=None)
    assert SamplingParams(guided_decoding=old).structured_outputs.choice == ["a", "b"]
    with pytest.raises(ValueError, match="structured_outputs or guided_decoding"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})


def test_the_uniform_state_decoder_refuses_the_logits_processors():
    from cover_vllm.strategies.diffusion_gemma import DiffusionGemmaDecoder

    with pytest.raises(ValueError, match=r"\['min_tokens'\] are not used by decoding="
                                         r"'diffusion_gemma'"):
        DiffusionGemmaDecoder.check_request(None, SamplingParams(min_tokens=2))


# ---- the processors on hand-made logits ------------------------------------------------------
MASK, EOS, VOCAB = 9, 1, 10


def _request(prompt: list[int], gen: list[int], **params) -> SimpleNamespace:
    """What process_logits reads of a Request: canvas, prompt_len, gen_end, mask_id, params,
    strategy.spec.eos_token_ids."""
    canvas = torch.tensor(prompt + gen)
    p = SamplingParams(max_tokens=len(gen), **params)
    spec = SimpleNamespace(eos_token_ids=(EOS,))
    return SimpleNamespace(canvas=canvas, prompt_len=len(prompt), gen_end=len(canvas),
                           mask_id=MASK, params=p, strategy=SimpleNamespace(spec=spec))


def _logits(n: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, VOCAB, generator=g) * 3


def test_default_params_leave_the_logits_untouched():
    logits = _logits(2, 4)
    before = logits.clone()
    reqs = [_request([2, 3], [MASK] * 4), _request([4], [5, MASK, MASK, MASK])]
    assert process_logits(logits, reqs, [2, 1]) == {}
    assert torch.equal(logits, before)


def test_penalties_match_vllms_formulas_over_the_visible_canvas():
    """repetition over prompt + shown output tokens; frequency / presence over the shown output
    counts; [MASK] and EOS slots are not counted. Row 1 (defaults) is left alone."""
    prompt, gen = [2, 3], [4, 4, MASK, EOS, 5]
    knobs = dict(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.25)
    reqs = [_request(prompt, gen, **knobs), _request(prompt, gen)]
    logits = _logits(2, 5)
    before = logits.clone()
    process_logits(logits, reqs, [2, 2])
    counts = torch.zeros(VOCAB)
    counts[4], counts[5] = 2, 1
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[[2, 3, 4, 5]] = True
    x = before[0]
    want = torch.where(seen, torch.where(x > 0, x / 1.7, x * 1.7), x)
    want = want - 0.5 * counts - 0.25 * (counts > 0).float()
    torch.testing.assert_close(logits[0], want)
    assert torch.equal(logits[1], before[1])


def test_min_tokens_bans_eos_and_stop_ids_at_the_first_slots_only():
    prompt = [2, 3, 4]
    req = _request(prompt, [MASK] * 6, min_tokens=2, stop_token_ids=[7])
    logits = _logits(1, 5)
    before = logits.clone()
    process_logits(logits, [req], [2])          # view rows = canvas positions 2..6
    # position 2 is the prompt, 3 and 4 are slots 0 and 1, 5 and 6 slots 2 and 3
    for row, banned in ((0, False), (1, True), (2, True), (3, False), (4, False)):
        for t in (EOS, 7):
            assert (logits[0, row, t] == -math.inf) == banned, (row, t)
    others = [t for t in range(VOCAB) if t not in (EOS, 7)]
    assert torch.equal(logits[0][:, others], before[0][:, others])
    ignore = _request(prompt, [MASK] * 6, min_tokens=2, ignore_eos=True)
    logits = _logits(1, 5)
    process_logits(logits, [ignore], [2])
    assert torch.isfinite(logits[0, :, EOS]).all()       # ignore_eos: EOS is no stop token


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_min_p_drops_tokens_below_its_share_of_the_top_probability(temperature):
    req = _request([2], [MASK] * 3, min_p=0.2, temperature=temperature)
    logits = _logits(1, 3)
    before = logits.clone()
    process_logits(logits, [req], [0])
    t = temperature or 1.0
    probs = torch.softmax(before[0] / t, dim=-1)
    dropped = probs < 0.2 * probs.max(dim=-1, keepdim=True).values
    assert torch.equal(torch.isinf(logits[0]), dropped)
    assert torch.equal(logits[0][~dropped], before[0][~dropped])


def test_logprobs_read_the_logits_before_the_processors():
    req = _request([2], [MASK] * 3, min_p=0.5, logprobs=1)
    logits = _logits(1, 3)
    before = logits.clone()
    raw = process_logits(logits, [req], [0])
    assert torch.equal(raw[0], before[0]) and not torch.equal(logits, before)
