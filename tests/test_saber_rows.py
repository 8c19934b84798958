"""Saber's per-slot confidences as rows of one table (strategies/saber_rows.py, issue #48): the
thresholds' grouped mean has the per-request mean's bits; a batch decided together, with requests
joining, leaving and reordered between steps, decides and remembers what each request decides
alone; an engine run returns every row it took, aborted requests included."""

import gc

import numpy as np
import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies import make_params
from cover_vllm.strategies.base import BlockState, StepBatch, decide_now
from cover_vllm.strategies.saber import Saber
from cover_vllm.strategies.saber_rows import thresholds, thresholds_per_row

V, MASK = 24, 23
NEG_INF = float("-inf")


def test_grouped_thresholds_have_the_per_row_bits():
    """Counts that share a length and counts that do not, empty rows, tails past a whole
    vector (lengths up to 300), values spanning many exponents."""
    g = torch.Generator().manual_seed(0)
    for width in (1, 7, 16, 33, 130, 300):
        record = torch.rand(40, width, generator=g) ** 4
        keep = torch.rand(40, width, generator=g) < torch.rand(40, 1, generator=g)
        keep[:5] = keep[5]                                   # several rows with one count
        keep[6] = False                                      # nothing recorded: τ = 1
        record = record.masked_fill(~keep, NEG_INF)
        want = thresholds_per_row(record)
        got = thresholds(record)
        assert got.dtype == torch.float32 and torch.equal(got, want), width
        assert got[6] == 1.0


def _spec(dream: bool) -> ModelSpec:
    return ModelSpec(family="dream" if dream else "llada", vocab_size=V, mask_token_id=MASK,
                     eos_token_ids=(V - 2,), pad_token_id=V - 2, logit_shift=int(dream),
                     max_model_len=256, threshold_quota=dream, saber_dream=dream)


class Req:
    """One request of a random Saber run: a generation of `gen` slots in blocks of `block`,
    each step's logits drawn from its own stream (the view is every slot up to the block end)."""

    def __init__(self, seed: int, strategy: Saber):
        self.g = torch.Generator().manual_seed(seed)
        self.gen = int(torch.randint(6, 20, (1,), generator=self.g))
        self.block = int(torch.randint(3, self.gen + 1, (1,), generator=self.g))
        self.tokens = torch.full((self.gen,), MASK)
        self.block_start, self.steps = 0, []
        self.state = BlockState(block_steps=8, block_size=self.block, max_tokens=self.gen)
        strategy.start_block(self.state, self.block)
        self.done = False

    @property
    def block_end(self) -> int:
        return min(self.block_start + self.block, self.gen)

    def logits(self, step: int) -> torch.Tensor:
        """[view, V] logits of this request's step `step` (drawn once, the same for every run)."""
        while len(self.steps) <= step:
            x = 4 * torch.randn(self.gen, V, generator=self.g)
            x[:, MASK] = NEG_INF
            self.steps.append(x)
        return self.steps[step][: self.block_end]


def _batch(reqs: list[Req], step: dict[int, int]) -> StepBatch:
    n, width = len(reqs), max(r.block_end for r in reqs)
    logits = torch.zeros(n, width, V)
    tokens = torch.full((n, width), MASK)
    valid, in_block = (torch.zeros(n, width, dtype=torch.bool) for _ in range(2))
    for i, r in enumerate(reqs):
        w = r.block_end
        logits[i, :w], tokens[i, :w], valid[i, :w] = r.logits(step[id(r)]), r.tokens[:w], True
        in_block[i, r.block_start:w] = True
    return StepBatch(logits=logits, tokens=tokens, valid=valid, in_block=in_block,
                     is_gen=valid.clone(), states=[r.state for r in reqs],
                     temperature=torch.zeros(n, dtype=torch.float64),
                     top_p=torch.ones(n, dtype=torch.float64),
                     top_k=torch.full((n,), -1), generators=[None] * n, mask_id=MASK)


def _advance(strategy: Saber, reqs: list[Req], step: dict[int, int]) -> list[list]:
    """One decision for `reqs` together, applied; each request's decision as lists."""
    d = decide_now(strategy, _batch(reqs, step))
    out = []
    for i, r in enumerate(reqs):
        w = r.block_end
        commit, remask = d.commit[i, :w], d.remask[i, :w]
        r.tokens[:w] = torch.where(commit, d.tokens[i, :w], r.tokens[:w])
        r.tokens[:w] = r.tokens[:w].masked_fill(remask, MASK)
        out.append([commit.tolist(), remask.tolist(), d.tokens[i, :w][commit].tolist()])
        step[id(r)] += 1
        left = int((r.tokens[r.block_start:r.block_end] == MASK).sum())
        if strategy.block_done(r.state, left):
            if r.block_end == r.gen:
                r.done = True
            else:
                r.block_start = r.block_end
                r.state.step = 0
                strategy.start_block(r.state, r.block_end - r.block_start)
    return out


def _memory(r: Req) -> np.ndarray:
    return r.state.memory["rows"].stacked()


@pytest.mark.parametrize("dream", [False, True], ids=["llada", "dream"])
def test_rows_of_a_batch_decide_as_each_request_alone(dream):
    """Random requests join at random steps and leave when done (their rows are reused by later
    ones); the batch order is shuffled every step, so a row read for the wrong request (or a
    stale row of a finished one) changes a decision or a memory."""
    spec = _spec(dream)
    shared = Saber(make_params("saber", None), spec)
    order = torch.Generator().manual_seed(99)
    pending = [Req(seed, shared) for seed in range(14)]
    alone = {}                       # request -> (its own Saber, its twin, the twin's steps)
    for seed, r in enumerate(pending):
        own = Saber(make_params("saber", None), spec)
        twin = Req(seed, own)
        alone[id(r)] = (own, twin, {id(twin): 0})
    running, step, holders = [], {}, {}
    for _ in range(400):
        while pending and (not running or torch.rand(1, generator=order) < 0.4):
            r = pending.pop(0)
            running.append(r)
            step[id(r)] = 0
        if not running:
            break
        perm = torch.randperm(len(running), generator=order).tolist()
        batch = [running[i] for i in perm]
        got = _advance(shared, batch, step)
        for r, decision in zip(batch, got):
            own, twin, twin_step = alone[id(r)]
            assert _advance(own, [twin], twin_step)[0] == decision
            np.testing.assert_array_equal(_memory(r), _memory(twin))
            holders.setdefault(r.state.memory["rows"].row, set()).add(id(r))
        running = [r for r in running if not r.done]
        for r in batch:
            if r.done:
                r.state.memory.clear()              # the engine drops a finished state
        gc.collect()
    reused = any(len(ids) > 1 for ids in holders.values())
    assert not pending and not running and reused
    table = shared.memory_rows.table
    assert sorted(table._free) == list(range(table.data.shape[0]))


def test_an_engine_run_frees_every_saber_row_finished_or_aborted():
    llm = LLM("cover-tiny", num_threads=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=16, block_length=8, decoding="saber", ignore_eos=True)
    for i in range(4):
        engine.add_request(f"s{i}", {"prompt_token_ids": [5 + (i + j) % 7 for j in range(12)]},
                           params)
    engine.step()
    engine.step()
    engine.abort_request("s1")
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    sabers = [s for s in engine.stage._cache.values() if isinstance(s, Saber)]
    assert sabers
    for s in sabers:
        table = s.memory_rows.table
        assert table.data.shape[0] > 0                   # rows were used
        assert sorted(table._free) == list(range(table.data.shape[0]))
