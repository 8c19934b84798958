"""What a vLLM user reads off an output, offline on cover-tiny: `n` outputs per request (the
engine's fan-out, reproducible under a seed), per-token `logprobs` (checked against a dense
reference forward, LLaDA's and Dream's with its logit shift, and against the logits of each
token's final commit under revocable decoders), `stop_reason`, and typed `decoding_params`
errors."""

from __future__ import annotations

import math

import pytest
import torch

from cover_vllm import LLM, Logprob, SamplingParams
from cover_vllm.models import load_model

PROMPT = "what is 1 + 2 ?"
NOISY = dict(max_tokens=16, temperature=2.0, block_length=8)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("cover-tiny", decoding="low_confidence")


def _ids(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


# ---- n ------------------------------------------------------------------------------------
def test_n_gives_n_outputs_reproducible_under_seed(llm) -> None:
    params = SamplingParams(n=3, seed=11, **NOISY)
    first, other = llm.generate([PROMPT, "hello"], params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in first.outputs)
    assert len({tuple(ids) for ids in _ids(first)}) > 1          # sampling: they differ
    (again,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert _ids(again) == _ids(first)                            # same seed, same three
    for i in range(3):                                           # output i draws from seed + i
        (single,) = llm.generate([PROMPT], SamplingParams(seed=11 + i, **NOISY),
                                 use_tqdm=False)
        assert single.outputs[0].token_ids == first.outputs[i].token_ids
        assert single.outputs[0].text == first.outputs[i].text
    assert len(other.outputs) == 3 and other.prompt == "hello"


def test_n_metrics_are_the_children_summed(llm) -> None:
    (out,) = llm.generate([PROMPT], SamplingParams(n=2, seed=5, **NOISY), use_tqdm=False)
    singles = [llm.generate([PROMPT], SamplingParams(seed=5 + i, **NOISY), use_tqdm=False)[0]
               for i in range(2)]
    for name in ("nfe", "steps", "decoded_tokens", "forward_tokens", "refreshes"):
        assert getattr(out.metrics, name) == sum(getattr(s.metrics, name) for s in singles)
    assert out.metrics.tokens_per_step == out.metrics.decoded_tokens / out.metrics.steps


def test_engine_step_reports_children_under_the_parent_id(llm) -> None:
    engine = llm.engine
    engine.add_request("parent", PROMPT, SamplingParams(n=3, seed=1, **NOISY))
    assert engine.running_request_ids() == []
    seen = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert engine.running_request_ids() in ([], ["parent"])
        seen += outs
    assert {o.request_id for o in seen} == {"parent"}
    assert [o.finished for o in seen][-1] and not any(o.finished for o in seen[:-1])
    assert [c.index for c in seen[-1].outputs] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in seen[-1].outputs)
    partial = [o for o in seen if not o.finished]
    assert partial
    for o in partial:                  # the children reported so far, in index order
        indices = [c.index for c in o.outputs]
        assert indices == sorted(set(indices)) and set(indices) <= {0, 1, 2}


def test_abort_parent_aborts_every_child(llm) -> None:
    engine = llm.engine
    total = engine.pool.num_pages
    engine.add_request("p", PROMPT, SamplingParams(n=3, max_tokens=32))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("p", PROMPT, SamplingParams())
    engine.step()
    assert engine.num_free_pages < total
    engine.abort_request("p")
    assert not engine.has_unfinished_requests() and engine.num_free_pages == total
    engine.add_request("q", PROMPT, SamplingParams(n=2, max_tokens=32))
    engine.step()
    engine.abort_request("1_q")                    # a child's id aborts its whole parent
    assert not engine.has_unfinished_requests() and engine.num_free_pages == total
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=4))    # the id is free again
    while engine.has_unfinished_requests():
        engine.step()


def test_one_bad_request_adds_none_of_its_children(llm) -> None:
    good = SamplingParams(n=2, max_tokens=8)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([PROMPT, "hello"], [good, SamplingParams(n=3, stop_token_ids=[10**6])],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_pages == llm.engine.pool.num_pages


def test_a_runaway_n_is_refused_everywhere_with_the_limit_and_the_reason(llm) -> None:
    """n=100000 used to queue 100000 children (minutes at `0/1`, memory growing per child);
    now every way in refuses it as the server does, and queues nothing."""
    words = r"n \(outputs per prompt\) must be an integer from 1 to 64, got 100000: each output"
    with pytest.raises(ValueError, match=words):
        SamplingParams(n=100000)
    assert SamplingParams(n=64).n == 64
    params = SamplingParams(max_tokens=4)
    params.n = 100000                 # a dataclass field reset after validation: caught too
    for call in (lambda: llm.generate([PROMPT], params, use_tqdm=False),
                 lambda: llm.chat([{"role": "user", "content": "1+2="}], params,
                                  use_tqdm=False)):
        with pytest.raises(ValueError, match=words):
            call()
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.num_free_pages == llm.engine.pool.num_pages


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(n=0), ValueError, "n .*1 to 64"), (dict(n=-2), ValueError, "n "),
    (dict(n=2.0), TypeError, "n must be an int"), (dict(logprobs=-1), ValueError, "0"),
    (dict(logprobs=21), ValueError, "20"), (dict(logprobs=True), TypeError, "logprobs")])
def test_bad_n_and_logprobs_say_what_is_allowed(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


# ---- logprobs -----------------------------------------------------------------------------
def _reference_logprobs(model, prompt_ids: list[int], gen: int) -> tuple:
    """LLaDA's dense low-confidence loop (one token per step, one block, temperature 0) that
    records log_softmax of the committing forward's row ([MASK] excluded) per position; Dream's
    row p - 1 predicts position p (its logit shift)."""
    mask_id, shift = model.spec.mask_token_id, model.spec.logit_shift
    canvas = torch.tensor([prompt_ids + [mask_id] * gen])
    rows = {}
    with torch.no_grad():
        for _ in range(gen):
            logits = model(canvas)[0].double()                          # [L, V]
            if shift:
                logits = torch.cat([logits[:1], logits[:-1]])
            logits[:, mask_id] = -math.inf
            lp = logits.log_softmax(-1)
            conf, x0 = lp.max(-1)
            conf[canvas[0] != mask_id] = -math.inf
            pos = int(conf.argmax())
            canvas[0, pos] = x0[pos]
            rows[pos - len(prompt_ids)] = lp[pos]
    return canvas[0, len(prompt_ids):].tolist(), rows


@pytest.mark.parametrize("which", ["cover-tiny", "dream"])
def test_logprobs_match_a_dense_reference_forward(llm, dream_dir, which) -> None:
    k = 4
    params = SamplingParams(max_tokens=16, block_length=16, steps=16, kv_cache="none",
                            logprobs=k, ignore_eos=True)
    path, prompt = (dream_dir, [5, 6, 7, 8]) if which == "dream" else ("cover-tiny", PROMPT)
    engine_llm = llm if which == "cover-tiny" else LLM(dream_dir, decoding="low_confidence")
    (out,) = engine_llm.generate([prompt], params, use_tqdm=False)
    c = out.outputs[0]
    ids, rows = _reference_logprobs(load_model(path), out.prompt_token_ids, 16)
    assert c.token_ids == ids
    assert len(c.logprobs) == len(c.token_ids)
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        ref = rows[i]
        top = ref.topk(k)
        assert list(entry)[0] == token and entry[token].rank == 1    # greedy: the argmax
        assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-4)
        assert set(entry) == set(top.indices.tolist())
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[t].rank == r and entry[t].logprob == pytest.approx(v, abs=1e-4)
        text = None if engine_llm.tokenizer is None else engine_llm.tokenizer.decode([token])
        assert entry[token].decoded_token == text
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                     zip(c.token_ids, c.logprobs)))


class _CommitRecorder:
    """Observer keeping, per step, the request's view rows (as its strategy saw them) and its
    canvas before and after: the slow way to find each token's final commit."""

    def __init__(self, engine, request_id: str):
        self.engine, self.request_id, self.steps = engine, request_id, []

    def on_schedule(self, out) -> None:
        (item,) = out.items
        self.req = self.engine._requests[self.request_id]
        self.steps.append({"view_start": item.view_start, "before": self.req.canvas.clone()})

    def on_decide(self, strategy, batch) -> None:
        self.steps[-1]["logits"] = batch.logits[0].double().clone()      # [W, V]

    def on_step(self, record) -> None:
        self.steps[-1]["after"] = self.req.canvas.clone()

    def final_commit_row(self, pos: int) -> torch.Tensor:
        step = [s for s in self.steps if s["before"][pos] != s["after"][pos]][-1]
        return step["logits"][pos - step["view_start"]].log_softmax(-1)


def _check_entry(token: int, entry: dict[int, Logprob], k: int) -> None:
    """The chosen token first, then the top k by rank (the chosen one not repeated)."""
    chosen = entry[token]
    assert list(entry)[0] == token and chosen.rank >= 1 and chosen.logprob <= 0
    assert len(entry) == (k if chosen.rank <= k else k + 1)
    by_rank = sorted((lp.rank, lp.logprob) for t, lp in entry.items()
                     if t != token or chosen.rank <= k)
    assert [r for r, _ in by_rank] == list(range(1, k + 1))
    values = [v for _, v in by_rank]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    if values:
        assert (chosen.rank == 1) == (chosen.logprob >= values[0])


@pytest.mark.parametrize("decoding,kwargs", [
    ("cover", {}), ("threshold", {}), ("wino", {}), ("llada2_edit", {}),
    ("low_confidence", dict(temperature=1.5, seed=4))])
@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_report_each_tokens_final_commit(llm, decoding, kwargs, k) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=32, decoding=decoding, logprobs=k, **kwargs)
    recorder = _CommitRecorder(engine, "lp")
    engine.add_request("lp", "what is 9 + 9 ?", params)
    engine.add_observer(recorder)
    try:
        while engine.has_unfinished_requests():
            outs = engine.step()
    finally:
        engine.remove_observer(recorder)
    out = outs[-1]
    c = out.outputs[0]
    revised = out.metrics.replaces + out.metrics.remasks
    assert revised > 0 or decoding in ("threshold", "low_confidence")
    assert len(c.logprobs) == len(c.token_ids) > 0
    prompt_len = len(out.prompt_token_ids)
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        _check_entry(token, entry, k)
        ref = recorder.final_commit_row(prompt_len + i)
        assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-4)
        assert entry[token].rank == int((ref >= ref[token]).sum())
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(ref[t]), abs=1e-4)


def test_no_logprobs_unless_asked(llm) -> None:
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=8), use_tqdm=False)
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


# ---- stop_reason --------------------------------------------------------------------------
def test_stop_reason_string_token_and_none(llm) -> None:
    base = dict(max_tokens=32, block_length=8)
    (free,) = llm.generate([PROMPT], SamplingParams(ignore_eos=True, **base), use_tqdm=False)
    ids, text = free.outputs[0].token_ids, free.outputs[0].text
    assert free.outputs[0].finish_reason == "length" and free.outputs[0].stop_reason is None
    stop = text[2:4]
    (by_text,) = llm.generate([PROMPT], SamplingParams(ignore_eos=True, stop=["@@", stop],
                                                       **base), use_tqdm=False)
    assert by_text.outputs[0].finish_reason == "stop"
    assert by_text.outputs[0].stop_reason == stop and stop not in by_text.outputs[0].text
    token = ids[3]
    (by_id,) = llm.generate([PROMPT], SamplingParams(ignore_eos=True, stop_token_ids=[token],
                                                     **base), use_tqdm=False)
    c = by_id.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == token and c.token_ids[-1] == token
    (eos,) = llm.generate([PROMPT], SamplingParams(max_tokens=32), use_tqdm=False)
    if eos.outputs[0].finish_reason == "stop":                     # EOS: None, as in vLLM
        assert eos.outputs[0].stop_reason is None


# ---- decoding_params types ----------------------------------------------------------------
@pytest.mark.parametrize("decoding,given,match", [
    ("threshold", {"threshold": "high"}, r"decoding_params\.threshold .*a number or null.*str"),
    ("cover", {"max_draft": 1.5}, r"decoding_params\.max_draft .*an integer"),
    ("cover", {"final_verify": 1}, r"decoding_params\.final_verify .*a bool"),
    ("cover", {"k_min": True}, r"decoding_params\.k_min .*an integer.*bool"),
    ("sdar", {"remasking": 3}, r"decoding_params\.remasking .*a string"),
    ("threshold", {"threshold": [0.5]}, r"decoding_params\.threshold .*list")])
def test_decoding_params_of_the_wrong_type_name_key_and_type(llm, decoding, given,
                                                             match) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPT], SamplingParams(max_tokens=8, decoding=decoding,
                                              decoding_params=given), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
