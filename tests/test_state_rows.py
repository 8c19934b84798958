"""A decoder's per-request memory as rows of one table (strategies/state_rows.py, issue #43):
rows are zeroed when taken, kept when the table grows, freed with their handle; snapshots are
detached copies a strategy moves into its table; an engine run returns every row it took."""

import copy
import gc

import numpy as np

from cover_vllm import LLM, SamplingParams
from cover_vllm.strategies.cover import Cover
from cover_vllm.strategies.wino import Wino
from cover_vllm.strategies.state_rows import RowMemory, StateRows

FIELDS = ("a", "b")


def test_rows_are_zeroed_kept_across_growth_and_freed_with_their_handle():
    table = StateRows(FIELDS)
    first = RowMemory(table, 3)
    first.a[:] = [1.0, 2.0, 3.0]
    others = [RowMemory(table, 5) for _ in range(12)]          # more rows and wider: grows
    assert table.data.shape[0] >= 13 and table.data.shape[2] == 5
    assert first.a.tolist() == [1.0, 2.0, 3.0] and first.b.tolist() == [0.0] * 3
    row = others[0].row
    others[0].b[:] = 7.0
    del others[0]
    gc.collect()
    again = RowMemory(table, 4)                                # the freed row, zeroed
    assert again.row == row and not again.stacked().any()
    rows = {m.row for m in (first, again, *others)}
    assert len(rows) == 13                                     # no row is shared


def test_a_deep_copy_is_detached_and_adopted_by_value():
    table = StateRows(FIELDS)
    mem = RowMemory(table, 2)
    mem.stacked()
    mem.a[:] = [4.0, 5.0]
    snap = copy.deepcopy(mem)
    assert snap.table is not table and snap == mem
    mem.a[:] = 0.0                                             # the copy does not follow
    assert snap.a.tolist() == [4.0, 5.0] and snap != mem
    table.adopt(snap)
    assert snap.table is table and snap.row != mem.row and snap.a.tolist() == [4.0, 5.0]
    np.testing.assert_array_equal(table.gather(np.array([snap.row]), np.array([1])), [[5.0, 0.0]])


def test_an_engine_run_plans_once_per_instance_and_frees_every_cover_row(monkeypatch):
    calls = []
    for cls, hook in ((Cover, "plan_seeds"), (Wino, "plan_extra_rows")):
        def spy(self, states, *rest, _inner=getattr(cls, hook), _name=cls.name):
            calls.append((_name, len(states)))
            return _inner(self, states, *rest)
        monkeypatch.setattr(cls, hook, spy)
    llm = LLM("cover-tiny", num_threads=1)
    prompts = [{"prompt_token_ids": [5 + (i + j) % 7 for j in range(12)]} for i in range(3)]
    params = [SamplingParams(max_tokens=16, block_length=8, decoding=d)
              for d in ("cover", "wino", "cover", "wino", "cover", "wino")]
    llm.generate(prompts * 2, params, use_tqdm=False)
    # one call per instance and step, with all of its requests (3 each while all run)
    assert max(n for name, n in calls if name == "cover") == 3
    assert max(n for name, n in calls if name == "wino") == 3
    gc.collect()
    covers = [s for s in llm.engine.stage._cache.values() if isinstance(s, Cover)]
    assert covers and all(s.memory_rows.data.shape[0] > 0 for s in covers)   # rows were used
    for s in covers:
        assert sorted(s.memory_rows._free) == list(range(s.memory_rows.data.shape[0]))
