"""Decisions read the model's probabilities: top_p / top_k shape sampling only.

At temperature 0 the candidates are the argmax, which truncation never removes, so a strategy
whose bars (threshold, COVER's draft bar, WINO's, Saber's, ...) read the model's own
distribution must give the same tokens and NFE whatever top_p / top_k say. A strategy that
compared a renormalised, truncated confidence against its bar would commit more per step.
"""

import pytest

from cover_vllm import LLM, SamplingParams
from cover_vllm.strategies import STRATEGIES
from cover_vllm.tasks import chat_prompt_ids, get_task
from conftest import DREAM_DIR

TRUNCATIONS = [dict(top_p=0.5), dict(top_p=0.9, top_k=2)]


def _run(llm, prompts, decoding, **truncation):
    params = SamplingParams(max_tokens=32, temperature=0.0, decoding=decoding, seed=1,
                            **truncation)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.metrics.nfe) for o in outs]


@pytest.fixture(scope="module")
def tiny():
    llm = LLM("cover-tiny", kv_cache="none", num_threads=1)
    prompts = [{"prompt_token_ids": chat_prompt_ids(llm.tokenizer, ex.prompt)}
               for name in ("arith", "sudoku4", "word") for ex in get_task(name).eval_split(2)]
    return llm, prompts


@pytest.mark.parametrize("decoding", sorted(STRATEGIES))
def test_top_p_and_top_k_never_change_greedy_decisions(tiny, decoding):
    llm, prompts = tiny
    plain = _run(llm, prompts, decoding)
    for truncation in TRUNCATIONS:
        assert _run(llm, prompts, decoding, **truncation) == plain, truncation


@pytest.mark.parametrize("decoding", ["maskgit_plus", "topk_margin", "entropy", "saber",
                                      "threshold", "cover"])
def test_top_p_never_changes_greedy_decisions_on_dream(decoding):
    llm = LLM(DREAM_DIR, kv_cache="none", num_threads=1)
    prompts = [{"prompt_token_ids": [223, 56, 136, 118, 264, 68]},
               {"prompt_token_ids": [73, 284, 28, 99, 211, 100, 240]}]
    plain = _run(llm, prompts, decoding)
    for truncation in TRUNCATIONS:
        assert _run(llm, prompts, decoding, **truncation) == plain, truncation
