"""The LM head on the read rows only (worker/logit_rows.py) against every view row: the same
tokens and NFE for every masked-rows-only decoder and cache mode, in fp32 and bf16, batched;
the rows it computes are the masked ones, bitwise the rows of the whole view."""

import random

import pytest
import torch

from cover_vllm.llm import LLM
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.worker.logit_rows import MIN_ROWS, read_rows

GEN, BLOCK = 32, 16


def _generate(llm: LLM, masked: bool, decoding: str, kv: str) -> list:
    llm.engine.executor.runner.masked_logits = masked
    spec = llm.engine.spec
    high = min(spec.eos_token_ids + (spec.mask_token_id,))
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(high) for _ in range(7 + 3 * i)]}
               for i in range(3)]
    sp = SamplingParams(max_tokens=GEN, block_length=BLOCK, ignore_eos=True, decoding=decoding,
                        kv_cache=kv, cache_refresh=None if kv == "none" else "block")
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.metrics.nfe) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_read_rows_only_keeps_tokens_and_nfe(llada_dir, dtype):
    llm = LLM(llada_dir, decoding="low_confidence", max_num_seqs=3, dtype=dtype)
    for decoding in ("low_confidence", "threshold", "cover"):
        for kv in ("none", "prefix", "dual"):
            assert _generate(llm, True, decoding, kv) == _generate(llm, False, decoding, kv), \
                (decoding, kv)


def _views_and_logits(llm: LLM, masked: bool) -> list:
    """(view input ids, the view's logits) of the first item of every step of one run."""
    runner = llm.engine.executor.runner
    seen, execute = [], runner.execute_model

    def spy(out):
        result = execute(out)
        item = out.items[0]
        canvas = item.canvases[0].input_ids
        seen.append((canvas[item.view_start - item.window_start:
                            item.view_end - item.window_start].clone(),
                     result.logits[0].clone()))
        return result

    runner.execute_model = spy
    try:
        _generate(llm, masked, "low_confidence", "dual")
    finally:
        del runner.execute_model
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_read_rows_are_the_masked_ones_bitwise(llada_dir, dtype):
    llm = LLM(llada_dir, decoding="low_confidence", max_num_seqs=3, dtype=dtype)
    mask_id, pruned = llm.engine.spec.mask_token_id, 0
    runs = zip(_views_and_logits(llm, True), _views_and_logits(llm, False))
    for (view, logits), (full_view, full) in runs:
        assert torch.equal(view, full_view)
        masked, zero = view == mask_id, (logits == 0).all(dim=1)
        assert torch.equal(logits[masked], full[masked])       # the read rows, bitwise
        assert torch.equal(logits[~zero], full[~zero])         # and the padding rows
        pruned += int(zero.sum())
    assert pruned > 0


def test_read_rows_pads_to_the_fewest_rows_and_keeps_whole_small_views():
    class Item:
        masked_rows_only, canvases, window_positions = True, [None], None
        view_start, view_end, window_start, window_len = 0, 20, 0, 20

    ids = torch.zeros(20, dtype=torch.long)
    ids[[3, 17]] = 9                                                  # two [MASK] rows
    keep = read_rows([Item()], [torch.arange(20)], ids, 9, 0)
    assert int(keep.sum()) == MIN_ROWS and bool(keep[3]) and bool(keep[17])
    assert read_rows([Item()], [torch.arange(MIN_ROWS - 1)], ids, 9, 0) is None
    Item.masked_rows_only = False
    assert read_rows([Item()], [torch.arange(20)], ids, 9, 0) is None
