"""cache_refresh: parsing, precedence, parity with kv_cache="none", adaptive triggers, sparse
windows against the full forward, and the FLOP counters."""

import dataclasses
import warnings

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.cache_refresh import CacheRefresh, RefreshState, parse_cache_refresh
from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine
from cover_vllm.entrypoints.cli import main
from cover_vllm.scheduler.output import SchedulerOutput

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 9, 14)]


def _params(**kw):
    base = dict(max_tokens=24, block_length=8, ignore_eos=True, decoding="threshold",
                decoding_params={"threshold": 0.7})
    return SamplingParams(**(base | kw))


# ---- parsing and validation ------------------------------------------------------------------
@pytest.mark.parametrize("text,mode,interval", [
    ("block", "block", None), ("adaptive", "adaptive", None), ("interval:1", "interval", 1),
    ("interval:8", "interval", 8), (" interval:3 ", "interval", 3)])
def test_parse_valid(text, mode, interval):
    policy = parse_cache_refresh(text)
    assert (policy.mode, policy.interval) == (mode, interval)
    assert parse_cache_refresh(policy.label) == policy
    assert parse_cache_refresh(policy) is policy


@pytest.mark.parametrize("bad", ["x", "", "interval", "interval:0", "interval:-2", "interval:a",
                                 "Block", "adaptive:3", 3, None])
def test_parse_invalid_names_the_allowed_forms(bad):
    with pytest.raises(ValueError) as exc:
        parse_cache_refresh(bad)
    message = str(exc.value)
    assert "cache_refresh" in message and "'interval:N' (N >= 1)" in message
    assert "'block'" in message and "'adaptive'" in message


def test_dataclass_validation():
    with pytest.raises(ValueError, match="interval"):
        CacheRefresh("interval")
    with pytest.raises(ValueError, match="takes no interval"):
        CacheRefresh("block", interval=2)
    with pytest.raises(ValueError, match="max_stale_steps"):
        CacheRefresh("adaptive", max_stale_steps=0)
    with pytest.raises(ValueError, match="min_cached_mass"):
        CacheRefresh("adaptive", min_cached_mass=1.5)
    assert CacheRefresh("adaptive").sparse and not CacheRefresh("interval", 2).sparse


def test_sampling_params_and_engine_config_validate():
    with pytest.raises(ValueError, match="SamplingParams.cache_refresh"):
        SamplingParams(cache_refresh="often")
    assert SamplingParams(cache_refresh="interval:2").cache_refresh == "interval:2"
    with pytest.raises(ValueError, match="cache_refresh"):
        EngineConfig(model="cover-tiny", cache_refresh="interval:0")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="cover-tiny", cache_refresh="adaptive", cache_refresh_interval=2)
    with pytest.warns(DeprecationWarning, match="interval:N"):
        config = EngineConfig(model="cover-tiny", cache_refresh_interval=3)
    assert config.refresh_policy == CacheRefresh("interval", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert EngineConfig(model="cover-tiny").refresh_policy == CacheRefresh("block")


@pytest.mark.parametrize("cmd", [["eval", "--num", "1"], ["bench", "throughput"]])
def test_cli_rejects_bad_policy(capsys, cmd):
    assert main(cmd + ["--cache-refresh", "sometimes"]) == 2
    assert "cache_refresh='sometimes'" in capsys.readouterr().err


# ---- the policy on its own -------------------------------------------------------------------
def test_adaptive_triggers_only_when_a_signal_crosses_its_bar():
    state = RefreshState(CacheRefresh("adaptive", budget=None))
    assert state.should_refresh(8, 10)                 # block start
    state.record(True, 5, 0)                           # the refresh's decision: 1 stale step
    state.cached_mass = 0.6
    assert not state.should_refresh(8, 10)
    state.record(False, 0, 0)                          # nothing changed: the cache did not age
    assert not state.should_refresh(8, 10)
    state.record(False, 1, 0)                          # second canvas-changing step
    assert state.should_refresh(8, 10)
    state.cached_mass = 0.1                            # the drafts hardly read the cache
    assert not state.should_refresh(8, 10)
    state.record(False, 1, 1)                          # a verification replaced a token
    assert state.should_refresh(8, 10)
    state.record(True, 0, 0)
    assert not state.should_refresh(8, 10)


def test_interval_and_block_policies():
    every2 = RefreshState(CacheRefresh("interval", 2))
    block = RefreshState(CacheRefresh("block"))
    seen = {"i2": [], "block": []}
    for _ in range(5):
        for name, state in (("i2", every2), ("block", block)):
            refresh = state.should_refresh(8, 10)
            seen[name].append(refresh)
            state.record(refresh, 3, 1)
    assert seen == {"i2": [True, False, True, False, True],
                    "block": [True, False, False, False, False]}


def test_budget_allows_one_free_refresh_then_needs_saved_rows():
    state = RefreshState(CacheRefresh("adaptive", budget=0.5, min_cached_mass=None))
    assert state.should_refresh(8, 20)                 # block start: credit for one refresh
    state.record(True, 4, 0)
    state.record(False, 1, 0)
    assert state.should_refresh(8, 20)                 # the free one
    state.record(True, 1, 0)
    state.record(False, 1, 0)
    assert not state.should_refresh(8, 20)             # no rows saved yet
    state.save(9)
    assert not state.should_refresh(8, 20)             # 9 < 0.5 * 20
    state.save(1)
    assert state.should_refresh(8, 20)


# ---- engine: parity, precedence, triggers ----------------------------------------------------
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_interval_1_equals_none(llada_dir, mode):
    exact = LLM(llada_dir, kv_cache="none").generate(PROMPTS, _params(), use_tqdm=False)
    engine_wide = LLM(llada_dir, kv_cache=mode, cache_refresh="interval:1").generate(
        PROMPTS, _params(), use_tqdm=False)
    per_request = LLM(llada_dir, kv_cache=mode).generate(
        PROMPTS, _params(cache_refresh="interval:1"), use_tqdm=False)
    want = [o.outputs[0].token_ids for o in exact]
    for outs in (engine_wide, per_request):
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.metrics.refreshes == o.metrics.nfe for o in outs)
        assert [o.metrics.flops for o in outs] == [o.metrics.flops for o in exact]


def test_per_request_policy_overrides_the_engine_default(llada_dir):
    llm = LLM(llada_dir, kv_cache="dual", cache_refresh="interval:1")
    default, block = llm.generate(PROMPTS[:1] * 2, [_params(), _params(cache_refresh="block")],
                                  use_tqdm=False)
    assert default.metrics.refreshes == default.metrics.nfe
    assert block.metrics.refreshes == 3                # one per block of the 24-token answer
    llm = LLM(llada_dir, kv_cache="dual")
    (out,) = llm.generate(PROMPTS[:1], _params(cache_refresh=CacheRefresh("interval", 1)),
                          use_tqdm=False)
    assert out.metrics.refreshes == out.metrics.nfe


def test_adaptive_refreshes_when_the_signal_crosses_and_not_otherwise(llada_dir):
    llm = LLM(llada_dir, kv_cache="dual", decoding="low_confidence")
    sp = dict(max_tokens=16, block_length=16, steps=8, ignore_eos=True)
    never = CacheRefresh("adaptive", max_stale_steps=100, budget=None)
    often = CacheRefresh("adaptive", max_stale_steps=1, min_cached_mass=None, budget=None)
    quiet, busy = llm.generate(PROMPTS[:1] * 2, [SamplingParams(**sp, cache_refresh=never),
                                                 SamplingParams(**sp, cache_refresh=often)],
                               use_tqdm=False)
    assert quiet.metrics.refreshes == 1                # the block start only
    assert busy.metrics.refreshes == busy.metrics.nfe == 8


@pytest.mark.parametrize("model", ["llada", "dream"])
@pytest.mark.parametrize("decoding", ["threshold", "low_confidence", "cover"])
def test_adaptive_decodes_and_saves_rows(llada_dir, dream_dir, model, decoding):
    path = llada_dir if model == "llada" else dream_dir
    sp = dict(max_tokens=24, block_length=8, ignore_eos=True, decoding=decoding)
    exact = LLM(path, kv_cache="none").generate(PROMPTS, SamplingParams(**sp), use_tqdm=False)
    outs = LLM(path, kv_cache="dual", cache_refresh="adaptive").generate(
        PROMPTS, SamplingParams(**sp), use_tqdm=False)
    for o, e in zip(outs, exact):
        assert len(o.outputs[0].token_ids) == 24 and 3 <= o.metrics.refreshes <= o.metrics.nfe
        assert 0 < o.metrics.forward_tokens < e.metrics.forward_tokens
        assert 0 < o.metrics.flops < e.metrics.flops


# ---- a sparse window is a cache read, exact on an unchanged canvas ---------------------------
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_sparse_window_equals_full_forward_on_an_unchanged_canvas(llada_dir, dream_dir, model):
    engine = Engine(EngineConfig(model=llada_dir if model == "llada" else dream_dir,
                                 decoding="low_confidence", kv_cache="dual",
                                 cache_refresh=CacheRefresh("adaptive", max_stale_steps=100)))
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=16, block_length=16,
                                                            steps=4, ignore_eos=True))
    engine.step()                                      # block-start refresh: commits 4 tokens
    req = engine.scheduler.running[0]
    req.needs_refresh = True                           # a whole forward on the current canvas
    full = engine.schedule()
    assert full.items[0].is_refresh and full.items[0].window_positions is None
    logits_full = engine.executor.execute_model(full).logits[0]
    req.note_written(full.items[0])
    req.needs_refresh = False
    part = engine.schedule()
    item = part.items[0]
    start, end = req.block
    masked = req.canvas[start:end] == req.mask_id
    assert item.window_positions is not None and not item.is_refresh
    assert item.window_len < end - start + engine.spec.logit_shift
    logits_part = engine.executor.execute_model(part).logits[0]
    assert (logits_full[masked] - logits_part[masked]).abs().max().item() <= 1e-4
    rows = (torch.arange(start, end) - engine.spec.logit_shift).clamp(min=0)
    left_out = ~torch.isin(rows, item.window_positions)   # predictor rows not forwarded
    assert bool(left_out.any()) and bool((logits_part[left_out] == 0).all())


def test_sparse_dense_and_cfg_items_of_one_forward_get_their_own_logits(llada_dir):
    """The runner lays every view back to back (a sparse one with zero rows where it has no
    row): each item of a mixed batch reads the logits it gets when run alone."""
    engine = Engine(EngineConfig(model=llada_dir, decoding="low_confidence", kv_cache="dual"))
    base = dict(max_tokens=16, block_length=16, steps=4, ignore_eos=True)
    sparse = CacheRefresh("adaptive", max_stale_steps=100)     # no refresh but the first
    engine.add_request("sparse", [5, 6, 7, 8], SamplingParams(cache_refresh=sparse, **base))
    engine.add_request("dense", [9, 10, 11], SamplingParams(**base))
    engine.add_request("cfg", [12, 13], SamplingParams(decoding_params={"cfg_scale": 1.0},
                                                       **base))
    engine.step()                                      # block-start refreshes
    engine.step()                                      # the sparse window now leaves out
    out = engine.schedule()                            # the tokens it forwarded last step
    items = {i.request_id: i for i in out.items}
    assert items["sparse"].window_positions is not None and len(items["cfg"].canvases) == 2
    together = engine.executor.execute_model(out).logits
    for item, logits in zip(out.items, together):
        alone = engine.executor.execute_model(SchedulerOutput([item])).logits[0]
        assert logits.shape == alone.shape == (item.view_end - item.view_start, logits.shape[-1])
        assert torch.allclose(logits, alone, atol=1e-5), item.request_id
    rows = torch.arange(items["sparse"].view_start, items["sparse"].view_end)
    left_out = ~torch.isin(rows, items["sparse"].window_positions)
    assert bool(left_out.any()) and bool((together[0][left_out] == 0).all())


def test_the_refresh_gate_measures_its_mass_without_the_strategy_statistics(llada_dir):
    """low_confidence reads no statistics: an adaptive item asks only for the attention mass
    (no key drift), and gets the values a fully measured forward gives."""
    engine = Engine(EngineConfig(model=llada_dir, decoding="low_confidence", kv_cache="dual",
                                 cache_refresh="adaptive"))
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=16, block_length=8,
                                                         steps=4, ignore_eos=True))
    engine.step()
    out = engine.schedule()
    item = out.items[0]
    assert item.want_mass and not item.want_stats
    gate = engine.executor.execute_model(out)
    full = engine.executor.execute_model(
        SchedulerOutput([dataclasses.replace(item, want_stats=True)]))
    assert gate.drift == [None] and full.drift[0] is not None
    assert gate.cached_mass[0] == pytest.approx(full.cached_mass[0], abs=1e-6)
    assert 0.0 < gate.cached_mass[0] < 1.0
    assert torch.allclose(gate.column_mass[0], full.column_mass[0], atol=1e-6)


def test_strategies_that_read_every_row_keep_whole_windows(llada_dir):
    engine = Engine(EngineConfig(model=llada_dir, decoding="saber", kv_cache="dual",
                                 cache_refresh="adaptive"))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=16, block_length=8))
    engine.step()
    item = engine.schedule().items[0]
    assert item.window_positions is None


# ---- FLOPs ----------------------------------------------------------------------------------
def test_flops_count_window_rows_and_refreshes(llada_dir):
    llm = LLM(llada_dir, kv_cache="none")
    (none,) = llm.generate(PROMPTS[:1], _params(), use_tqdm=False)
    canvas = 5 + 24
    assert none.metrics.forward_tokens == none.metrics.nfe * canvas
    fm = llm.engine.flop_model
    want = none.metrics.nfe * fm.forward(canvas, canvas * canvas, 8)
    assert none.metrics.flops == pytest.approx(want)
    (dual,) = LLM(llada_dir, kv_cache="dual").generate(PROMPTS[:1], _params(), use_tqdm=False)
    assert dual.metrics.forward_tokens == 3 * canvas + (dual.metrics.nfe - 3) * 8
    assert fm.params_per_token > 0 and torch.isfinite(torch.tensor(dual.metrics.flops))


def test_a_refresh_is_one_item_of_a_mixed_batch(llada_dir):
    """One request refreshing never turns its batch-mates' steps into refreshes."""
    engine = Engine(EngineConfig(model=llada_dir, decoding="threshold", kv_cache="dual"))
    engine.add_request("every", [5, 6, 7], SamplingParams(max_tokens=16, block_length=8,
                                                          cache_refresh="interval:1"))
    engine.add_request("block", [5, 6, 7], SamplingParams(max_tokens=16, block_length=8))
    engine.step()                                      # both start their block: refreshes
    items = {i.request_id: i for i in engine.schedule().items}
    assert items["every"].is_refresh and items["every"].window_len == 3 + 16
    assert not items["block"].is_refresh and items["block"].window_len == 8
