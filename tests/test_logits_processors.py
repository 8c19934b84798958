"""vLLM's sampling fields on real requests (cover-tiny, #41): each implemented one has its effect
(min_tokens, the three penalties, min_p, skip_special_tokens, include_stop_str_in_output,
detokenize), and a request using them leaves its batch neighbours' tokens as they were."""

import pytest

from cover_vllm import LLM, SamplingParams

ADD = [{"role": "user", "content": "384+250="}]
ANSWER = "0+4+0=04\n5+8+0=13\n3+2+1=06\n=634"        # 32 tokens with its EOS
EOS = 1
NOISE = {"prompt_token_ids": [5, 6, 7, 8]}            # no task prompt: a flat distribution


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("cover-tiny", num_threads=1)


def _out(llm: LLM, prompt, **params):
    if isinstance(prompt, list):
        return llm.chat(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_min_tokens_keeps_eos_out_of_the_first_k_tokens(llm):
    """The worked answer ends on EOS as its 32nd token; min_tokens=32 bans EOS there."""
    base = _out(llm, ADD, max_tokens=32)
    assert base.text == ANSWER and base.finish_reason == "stop" and base.token_ids[-1] == EOS
    out = _out(llm, ADD, max_tokens=32, min_tokens=32)
    assert EOS not in out.token_ids and out.finish_reason == "length"
    longer = _out(llm, ADD, max_tokens=48, min_tokens=40)
    assert EOS not in longer.token_ids[:40] and len(longer.token_ids) > 40


def test_min_tokens_bans_stop_token_ids_too(llm):
    newline = llm.get_tokenizer().encode("\n", add_special_tokens=False)[0]
    stopped = _out(llm, ADD, max_tokens=32, stop_token_ids=[newline])
    assert len(stopped.token_ids) == 9 and stopped.stop_reason == newline
    late = _out(llm, ADD, max_tokens=32, stop_token_ids=[newline], min_tokens=12)
    assert newline not in late.token_ids[:12]


def test_a_large_repetition_penalty_changes_the_tokens(llm):
    out = _out(llm, ADD, max_tokens=32, repetition_penalty=5.0)
    assert out.text != ANSWER


def test_frequency_penalty_changes_the_tokens(llm):
    assert _out(llm, ADD, max_tokens=32, frequency_penalty=2.0).text != ANSWER


def test_presence_penalty_changes_the_tokens(llm):
    base = _out(llm, NOISE, max_tokens=16, decoding="low_confidence")
    assert _out(llm, NOISE, max_tokens=16, decoding="low_confidence",
                presence_penalty=2.0).token_ids != base.token_ids


@pytest.mark.parametrize("decoding", ["low_confidence", "cover"])
def test_min_p_one_leaves_only_the_top_token_so_temperature_draws_nothing(llm, decoding):
    """At temperature 1 different seeds sample different tokens; with min_p=1.0 only each
    row's most likely token survives, so every seed gives the min_p=1.0 greedy output."""
    hot = [_out(llm, NOISE, max_tokens=16, decoding=decoding, temperature=1.0, seed=s).token_ids
           for s in range(3)]
    assert len({tuple(t) for t in hot}) > 1
    greedy = _out(llm, NOISE, max_tokens=16, decoding=decoding, min_p=1.0).token_ids
    for s in range(3):
        assert _out(llm, NOISE, max_tokens=16, decoding=decoding, temperature=1.0, seed=s,
                    min_p=1.0).token_ids == greedy


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    """With ignore_eos the canvas's EOS padding stays in the output: skipped from the text by
    default, kept with skip_special_tokens=False."""
    kept = _out(llm, ADD, max_tokens=40, ignore_eos=True, skip_special_tokens=False)
    skipped = _out(llm, ADD, max_tokens=40, ignore_eos=True)
    assert EOS in kept.token_ids and kept.token_ids == skipped.token_ids
    assert "<|endoftext|>" in kept.text and "<|endoftext|>" not in skipped.text


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    cut = _out(llm, ADD, max_tokens=32, stop=["=13"])
    kept = _out(llm, ADD, max_tokens=32, stop=["=13"], include_stop_str_in_output=True)
    assert cut.text == "0+4+0=04\n5+8+0" and kept.text == "0+4+0=04\n5+8+0=13"
    assert kept.stop_reason == cut.stop_reason == "=13"
    assert len(kept.token_ids) > len(cut.token_ids)


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(llm):
    newline = llm.get_tokenizer().encode("\n", add_special_tokens=False)[0]
    out = _out(llm, ADD, max_tokens=32, stop_token_ids=[newline],
               include_stop_str_in_output=True)
    assert out.text == "0+4+0=04\n"


def test_detokenize_false_gives_token_ids_and_no_text(llm):
    out = _out(llm, ADD, max_tokens=32, detokenize=False)
    base = _out(llm, ADD, max_tokens=32)
    assert out.text == "" and out.token_ids == base.token_ids


def test_logprobs_stay_the_models_own_under_the_processors(llm):
    """logprobs report the raw distribution (vLLM's default): with min_p=1.0 the decoder sees
    one finite logit per row, yet every reported alternative is finite and the chosen tokens
    are not all certain."""
    out = _out(llm, NOISE, max_tokens=16, min_p=1.0, logprobs=3)
    assert all(len(d) >= 3 and all(v.logprob > float("-inf") for v in d.values())
               for d in out.logprobs)
    assert min(d[t].logprob for d, t in zip(out.logprobs, out.token_ids)) < -1e-3


def test_prompt_logprobs_score_each_prompt_token_given_the_ones_before_it(llm):
    """vLLM's prompt_logprobs: None first, then each prompt token with the k most likely
    tokens there; the values are the exact one-token likelihoods LLM.loglikelihood gives."""
    from cover_vllm import LoglikelihoodParams

    out = llm.chat(ADD, SamplingParams(max_tokens=32, prompt_logprobs=2), use_tqdm=False)[0]
    ids, entries = out.prompt_token_ids, out.prompt_logprobs
    assert out.outputs[0].text == ANSWER and entries[0] is None and len(entries) == len(ids)
    pairs = [{"context_token_ids": ids[:i], "continuation_token_ids": [ids[i]]}
             for i in range(1, len(ids))]
    exact = llm.loglikelihood(pairs, LoglikelihoodParams(mc_num=1, batch_size=1),
                              use_tqdm=False)
    for token, entry, ref in zip(ids[1:], entries[1:], exact):
        assert abs(entry[token].logprob - ref.logprob) < 1e-4
        ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank)
        assert [r for r, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
    assert llm.generate(NOISE, SamplingParams(max_tokens=4), use_tqdm=False)[0] \
        .prompt_logprobs is None


def test_a_processed_request_leaves_its_neighbours_tokens_alone(llm):
    plain = SamplingParams(max_tokens=32)
    alone = llm.chat(ADD, plain, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.chat([ADD, ADD], [SamplingParams(max_tokens=32, repetition_penalty=3.0,
                                                 min_p=0.3, min_tokens=20), plain],
                     use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert batch[0].outputs[0].token_ids != alone


def test_the_server_takes_the_same_fields_and_refuses_the_same_way():
    """The completions body maps the penalties and vLLM's extra fields onto SamplingParams;
    an out-of-range value and a refused field are 400s naming the field."""
    pytest.importorskip("fastapi")
    import httpx

    from serve_helpers import start_server

    server = start_server("cover-tiny", decoding="cover", num_threads=1)
    prompt = "<|user|>384+250=<|assistant|>"
    try:
        def post(**body):
            body = {"model": "test-model", "prompt": prompt, "max_tokens": 32, **body}
            return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()

        assert post()["choices"][0]["text"] == ANSWER
        assert post(min_tokens=32)["choices"][0]["finish_reason"] == "length"
        kept = post(stop=["=13"], include_stop_str_in_output=True)["choices"][0]["text"]
        assert kept == "0+4+0=04\n5+8+0=13"
        assert post(frequency_penalty=2.0)["choices"][0]["text"] != ANSWER
        bad = post(presence_penalty=3.0)["error"]
        assert bad["param"] == "presence_penalty" and "[-2.0, 2.0]" in bad["message"]
        refused = post(logit_bias={"5": 1.0})["error"]
        assert "logit_bias" in refused["message"] and "structured_outputs" in refused["message"]
    finally:
        server.stop()
