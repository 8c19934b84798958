"""ASRD in the engine (batched == alone, metrics) and the two data-path extensions it and WINO use:
input-embedding edits and extra query rows, checked through the model runner."""

import random

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine
from cover_vllm.scheduler.output import CanvasInput, EmbedEdit, ExtraRows, SchedulerOutput, WorkItem
from cover_vllm.strategies import make_params
from cover_vllm.worker.embed_edits import orthogonal_unit

MASK = 299


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(290) for _ in range(rng.randint(4, 16))]}
            for _ in range(n)]


@pytest.mark.parametrize("mode", ["none", "dual"])
def test_asrd_batched_equals_alone_and_reports_revisions(llada_dir, mode):
    llm = LLM(llada_dir, kv_cache=mode)
    prompts = _prompts(10, seed=3)
    params = [SamplingParams(max_tokens=16 + 8 * (i % 3), block_length=8, ignore_eos=True,
                             decoding=["asrd", "asrd", "wino", "threshold", "asrd"][i % 5])
              for i in range(10)]
    together = llm.generate(prompts, params, use_tqdm=False)
    totals = dict.fromkeys(("remasks", "keeps", "seeds_verified", "flip_flops", "replaces"), 0)
    for prompt, p, out in zip(prompts, params, together):
        (alone,) = llm.generate([prompt], p, use_tqdm=False)
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.metrics.as_dict() | {"latency_s": 0} == out.metrics.as_dict() | {
            "latency_s": 0}
        if p.decoding == "asrd":
            m = out.metrics
            assert m.seeds_verified == m.keeps + m.remasks + m.replaces
            assert m.flip_flops <= m.remasks and MASK not in out.outputs[0].token_ids
            for key in totals:
                totals[key] += getattr(m, key)
    assert totals["seeds_verified"] > 0 and totals["remasks"] > 0 and totals["keeps"] > 0


def test_asrd_guides_masked_slots_with_anchors(llada_dir):
    """Anchors form on this model and their signal changes what is drafted (guide on vs off)."""
    llm = LLM(llada_dir, kv_cache="none")
    prompts = _prompts(8, seed=3)
    base = dict(max_tokens=32, block_length=8, ignore_eos=True, decoding="asrd")
    on = llm.generate(prompts, SamplingParams(**base), use_tqdm=False)
    off = llm.generate(prompts, SamplingParams(**base, decoding_params={"guide_strength": 0.0}),
                       use_tqdm=False)
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(on, off))


def test_asrd_params_are_validated():
    with pytest.raises(ValueError, match="anchor_threshold"):
        make_params("asrd", {"anchor_threshold": 1.5})
    with pytest.raises(ValueError, match="max_verify"):
        make_params("asrd", {"max_verify": -1})
    with pytest.raises(ValueError, match="guide_distance"):
        make_params("asrd", {"guide_distance": 0.0})
    with pytest.raises(ValueError, match="threshold_back"):
        make_params("wino", {"threshold_back": 2.0})


# ---- the data path ------------------------------------------------------------------------------
def _engine(llada_dir):
    return Engine(EngineConfig(model=llada_dir, decoding="low_confidence", kv_cache="none"))


def _item(ids, **kwargs):
    n = int(ids.numel())
    return WorkItem("r", 0, [CanvasInput(ids, torch.arange(n))], view_start=0, view_end=n,
                    **kwargs)


def test_embed_edit_mixing_token_embeddings_equals_that_token(llada_dir):
    """e_MASK + e_t − e_MASK at position p is the canvas with token t at p: the mixed embedding
    is e_t to within one fp32 rounding, so the logits agree to a few ulps of their scale (a
    wrong mix moves them by O(1)). The bound is relative: an absolute 1e-5 failed on an AMX
    CPU at 1.0014e-5 with logits of magnitude 16, i.e. 5 ulps, before any change of ours."""
    engine = _engine(llada_dir)
    ids = torch.tensor([5, 17, MASK, 42, MASK, 8])
    edit = EmbedEdit(positions=torch.tensor([2]), mix_ids=torch.tensor([[123, MASK]]),
                     mix_weights=torch.tensor([[1.0, -1.0]]), perturb=torch.zeros(1))
    (edited,) = engine.executor.execute_model(SchedulerOutput([_item(ids, embed_edit=edit)])).logits
    swapped = ids.clone()
    swapped[2] = 123
    (plain,) = engine.executor.execute_model(SchedulerOutput([_item(swapped)])).logits
    ulp = torch.finfo(torch.float32).eps * plain.abs().max().item()
    assert (edited - plain).abs().max().item() <= 16 * ulp


def test_orthogonal_perturbation_directions():
    e = torch.randn(6, 64)
    u = orthogonal_unit(e, seed=3)
    assert torch.allclose(u.norm(dim=-1), torch.ones(6), atol=1e-5)
    assert (u * e).sum(-1).abs().max().item() <= 1e-4
    assert torch.equal(u, orthogonal_unit(e, seed=3))


def test_extra_rows_equal_a_dense_forward_with_the_wino_mask(llada_dir):
    """Shadow rows through the paged runner == the dense model on the extended sequence with
    WINO's 4-D mask and position ids; canvas rows are unchanged by them."""
    engine = _engine(llada_dir)
    model = engine.executor.runner.model
    ids = torch.tensor([5, 17, 33, 42, 61, MASK, 9, MASK])
    start, end = 4, 8                                     # the "current block"
    e, length = end - start, int(ids.numel())
    allowed = torch.ones(e, length + e, dtype=torch.bool)
    allowed[torch.arange(e), torch.arange(start, end)] = False
    extra = ExtraRows(torch.full((e,), MASK), torch.arange(start, end), allowed)
    out = engine.executor.execute_model(SchedulerOutput([_item(ids, extra=extra)]))
    (plain,) = engine.executor.execute_model(SchedulerOutput([_item(ids)])).logits
    assert torch.equal(out.logits[0], plain)
    full = torch.cat([ids, torch.full((e,), MASK)])
    mask = torch.ones(length + e, length + e, dtype=torch.bool)
    mask[:length, length:] = False
    mask[length:] = allowed
    positions = torch.cat([torch.arange(length), torch.arange(start, end)])
    from cover_vllm.models.base import dense_forward
    dense = dense_forward(model, full[None], positions[None], mask[None, None])[0]
    assert (out.extra_logits[0] - dense[length:]).abs().max().item() <= 1e-4
